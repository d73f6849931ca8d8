"""One writing rule for every command that writes a folder: a folder with files needs --overwrite (or --resume),
--overwrite replaces only a run of the same command, and a refused command leaves the folder as it was."""

from __future__ import annotations

import json

import pytest
import torch

from et_ode.cli import main
from et_ode.integrators.solvers import EulerET
from et_ode.models.image import ImageET
from et_ode.solving.integration import Integration
from et_ode.tasks.image import ImageRunConfig
from et_ode.training.runs import COMMAND_KEY, CONFIG_NAME
from et_ode.training.train import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small image-completion checkpoint of the digits (untrained weights: the rule, not the answer, is tested)."""
    torch.manual_seed(0)
    integration = Integration(solver=EulerET(0.1, 2), gradient="direct")
    run = ImageRunConfig(data="digits", patch=4, dim=8, heads=2, head_dim=4, integration=integration, test_limit=16)
    model = ImageET((1, 8, 8), 4, 8, 2, 4, dynamics=integration)
    path = tmp_path_factory.mktemp("run") / "checkpoint.safetensors"
    save_checkpoint(path, {"model": model.state_dict(), "meta": {"model": model.config(), "run": run.to_dict()}})
    return path


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _complete(checkpoint, out, *extra):
    return main(["complete", str(checkpoint), "--index", "0", "--frames", "3", "--threads", "1", "--out", str(out), *extra])


@pytest.mark.slow  # two completions end to end (pictures included)
def test_complete_refuses_a_folder_with_files_and_replaces_only_its_own_output(checkpoint, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "energy.csv").write_text("mine\n")
    (foreign / "film.pt").write_bytes(b"mine")
    before = _snapshot(foreign)
    assert _complete(checkpoint, foreign) == 2
    assert "not empty" in capsys.readouterr().err
    assert _complete(checkpoint, foreign, "--overwrite") == 2  # files but no et-ode run: never emptied
    assert "no config.json" in capsys.readouterr().err and _snapshot(foreign) == before

    out = tmp_path / "film"
    assert _complete(checkpoint, out) == 0
    assert json.loads((out / CONFIG_NAME).read_text())[COMMAND_KEY] == "complete"
    assert _complete(checkpoint, out) == 2
    assert "not empty" in capsys.readouterr().err
    assert _complete(checkpoint, out, "--overwrite") == 0


@pytest.mark.slow
def test_no_command_replaces_another_commands_run(checkpoint, tmp_path, capsys):
    training = checkpoint.parent  # the training run's folder: a checkpoint and a set-up without a command
    (training / CONFIG_NAME).write_text(json.dumps({"data": "digits"}))
    before = _snapshot(training)
    assert _complete(checkpoint, training, "--overwrite") == 2
    refusal = "holds a training run (its config.json names no command), not a run of `et-ode complete`"
    assert refusal in capsys.readouterr().err
    assert _snapshot(training) == before

    film = tmp_path / "film"
    assert _complete(checkpoint, film) == 0
    capsys.readouterr()
    film_before = _snapshot(film)
    assert main(["evaluate", str(checkpoint), "--grid", "0", "--no-progress", "--overwrite", "--out", str(film)]) == 2
    assert "holds a run of `et-ode complete`, not a run of `et-ode evaluate`" in capsys.readouterr().err
    assert _snapshot(film) == film_before


def test_a_dangling_symlink_out_is_a_named_error_for_complete(checkpoint, tmp_path, capsys):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    assert _complete(checkpoint, link) == 2
    assert "symbolic link" in capsys.readouterr().err and not (tmp_path / "gone").exists()


def test_a_refused_complete_leaves_no_folder(checkpoint, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["complete", str(checkpoint), "--index", "10000", "--threads", "1", "--out", str(out)]) == 2
    assert "index" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["complete", "CKPT", "--index", "0", "--frames", "10000000", "--out", "o"],
        ["complete", "CKPT", "--index", "0", "--frames", "1", "--out", "o"],
        ["train", "image", "--train-limit", "0", "--out", "o"],
        ["train", "image", "--train-limit", "-1", "--out", "o"],
        ["train", "image", "--test-limit", "0", "--out", "o"],
        ["train", "image", "--memories", "0", "--out", "o"],
        ["train", "image", "--val-size", "-1", "--out", "o"],
        ["evaluate", "CKPT", "--grid", "-1", "--out", "o"],
        ["evaluate", "CKPT", "--limit", "0", "--out", "o"],
    ],
)
def test_count_flags_have_ranges(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    flag = next(a for a in argv if a.startswith("--") and a not in ("--index", "--out"))
    assert caught.value.code == 2 and flag in capsys.readouterr().err
