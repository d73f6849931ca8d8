"""Reliability and security: no file the library reads can run code, and each is checked before use; runs never
clobber each other and resume only on the data they read; every bad input gets a documented exception that names the
argument."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from et_ode import Adaptive, Adjoint, EnergyTransformer, ETField, EulerET, Fixed, SolveError, Status, SteadyState, solve
from et_ode.cli import build_parser, main
from et_ode.models.image import ImageET
from et_ode.tasks.demo import demo
from et_ode.tasks.image import ImageRunConfig
from et_ode.training.io import FORMAT, load_model, load_states, model_config, save_model
from et_ode.training.runs import LOCK_NAME, RunFolderError, claim
from et_ode.training.train import CHECKPOINT_NAME, TrainConfig, fit, load_checkpoint, save_checkpoint
from tests.conftest import random_model
from tests.training.test_train import NoisyRegression, linear, regression_data

TINY = [
    "--train-limit",
    "32",
    "--test-limit",
    "16",
    "--val-size",
    "8",
    "--dim",
    "8",
    "--heads",
    "2",
    "--head-dim",
    "4",
    "--solver",
    "et",
    "--step",
    "0.1",
    "--steps",
    "2",
    "--gradient",
    "direct",
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--no-progress",
    "--threads",
    "1",
    "--no-baselines",
]
README = Path(__file__).resolve().parents[2] / "README.md"


# ============================================================================================ files hold data only
class Payload:
    """Unpickling this creates ``marker``: what an attacker's ``__reduce__`` would do (with os.system instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def planted(path: Path, marker: Path, content: dict | None = None) -> Path:
    torch.save({**(content or {}), "payload": Payload(marker)}, path)
    return path


def test_payload_in_a_training_checkpoint_is_refused_unrun(tmp_path):
    marker = tmp_path / "pwned"
    for name in (CHECKPOINT_NAME, "checkpoint.pt"):  # today's name and the old pickle one
        path = planted(tmp_path / name, marker, {"model": {"w": torch.ones(2)}})
        with pytest.raises(ValueError, match="refused: it is a pickle"):
            load_checkpoint(path)
        assert not marker.exists()
    run = tmp_path / "run"  # resume: fit reads the planted checkpoint of its out_dir
    run.mkdir()
    planted(run / CHECKPOINT_NAME, marker, {"model": {}})
    with pytest.raises(ValueError, match="refused"):
        fit(
            linear(),
            NoisyRegression(),
            regression_data(),
            None,
            TrainConfig(epochs=1, out_dir=str(run), resume=True, progress=False),
        )
    assert not marker.exists()
    legacy = tmp_path / "legacy"  # an old run folder: resuming it must not silently start afresh
    legacy.mkdir()
    planted(legacy / "checkpoint.pt", marker, {"model": {}})
    with pytest.raises(ValueError, match="holds checkpoint.pt, a pickle checkpoint of an older et-ode"):
        fit(
            linear(),
            NoisyRegression(),
            regression_data(),
            None,
            TrainConfig(epochs=1, out_dir=str(legacy), resume=True, progress=False),
        )
    assert not marker.exists() and sorted(p.name for p in legacy.iterdir()) == ["checkpoint.pt"]


def test_payload_through_the_cli_is_refused_unrun(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = planted(tmp_path / CHECKPOINT_NAME, marker, {"model": {}, "meta": {}})
    assert main(["complete", str(path), "--index", "0", "--out", str(tmp_path / "c")]) == 2
    assert "refused: it is a pickle" in capsys.readouterr().err and not marker.exists()
    model_file = planted(tmp_path / "et_block.pt", marker, {"format": FORMAT})
    states = tmp_path / "tokens.pt"
    torch.save(Payload(marker), states)
    for options in (["--model", str(model_file)], ["--x0", str(states)]):
        code = main(["analyze", *options, "--out", str(tmp_path / f"a{len(options[1])}"), "--no-progress"])
        assert code == 2 and not marker.exists()
    err = capsys.readouterr().err
    assert "not a readable model file" in err and "x0:" in err


def test_payload_in_a_model_file_or_states_file_is_refused_unrun(tmp_path):
    marker = tmp_path / "pwned"
    model = random_model()
    path = planted(
        tmp_path / "m.pt", marker, {"format": FORMAT, "config": model_config(model), "state_dict": model.state_dict()}
    )
    with pytest.raises(ValueError, match="refused unread by weights_only=True"):
        load_model(path)
    states = tmp_path / "x0.pt"
    torch.save(Payload(marker), states)
    with pytest.raises(ValueError, match="x0: .* is not a readable torch-saved tensor"):
        load_states(states)
    assert not marker.exists()


def _sparse_states() -> torch.Tensor:
    return torch.eye(8, dtype=torch.float64).to_sparse()


HOSTILE_STATES = {  # what the file holds -> what the refusal says
    "a dict": (lambda: {"x0": torch.zeros(1, 2, 8)}, "holds a dict, not a tensor"),
    "integers": (lambda: torch.zeros(1, 2, 8, dtype=torch.int64), "torch.int64 values, not floating point"),
    "complex numbers": (lambda: torch.zeros(1, 2, 8, dtype=torch.complex64), "not floating point"),
    "a sparse tensor": (_sparse_states, "sparse_coo tensor, not a dense one"),
    "another token size": (lambda: torch.zeros(1, 2, 5), r"shape \(1, 2, 5\), not \(batch, N, D\) or \(N, D\) with D=8"),
    "no tokens": (lambda: torch.zeros(3, 0, 8), r"shape \(3, 0, 8\)"),
    "one dimension": (lambda: torch.zeros(8), r"shape \(8,\)"),
    "NaN": (lambda: torch.tensor([[[float("nan")] * 8]]), "NaN or infinite"),
    "inf": (lambda: torch.full((2, 8), float("inf")), "NaN or infinite"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_STATES))
def test_a_states_file_is_checked_before_use(tmp_path, kind):
    from et_ode.training.statefile import FileFormatError

    make, problem = HOSTILE_STATES[kind]
    path = tmp_path / "x0.pt"
    torch.save(make(), path)
    with pytest.raises(FileFormatError, match=rf"^x0: {path} .*{problem}"):
        load_states(path, 8)


def test_states_files_within_limits_load_and_others_are_refused_unread(tmp_path, monkeypatch):
    import zipfile

    from safetensors.torch import save_file

    from et_ode.training import io
    from et_ode.training.statefile import FileFormatError

    states = torch.randn(2, 3, 8, dtype=torch.float64) * 1e30  # large, but finite: loaded as it is
    torch.save(states, tmp_path / "x0.pt")
    save_file({"x0": states.float()}, tmp_path / "x0.safetensors")
    assert torch.equal(load_states(tmp_path / "x0.pt", 8), states)
    assert torch.equal(load_states(tmp_path / "x0.safetensors", 8), states.float())
    assert load_states(tmp_path / "x0.pt").shape == (2, 3, 8)  # any token size when none is asked for
    save_file({"a": states, "b": states.clone()}, tmp_path / "two.safetensors")
    with pytest.raises(FileFormatError, match="holds 2 tensors, not one"):
        load_states(tmp_path / "two.safetensors", 8)
    header = json.dumps({"x0": {"dtype": "F64", "shape": [2**40, 8], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "huge.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(FileFormatError, match=r"huge.safetensors, key 'x0': its header declares 8796093022208 elements"):
        load_states(tmp_path / "huge.safetensors", 8)
    with pytest.raises(FileNotFoundError, match="x0: no file at"):
        load_states(tmp_path / "missing.pt", 8)
    with pytest.raises(FileFormatError, match="not a regular file"):
        load_states(tmp_path, 8)
    monkeypatch.setattr(io, "MAX_STATE_BYTES", 100)
    with pytest.raises(FileFormatError, match=r"x0.pt: the x0 file holds \d+ bytes, more than the 100"):
        load_states(tmp_path / "x0.pt", 8)
    monkeypatch.undo()
    monkeypatch.setattr(io, "MAX_EXPANSION_BYTES", 2**12)  # a member of zeros that expands far beyond its size
    with zipfile.ZipFile(tmp_path / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data/0", bytes(2**16))
    with pytest.raises(FileFormatError, match=r"bomb.pt, key 'archive/data/0': x0: \d+ compressed bytes expand to 65536"):
        load_states(tmp_path / "bomb.pt", 8)


def test_the_analyze_command_reads_its_states_through_the_checks(tmp_path, capsys):
    torch.save(torch.zeros(1, 2, 8, dtype=torch.int64), tmp_path / "ints.pt")
    argv = ["analyze", "--x0", str(tmp_path / "ints.pt"), "--out", str(tmp_path / "a"), "--no-progress"]
    assert main([*argv, "--dim", "8"]) == 2
    assert "not floating point" in capsys.readouterr().err
    torch.save(torch.zeros(1, 2, 8), tmp_path / "d8.pt")
    assert main(["analyze", "--x0", str(tmp_path / "d8.pt"), "--out", str(tmp_path / "b"), "--dim", "6"]) == 2
    assert "with D=6" in capsys.readouterr().err


@pytest.mark.slow  # one analysis report (half a minute on two busy cores)
def test_analyze_on_a_state_of_1e30_finishes_within_its_budgets(tmp_path):
    states = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e30
    torch.save(states, tmp_path / "big.pt")
    out = tmp_path / "report"
    size = ["--dim", "8", "--heads", "2", "--head-dim", "4", "--memories", "16", "--t1", "5", "--points", "11"]
    started = time.perf_counter()
    assert main(["analyze", "--x0", str(tmp_path / "big.pt"), *size, "--out", str(out), "--no-progress"]) == 0
    assert time.perf_counter() - started < 600
    assert json.loads((out / "report.json").read_text())["initial_states"] == [2, 4, 8]


def test_a_crafted_safetensors_header_cannot_reach_anything_but_data(tmp_path):
    from safetensors.torch import save

    path = tmp_path / CHECKPOINT_NAME
    deep = "[" * 100_000 + "]" * 100_000  # json.loads would raise RecursionError
    for state in ('{"model": {"__tensor__": "missing"}}', "[1, 2]", "not json", deep, '{"__items__": [1]}'):
        path.write_bytes(save({"t0": torch.ones(1)}, metadata={"format": "et-ode/training-checkpoint/2", "state": state}))
        with pytest.raises(ValueError, match="corrupt|does not hold a dict"):
            load_checkpoint(path)
    path.write_bytes(save({"t0": torch.ones(1)}, metadata={"format": "something/else"}))
    with pytest.raises(ValueError, match="expected format 'et-ode/training-checkpoint/2', found format"):
        load_checkpoint(path)


def test_checkpoint_state_round_trips_exactly(tmp_path):
    import random

    import numpy as np

    state = {
        "model": {"w": torch.randn(3, dtype=torch.float64)},
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "float": 0.1 + 0.2,
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"betas": (0.9, 0.999)}]},
        "nothing": None,
        "inf": float("inf"),
    }
    save_checkpoint(tmp_path / "c", state)
    back = load_checkpoint(tmp_path / "c")
    assert back["python"] == state["python"] and back["float"] == 0.1 + 0.2 and back["inf"] == float("inf")
    assert back["numpy"][0] == "MT19937" and np.array_equal(back["numpy"][1], state["numpy"][1])
    assert back["numpy"][1].dtype == state["numpy"][1].dtype and back["numpy"][2:] == state["numpy"][2:]
    assert torch.equal(back["torch"], state["torch"]) and torch.equal(back["model"]["w"], state["model"]["w"])
    assert list(back["optimizer"]["state"]) == [0] and back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_model_file_and_checkpoint_mixed_up_say_what_they_are(tmp_path):
    save_model(random_model(), tmp_path / "et_block.pt")
    with pytest.raises(ValueError, match=r"is an et-ode model file .* et_ode\.training\.io\.load_model"):
        load_checkpoint(tmp_path / "et_block.pt")
    save_checkpoint(tmp_path / CHECKPOINT_NAME, {"model": {}})
    with pytest.raises(ValueError, match=r"training checkpoint .*load_trained"):
        load_model(tmp_path / CHECKPOINT_NAME)
    model = random_model()
    torch.save({"format": FORMAT, "config": model_config(model)}, tmp_path / "half.pt")
    with pytest.raises(ValueError, match=r"incomplete et-ode model file: \['state_dict'\]"):
        load_model(tmp_path / "half.pt")
    state = dict(model.state_dict())
    state.pop("hopfield.xi")
    torch.save({"format": FORMAT, "config": model_config(model), "state_dict": state}, tmp_path / "keys.pt")
    with pytest.raises(ValueError, match="do not make an EnergyTransformer.*hopfield.xi"):
        load_model(tmp_path / "keys.pt")
    image = ImageET((1, 8, 8), 2, 8, 2, 4)
    with pytest.raises(TypeError, match=r"got ImageET; save its ET block: save_model\(model.block"):
        save_model(image, tmp_path / "image.pt")


# ============================================================================================ runs never clobber
def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "image", *TINY, "--out", str(out)]) == 0
    return out


def test_a_finished_run_is_not_overwritten_or_mixed(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(run)
    assert main(["train", "image", *TINY, "--out", str(run)]) == 2
    assert "is not empty" in capsys.readouterr().err and snapshot(run) == before
    for change, setting in (
        (["--hopfield", "softmax"], "hopfield"),
        (["--mask-ratio", "0.3"], "ratio"),
        (["--solver", "rk4"], "integration.solver.method"),
        (["--lr", "0.01"], "train.lr"),
    ):
        assert main(["train", "image", *TINY, *change, "--out", str(run), "--resume"]) == 2
        err = capsys.readouterr().err
        assert "the set-up differs" in err and f"\n  {setting} " in err, err
        assert snapshot(run) == before  # nothing touched, config.json included
    argv = [*TINY, "--dim", "16", "--out", str(run), "--resume"]  # the last --dim counts
    assert main(["train", "image", *argv]) == 2  # a raw "size mismatch" before
    assert "  dim " in capsys.readouterr().err and snapshot(run) == before
    assert main(["train", "image", *TINY, "--out", str(run), "--overwrite"]) == 0
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2]  # replaced, not appended (1, 2, 1, 2)
    assert not (run / LOCK_NAME).exists()


def test_out_naming_a_file_and_overwrite_of_a_foreign_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert main(["train", "image", *TINY, "--out", str(tmp_path / "file")]) == 2
    assert "is an existing file, not a folder" in capsys.readouterr().err
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    assert main(["train", "image", *TINY, "--out", str(foreign), "--overwrite"]) == 2
    assert "not an et-ode run folder" in capsys.readouterr().err and (foreign / "thesis.tex").read_text() == "precious"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "image", "--out", "x", "--resume", "--overwrite"])


def test_fit_refuses_an_out_dir_with_another_run(tmp_path):
    config = dict(epochs=1, batch_size=10, out_dir=str(tmp_path), progress=False)
    fit(linear(), NoisyRegression(), regression_data(), None, TrainConfig(**config))
    before = snapshot(tmp_path)
    with pytest.raises(RunFolderError, match="already holds a run"):
        fit(linear(), NoisyRegression(), regression_data(), None, TrainConfig(**config))
    assert snapshot(tmp_path) == before
    fit(linear(), NoisyRegression(), regression_data(), None, TrainConfig(**config, overwrite=True))
    assert [json.loads(line)["epoch"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


HOLD = (
    "import sys, time\nfrom et_ode.training import runs\nwith runs.lock(sys.argv[1]):\n    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)


def test_a_second_concurrent_run_is_refused_naming_the_first(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", "image", *TINY, "--out", str(tmp_path)]) == 2
        assert f"in use by another run: process {holder.pid} on host" in capsys.readouterr().err
        with pytest.raises(RunFolderError, match=f"process {holder.pid}"):
            fit(
                linear(),
                NoisyRegression(),
                regression_data(),
                None,
                TrainConfig(epochs=1, out_dir=str(tmp_path), progress=False),
            )
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier", "command": "et-ode train"})
    )
    with pytest.warns(UserWarning, match=f"taking over the lock of process {dead.pid}"):
        fit(
            linear(),
            NoisyRegression(),
            regression_data(),
            None,
            TrainConfig(epochs=1, out_dir=str(tmp_path), progress=False),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME, "metrics.jsonl"]


def test_graph_demo_and_analyze_folders_are_claimed_too(tmp_path, capsys):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "config.json").write_text(json.dumps({"some": "run"}))
    before = snapshot(occupied)
    with pytest.raises(RunFolderError, match="is not empty"):
        demo(occupied, quick=True)
    assert main(["analyze", "--out", str(occupied), "--no-progress"]) == 2
    assert "is not empty" in capsys.readouterr().err
    pytest.importorskip("torch_geometric")
    from et_ode.cli.graph import add_graph_train_arguments, run_graph_train

    parser = argparse.ArgumentParser()
    add_graph_train_arguments(parser)
    with pytest.raises(RunFolderError, match="is not empty"):
        run_graph_train(parser.parse_args(["classify", "--root", str(tmp_path), "--out", str(occupied)]))
    with pytest.raises(RunFolderError, match=r"set-up differs(.|\n)*\n  some +'run' +\(absent\)"):
        run_graph_train(parser.parse_args(["classify", "--root", str(tmp_path), "--out", str(occupied), "--resume"]))
    assert snapshot(occupied) == before


def test_claim_writes_config_only_once_accepted(tmp_path):
    with claim(tmp_path / "a", {"x": 1}) as out:
        assert json.loads((out / "config.json").read_text()) == {"x": 1} and (out / LOCK_NAME).is_file()
    assert not (tmp_path / "a" / LOCK_NAME).exists()
    with pytest.raises(RunFolderError, match=r"\n  x +1 +2"):
        with claim(tmp_path / "a", {"x": 2}, resume=True):
            pass
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == {"x": 1}
    with claim(tmp_path / "a", {"x": 1, "threads": 4}, resume=True, may_change=("threads",)):
        pass


# ============================================================================================ named errors
@pytest.fixture
def field64() -> ETField:
    return ETField(random_model())


def test_dtype_mismatch_names_x0(field64):
    x0 = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match=r"x0 has dtype torch.float32 but the model's parameters are torch.float64"):
        solve(field64, x0, (0.0, 1.0))
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        field64.model.energy(x0)
    with pytest.raises(TypeError, match="x0 has dtype torch.float64"):
        solve(ETField(EnergyTransformer(8, 2, 4, 12)), x0.double(), (0.0, 1.0))
    with pytest.raises(ValueError, match="x0 is on meta but the model is on cpu"):  # (cuda: the same check)
        solve(field64, x0.double().to("meta"), (0.0, 1.0))


@pytest.mark.parametrize("stop", [None, SteadyState(1e-3)])
def test_empty_batch_and_no_tokens(field64, stop):
    with pytest.raises(ValueError, match=r"x0 has an empty batch: shape \(0, 5, 8\)"):
        solve(field64, torch.zeros(0, 5, 8, dtype=torch.float64), (0.0, 1.0), stop=stop)
    with pytest.raises(ValueError, match=r"x0 has no tokens: N=0"):
        solve(field64, torch.zeros(2, 0, 8, dtype=torch.float64), (0.0, 1.0), stop=stop)
    with pytest.raises(ValueError, match="x has no tokens"):
        field64.model.energy(torch.zeros(2, 0, 8, dtype=torch.float64))
    field32 = ETField(EnergyTransformer(8, 2, 4, 12))  # the fused path had a ZeroDivisionError at N = 0
    assert field32(None, torch.zeros(2, 0, 8)).shape == (2, 0, 8)


def test_overflowing_states_name_where_and_suggest_float64():
    field = ETField(EnergyTransformer(8, 2, 4, 12))
    x0 = torch.randn(2, 5, 8)
    x0[1, 3] *= 1e30
    with pytest.raises(ValueError, match=r"x0 is too large for torch.float32: .* token \(1, 3\) .* use float64"):
        solve(field, x0, (0.0, 1.0))
    torch.manual_seed(0)
    model = EnergyTransformer(8, 2, 4, 12)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1e20)  # the Hopfield energy overflows float32 within a step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SolveError, match="non-finite.*use float64.*smaller step") as caught:
            solve(ETField(model), torch.randn(2, 5, 8), solver=EulerET(0.1, 5))
    assert caught.value.solution is not None and caught.value.solution.status is Status.FAILED


def test_a_runaway_fixed_step_solve_warns():
    torch.manual_seed(0)
    model = EnergyTransformer(8, 2, 4, 12)
    x0 = torch.randn(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        solve(ETField(model), x0, solver=EulerET(0.1, 12))  # healthy: no warning
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1e6)
    with pytest.warns(RuntimeWarning, match="fixed step grew the state .*-fold"):
        solution = solve(ETField(model), x0, solver=EulerET(0.1, 12))
    assert solution.status is Status.REACHED_END


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_an_adaptive_method_is_refused_up_front(dtype):
    model = EnergyTransformer(8, 2, 4, 12).to(dtype)
    x0 = torch.randn(2, 5, 8, dtype=dtype)
    with pytest.raises(ValueError, match=f"x0 is {dtype}, too coarse for the adaptive method 'dopri5'"):
        solve(ETField(model), x0, (0.0, 1.0))
    assert torch.isfinite(solve(ETField(model), x0, solver=EulerET(0.1, 3)).x).all()


def test_step_budgets_are_checked_before_any_work(field64):
    x0 = torch.randn(2, 5, 8, dtype=torch.float64)
    started = time.perf_counter()
    with pytest.raises(SolveError, match="steps=1000000000 is more than max_steps=100") as caught:
        solve(field64, x0, solver=EulerET(0.1, 10**9), max_steps=100)
    assert time.perf_counter() - started < 5.0  # it built a grid of 10^9 times before
    assert caught.value.solution.status is Status.FAILED and field64.nfe == 0
    with pytest.raises(SolveError, match="1000 fixed steps planned") as caught:
        solve(field64, x0, (0.0, 10.0), solver=Fixed("euler", step_size=0.01), max_steps=100)
    assert caught.value.solution is not None and caught.value.solution.status == "failed"  # the README's use


def test_the_adjoint_backward_solve_has_its_own_step_budget(field64):
    x0 = torch.randn(2, 5, 8, dtype=torch.float64)
    solution = solve(
        field64,
        x0,
        (0.0, 1.0),
        solver=Adaptive(rtol=1e-2, atol=1e-2),
        gradient=Adjoint(rtol=1e-12, atol=1e-12),
        max_steps=15,
    )
    assert solution.stats.accepted_steps + solution.stats.rejected_steps <= 15
    with pytest.raises(SolveError, match="adjoint's backward solve failed .* more than max_steps=15"):
        solution.x.square().sum().backward()


def test_tau_must_be_finite(field64):
    for tau in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="tau must be a positive finite number"):
            ETField(field64.model, tau=tau)
        with pytest.raises(ValueError, match="tau must be a positive finite number"):
            ImageET((1, 8, 8), 2, 8, 2, 4, tau=tau)
    with pytest.raises(ValueError, match="tau must be a positive finite number"):
        ImageRunConfig(tau=float("inf"))


@pytest.mark.parametrize("threads", ["0", str((os.cpu_count() or 1) + 1), "two"])
def test_threads_out_of_range_are_refused_by_the_parser(threads, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "image", "--out", "x", "--threads", threads])
    assert "--threads" in capsys.readouterr().err
    with pytest.raises(ValueError, match="threads must be a positive integer or None"):
        ImageRunConfig(threads=0 if threads.isdigit() else "two")


def test_png_files_are_read_whatever_the_case_of_their_suffix(tmp_path):
    from matplotlib.image import imsave

    from et_ode.data.images import load_png_folder

    for name in ("a.png", "B.PNG", "c.Png"):
        imsave(tmp_path / name, torch.rand(8, 8).numpy(), cmap="gray")
    assert load_png_folder(tmp_path, channels=1).images.shape == (3, 1, 8, 8)


def test_readme_commands_use_existing_options():
    parser = build_parser()
    for line in README.read_text().splitlines():
        if line.startswith("et-ode analyze"):
            parser.parse_args(line.split("#")[0].split()[1:])  # SystemExit on an unknown option (--states)


@pytest.fixture
def mutag(fixtures, tmp_path) -> Path:
    pytest.importorskip("torch_geometric")
    shutil.copytree(fixtures / "MUTAG" / "raw", tmp_path / "MUTAG" / "raw")
    return tmp_path / "MUTAG" / "raw"


def test_tu_empty_edges_blank_lines_and_huge_labels(mutag, fixtures):
    from et_ode.data.graphs import read_tu

    edges = mutag / "MUTAG_A.txt"
    lines = edges.read_text().splitlines()
    edges.write_text("\n".join(lines[:3] + ["", "   "] + lines[3:]) + "\n\n")  # blank lines: PyG's int() failed
    original, spaced = read_tu(fixtures, "MUTAG", pe_dim=None), read_tu(mutag.parents[1], "MUTAG", pe_dim=None)
    assert all(torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x) for a, b in zip(original, spaced))
    labels = mutag / "MUTAG_node_labels.txt"
    rows = labels.read_text().splitlines()
    rows[9] = "1000000"
    labels.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"MUTAG_node_labels.txt:10: node label 1000000 spans 1000001 category"):
        read_tu(mutag.parents[1], "MUTAG")
    edges.write_text("")
    with pytest.raises(ValueError, match=r"MUTAG_A.txt: no edges"):
        read_tu(mutag.parents[1], "MUTAG")


# ============================================================================================ data fingerprints
def _noise_png(path: Path, seed: int) -> None:
    from PIL import Image

    pixels = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path, compress_level=0)  # stored, not compressed: one size for every image


def test_replacing_any_one_file_of_a_training_set_is_caught_on_resume(tmp_path):
    """40 images, each replaced in turn by another of the same name and size: every replacement is refused on a
    resume (a fingerprint hashing a sample of 16 files would miss most of them)."""
    from et_ode.data.images import data_fingerprint

    data, out = tmp_path / "pngs", tmp_path / "run"
    data.mkdir()
    for k in range(40):
        _noise_png(data / f"p{k:02d}__a.png", seed=k)
    with claim(out, {"lr": 1}, data=data_fingerprint("png", data)) as folder:
        (folder / "checkpoint.safetensors").write_bytes(b"weights")
    for k, file in enumerate(sorted(data.iterdir())):
        original = file.read_bytes()
        _noise_png(file, seed=1000 + k)
        assert file.stat().st_size == len(original) and file.read_bytes() != original
        with pytest.raises(RunFolderError, match=r"the data differ(.|\n)*content_sha256"):
            with claim(out, {"lr": 1}, resume=True, data=data_fingerprint("png", data)):
                pass
        file.write_bytes(original)
    with claim(out, {"lr": 1}, resume=True, data=data_fingerprint("png", data)):
        pass  # the data restored: the run resumes


def test_a_fingerprint_beyond_its_budget_reads_the_start_and_end_of_every_file(tmp_path, monkeypatch):
    from et_ode.data import images

    monkeypatch.setattr(images, "FINGERPRINT_BYTES", 64)
    monkeypatch.setattr(images, "FINGERPRINT_FILE_BYTES", 16)  # 4 files of 100 bytes: 16 read of each
    files = [tmp_path / f"f{k}.bin" for k in range(4)]
    for file in files:
        file.write_bytes(bytes(range(100)))
    before = images.files_fingerprint(files, "test")
    for where, caught in ((0, True), (99, True), (7, True), (92, True), (50, False)):
        data = bytearray(files[2].read_bytes())
        data[where] ^= 0xFF
        files[2].write_bytes(bytes(data))
        after = images.files_fingerprint(files, "test")
        assert (after["content_sha256"] != before["content_sha256"]) is caught, where
        data[where] ^= 0xFF
        files[2].write_bytes(bytes(data))
    monkeypatch.undo()  # within the default budget every byte is read
    whole = images.files_fingerprint(files, "test")
    data = bytearray(files[2].read_bytes())
    data[50] ^= 0xFF
    files[2].write_bytes(bytes(data))
    assert images.files_fingerprint(files, "test")["content_sha256"] != whole["content_sha256"]


def test_a_file_whose_contents_exceed_memory_is_named(tmp_path, monkeypatch):
    """An allocation that fails while a loader reads (planted: the allocators' own errors) is an OutOfMemoryError
    naming the file, never the allocator's message."""
    import numpy as np

    from et_ode import OutOfMemoryError
    from et_ode.data import _files
    from et_ode.training import io, statefile

    cpu = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes.")

    def fails(*args, **kwargs):
        raise cpu

    save_checkpoint(tmp_path / "c.safetensors", {"model": {"w": torch.arange(3.0)}})
    monkeypatch.setattr(statefile, "load_tensors", fails)
    with pytest.raises(OutOfMemoryError, match=r"c.safetensors: out of memory \(an allocation of 2.15 GB failed\)"):
        load_checkpoint(tmp_path / "c.safetensors")
    np.savez(tmp_path / "a.npz", Xi=np.zeros((2, 3), dtype=np.float32))
    monkeypatch.setattr(_files, "_read_exactly", lambda stream, size: np.empty(10**13))  # NumPy's own MemoryError
    named = r"a.npz, key 'Xi': reading the archive: out of memory \(an allocation of 80 TB failed\)"
    with pytest.raises(OutOfMemoryError, match=named):
        _files.read_npz(tmp_path / "a.npz", ["Xi"], what="archive")
    torch.save(torch.zeros(1, 2, 8), tmp_path / "x0.pt")

    def cuda_fails(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.")

    monkeypatch.setattr(io.torch, "load", cuda_fails)
    with pytest.raises(OutOfMemoryError, match=r"x0: loading .*x0.pt: out of memory \(an allocation of 3.22 GB failed\)"):
        load_states(tmp_path / "x0.pt", 8)
    with pytest.raises(OutOfMemoryError, match=r"the model file .*m.pt: out of memory"):
        save_model(random_model(), tmp_path / "m.pt")
        load_model(tmp_path / "m.pt")


def test_a_zip_whose_end_record_is_corrupt_is_named_by_every_loader(tmp_path):
    """zipfile's own test raises on some corrupt end records (here a ZIP64 locator claiming two disks) instead of
    answering: every loader still names the file (FileFormatError), as the fuzz suite found."""
    import struct
    import zipfile

    from et_ode.training.statefile import FileFormatError, read_npz

    path = tmp_path / "span.pt"
    path.write_bytes(b"PK\x06\x07" + struct.pack("<LQL", 0, 0, 2) + b"PK\x05\x06" + bytes(18))
    with pytest.raises(zipfile.BadZipFile, match="span multiple disks"):
        zipfile.is_zipfile(path)
    for load in (load_model, load_checkpoint, lambda p: load_states(p, 8), lambda p: read_npz(p, ["Xi"], what="archive")):
        with pytest.raises(FileFormatError, match=str(path)):
            load(path)
