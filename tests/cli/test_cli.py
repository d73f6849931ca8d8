"""The `et-ode` console script end to end on tiny settings: what each subcommand promises, it writes."""

import json

import pytest
import torch

from et_ode.cli import build_parser, main
from et_ode.cli.options import command_line_words, command_options
from et_ode.tasks.image import load_trained
from et_ode.training.io import load_model
from et_ode.training.train import load_checkpoint

TINY = [
    "--train-limit",
    "48",
    "--test-limit",
    "24",
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
    "3",
    "--gradient",
    "direct",
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--no-progress",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "image", *TINY, "--out", str(out)]) == 0
    return out


def test_train_writes_everything(trained):
    for name in ("checkpoint.safetensors", "metrics.jsonl", "results.json", "config.json", "et_block.pt", "tokens.pt"):
        assert (trained / name).is_file(), name
    results = json.loads((trained / "results.json").read_text())
    assert results["test_images"] == 24 and results["train_images"] == 48
    for key in ("model", "mean_baseline", "nearest_neighbour"):
        assert results[key]["mse"] > 0
    assert results["energy_descent"]["images"] == 24
    epochs = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2]
    # the saved block and token states are what the model uses
    model, _ = load_trained(trained / "checkpoint.safetensors")
    block, meta = load_model(trained / "et_block.pt")
    tokens = torch.load(trained / "tokens.pt")
    assert tokens.shape == (16, 16, 8) and meta["tau"] == model.tau
    assert torch.allclose(block.energy(tokens), model.block.energy(tokens))


def test_train_resume_is_a_no_op_when_finished(trained, capsys):
    before = load_checkpoint(trained / "checkpoint.safetensors")["model"]
    assert main(["train", "image", *TINY, "--out", str(trained), "--resume"]) == 0
    after = load_checkpoint(trained / "checkpoint.safetensors")["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_complete_by_index_and_by_png(trained, tmp_path):
    from matplotlib.image import imsave

    assert main(["complete", str(trained / "checkpoint.safetensors"), "--index", "2", "--out", str(tmp_path / "a")]) == 0
    film = torch.load(tmp_path / "a" / "film.pt")
    assert film["frames"].shape[1:] == (1, 8, 8) and film["frames"].shape[0] == len(film["times"])
    lines = (tmp_path / "a" / "energy.csv").read_text().splitlines()
    assert lines[0] == "time,energy" and len(lines) == len(film["times"]) + 1
    energies = [float(line.split(",")[1]) for line in lines[1:]]
    assert all(b <= a for a, b in zip(energies, energies[1:], strict=False))

    imsave(tmp_path / "digit.png", torch.rand(8, 8).numpy(), cmap="gray", vmin=0, vmax=1)
    assert (
        main(
            [
                "complete",
                str(trained / "checkpoint.safetensors"),
                "--image",
                str(tmp_path / "digit.png"),
                "--solver",
                "dopri5",
                "--t1",
                "0.5",
                "--frames",
                "4",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    film = torch.load(tmp_path / "b" / "film.pt")
    assert film["times"].tolist() == pytest.approx([0.0, 0.5 / 3, 1.0 / 3, 0.5])


def test_complete_errors(trained, tmp_path, capsys):
    from matplotlib.image import imsave

    imsave(tmp_path / "big.png", torch.rand(10, 8).numpy(), cmap="gray")
    assert (
        main(
            [
                "complete",
                str(trained / "checkpoint.safetensors"),
                "--image",
                str(tmp_path / "big.png"),
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert "has shape (1, 10, 8)" in capsys.readouterr().err
    raw = (trained / "checkpoint.safetensors").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 3])
    assert main(["complete", str(tmp_path / "cut.pt"), "--index", "0", "--out", str(tmp_path / "c")]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err
    assert main(["complete", str(trained / "checkpoint.safetensors"), "--index", "999", "--out", str(tmp_path / "c")]) == 2
    assert "index must be in [0, 359)" in capsys.readouterr().err


def test_train_rejects_bad_mask_ratio(tmp_path, capsys):
    assert main(["train", "image", *TINY, "--mask-ratio", "1.0", "--out", str(tmp_path)]) == 2
    assert "mask ratio must be in (0, 1)" in capsys.readouterr().err


def test_demo_quick(tmp_path):
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Test masked-patch MSE" in report and "per-position mean" in report
    for picture in ("completions.png", "mse.png"):
        assert (tmp_path / picture).stat().st_size > 1000
        assert f"]({picture})" in report


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["train", "--help"],
        ["train", "image", "--help"],
        ["train", "graph", "--help"],
        ["complete", "--help"],
        ["analyze", "--help"],
        ["demo", "--help"],
    ],
)
def test_help_is_complete(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: et-ode" in text
    if argv[:2] == ["train", "image"]:
        for option in (
            "--data",
            "--patch",
            "--mask-ratio",
            "--solver",
            "--rtol",
            "--steps",
            "--gradient",
            "--epochs",
            "--out",
            "--resume",
            "--steady-state",
        ):
            assert option in text


def test_a_command_whose_module_cannot_be_imported_fails_alone(monkeypatch, capsys):
    import dataclasses

    import et_ode.cli

    missing = dataclasses.replace(et_ode.cli._ANALYZE, module="et_ode.cli.no_such_module")
    monkeypatch.setattr(et_ode.cli, "_ANALYZE", missing)
    assert main(["analyze"]) == 2
    assert "et-ode analyze needs et_ode.cli.no_such_module, which could not be imported" in capsys.readouterr().err
    assert build_parser().parse_args(["train", "graph", "classify", "--folds", "3"]).folds == 3


def test_library_errors_are_worded_in_the_commands_flags():
    """The library names its Python arguments; the command line shows the flag of the argument a message starts
    with and of every ``name=True``, where the command has that flag, and leaves every other word alone."""
    parser = build_parser()
    train = command_options(parser, parser.parse_args(["train", "image", "--out", "o"]))
    evaluate = command_options(parser, parser.parse_args(["evaluate", "c.safetensors", "--out", "o"]))
    assert {"--lr", "--data-path", "--resume", "--overwrite"} <= train and "--masks" not in train
    assert command_line_words("TrainConfig.lr must be positive and finite, got 0", train) == (
        "--lr must be positive and finite, got 0"
    )
    assert command_line_words("data_path must be a folder", train) == "--data-path must be a folder"
    assert command_line_words("o holds a run: resume it (resume=True) or set overwrite=True", train) == (
        "o holds a run: resume it (--resume) or set --overwrite"
    )
    assert command_line_words("masks m.npz: 'scored' marks no patch", evaluate) == "--masks m.npz: 'scored' marks no patch"
    for message in ("masks m.npz: not an evaluation", "the data differ", "dataset must be", "unknown=True is kept"):
        assert command_line_words(message, train) == message  # no such flag of `train image`, or not a leading name
