"""Every script in examples/ runs to the end with small settings and writes what it says it writes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_GRAPH = [
    "--dim",
    "8",
    "--heads",
    "1",
    "--head-dim",
    "4",
    "--memories",
    "8",
    "--pe-dim",
    "4",
    "--epochs",
    "2",
    "--no-progress",
]


def run(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_integrate(tmp_path):
    run("integrate.py", "--out", str(tmp_path / "integrate.png"))
    assert (tmp_path / "integrate.png").stat().st_size > 0


def test_train_image(tmp_path):
    run("train_image.py", "--out", str(tmp_path), "--epochs", "1")
    assert (tmp_path / "checkpoint.safetensors").is_file()


def test_study_stability(tmp_path):
    run("study_stability.py", "--out", str(tmp_path), "--samples", "1")
    assert list(tmp_path.glob("*.png"))


@pytest.mark.slow
def test_study_landscape(tmp_path):  # about a minute of CPU: the landscape study forms dense Hessians
    out = run("study_landscape.py", "--out", str(tmp_path))
    assert "branch point at 0.54203348" in out and "closed form a* = 0.54203348" in out
    assert (tmp_path / "pitchfork.png").is_file() and (tmp_path / "report" / "basins.png").is_file()


def test_train_graph_classification(fixtures, tmp_path):
    pytest.importorskip("torch_geometric")
    out = run(
        "train_graph_classification.py",
        "--root",
        str(fixtures),
        "--folds",
        "2",
        "--ensemble",
        "2",
        "--out",
        str(tmp_path),
        *TINY_GRAPH,
    )
    assert "MUTAG: 2-fold test accuracy" in out
    assert (tmp_path / "cv_results.json").is_file()
    assert (tmp_path / "fold_0" / "member_1" / "checkpoint.safetensors").is_file()


def test_detect_graph_anomalies(tmp_path):
    pytest.importorskip("torch_geometric")
    out = run("detect_graph_anomalies.py", "--out", str(tmp_path), *TINY_GRAPH)
    assert "test AUC / macro-F1" in out and "gcn" in out
    assert (tmp_path / "anomaly_results.json").is_file()


def test_complete_photos(tmp_path):
    pytest.importorskip("skimage")
    out = run(
        "complete_photos.py", "--out", str(tmp_path), "--minutes", "0.03", "--train-limit", "128", "--test-limit", "16"
    )
    assert "test masked-patch MSE on 16 tiles of held-out photographs" in out and "biharmonic" in out
    assert (tmp_path / "evaluation" / "completions.npz").is_file()


def test_emergent_memories(tmp_path):  # the log-sum-ReLU reproduction of docs/guides/own-energy.md
    out = run("emergent_memories.py", "--out", str(tmp_path / "emergent.png"), "--grid", "31")
    assert "counts match the paper's Fig. 1 in every panel" in out
    assert "2 | 1.1 | 3 + 4 | 3 + 4 |" in out and "1 | 0.9 | 2 + 1 | 2 + 1 |" in out
    assert (tmp_path / "emergent.png").stat().st_size > 0
