"""Held-out evaluation end to end: a PNG folder split by photo, --test-path, --max-time, `et-ode evaluate`.

A tiny model is trained for a few steps in the test on synthetic "photographs"; the evaluation's table, grid and
arrays are then checked against independent computations (the model run directly, a brute-force nearest
neighbour, scikit-image called directly)."""

import json

import numpy as np
import pytest
import torch

from et_ode import Adaptive
from et_ode.cli import main
from et_ode.models import fixed_mask_set, patchify
from et_ode.tasks.image import load_trained

pytest.importorskip("skimage")

TINY = [
    "--tile",
    "8",
    "--channels",
    "1",
    "--patch",
    "4",
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
    "--batch-size",
    "8",
    "--no-progress",
    "--threads",
    "1",
]


def _photo(rng, h, w):
    """A smooth random "photograph" (sums of sinusoids), so that inpainting and learning have structure to use."""
    yy, xx = np.mgrid[0:h, 0:w] / 8.0
    image = sum(rng.random() * np.sin(rng.normal() * xx + rng.normal() * yy + rng.random() * 6) for _ in range(3))
    return (image - image.min()) / (image.max() - image.min() + 1e-9)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from matplotlib.image import imsave

    root = tmp_path_factory.mktemp("photos")
    (root / "train").mkdir()
    (root / "test").mkdir()
    rng = np.random.default_rng(0)
    for name in ("alps", "beach", "city", "dune"):  # training photos: whole photos, tiled by the loader
        imsave(root / "train" / f"{name}.png", _photo(rng, 24, 32), cmap="gray", vmin=0, vmax=1)
    for name in ("elm", "fjord"):  # held-out photos, cut into files named <source>__<k>.png
        pixels = _photo(rng, 16, 16)
        for k, (r, c) in enumerate([(0, 0), (0, 8), (8, 0), (8, 8)]):
            imsave(root / "test" / f"{name}__{k}.png", pixels[r : r + 8, c : c + 8], cmap="gray", vmin=0, vmax=1)
    return root


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert (
        main(
            [
                "train",
                "image",
                "--data",
                "png",
                "--data-path",
                str(folders / "train"),
                "--test-path",
                str(folders / "test"),
                "--validation-fraction",
                "0.25",
                *TINY,
                "--epochs",
                "2",
                "--out",
                str(out),
                "--overwrite",
            ]
        )
        == 0
    )
    return out


def test_train_on_a_folder_with_a_test_folder(trained):
    results = json.loads((trained / "results.json").read_text())
    # 4 photos of 3x4 tiles: one photo is the validation split; the 8 test tiles come from --test-path
    assert results["train_images"] == 3 * 12 and results["test_images"] == 8
    assert results["validated_on"] == "validation"
    for key in ("model", "mean_baseline", "nearest_neighbour", "biharmonic"):
        assert results[key]["mse"] > 0, key
    cost = results["train_cost"]
    assert cost["steps"] == 2 * 5 and cost["seconds_per_step"] > 0 and cost["nfe_forward_per_step"] == 3
    assert cost["nfe_backward_per_step"] == 0  # gradients through the Euler steps: no field evaluation backward


def test_evaluate_end_to_end(trained, folders, tmp_path, capsys):
    from skimage.restoration import inpaint_biharmonic

    out = tmp_path / "evaluation"
    assert (
        main(["evaluate", str(trained / "checkpoint.safetensors"), "--out", str(out), "--no-progress", "--grid", "4"]) == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["images"] == 8
    for name in ("config.json", "evaluation.json", "evaluation.md", "completions.npz", "completions.png"):
        assert (out / name).is_file(), name
    results = json.loads((out / "evaluation.json").read_text())
    assert list(results["predictors"]) == ["et", "mean", "nearest", "biharmonic"]
    table = (out / "evaluation.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]  # after the header and its rule
    assert [row.split(" | ")[0] for row in rows] == [
        "| ET (the checkpoint)",
        "| per-position mean of the training images",
        "| nearest training image on the visible patches",
        "| biharmonic inpainting (scikit-image)",
    ]
    assert [float(row.split(" | ")[1].strip("*")) for row in rows] == pytest.approx(
        [results["predictors"][n]["mse"] for n in ("et", "mean", "nearest", "biharmonic")], rel=1e-3
    )
    saved = np.load(out / "completions.npz")
    images, hidden, scored = (torch.from_numpy(saved[k]) for k in ("images", "hidden", "scored"))
    # the evaluated images are the tiles of --test-path; the masks are the run's seeded fixed masks
    assert images.shape == (8, 1, 8, 8)
    model, run = load_trained(trained / "checkpoint.safetensors")
    expected = fixed_mask_set(images, model.num_patches, run.ratio, seed=run.mask_seed).tensors
    assert torch.equal(hidden, expected[1]) and torch.equal(scored, expected[2])
    truth = patchify(images, 4)

    def mse(patches):  # over the scored pixels, by hand
        return float(((patches - truth) ** 2)[scored].mean())

    with torch.no_grad():
        direct = model(images, hidden).patches
    assert results["predictors"]["et"]["mse"] == pytest.approx(mse(direct), rel=1e-5)
    # the completion keeps the input where visible and holds the model's patches where hidden
    completion = patchify(torch.from_numpy(saved["completion_et"]), 4)
    assert torch.allclose(completion[hidden], direct[hidden]) and torch.equal(completion[~hidden], truth[~hidden])
    # nearest neighbour, brute force over the run's training tiles (the split by source, as trained)
    from et_ode.tasks.image import load_run_split

    train = patchify(load_run_split(run, "train").images, 4)
    picks = [
        min(range(train.shape[0]), key=lambda j: float(((train[j] - truth[i]) ** 2)[~hidden[i]].sum())) for i in range(8)
    ]
    assert results["predictors"]["nearest"]["mse"] == pytest.approx(mse(train[picks]), rel=1e-5)
    assert results["predictors"]["mean"]["mse"] == pytest.approx(mse(train.mean(0).expand_as(truth)), rel=1e-5)
    # biharmonic: scikit-image called directly on the first image
    mask = np.kron(hidden[0].reshape(2, 2).numpy(), np.ones((4, 4), dtype=bool))
    filled = inpaint_biharmonic(images[0, 0].double().numpy(), mask)
    assert np.allclose(saved["completion_biharmonic"][0, 0], filled, atol=1e-6)
    per_image = torch.from_numpy(saved["mse_biharmonic"])
    assert float(per_image.mean()) == pytest.approx(results["predictors"]["biharmonic"]["mse"], rel=1e-5)

    # the folder holds an evaluation: refused without --overwrite, replaced with it
    assert main(["evaluate", str(trained / "checkpoint.safetensors"), "--out", str(out), "--no-progress"]) == 2
    assert "is not empty" in capsys.readouterr().err and (out / "completions.png").is_file()
    # the same masks reused from the saved file, whatever the seed
    kept = tmp_path / "kept.npz"
    kept.write_bytes((out / "completions.npz").read_bytes())
    assert (
        main(
            [
                "evaluate",
                str(trained / "checkpoint.safetensors"),
                "--out",
                str(out),
                "--overwrite",
                "--masks",
                str(kept),
                "--mask-seed",
                "99",
                "--predictors",
                "mean",
                "--grid",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    again = np.load(out / "completions.npz")
    assert np.array_equal(again["hidden"], hidden.numpy()) and "completion_et" not in again
    assert not (out / "completions.png").exists()


def test_flag_named_errors(folders, trained, tmp_path, capsys):
    one_photo = tmp_path / "one"
    one_photo.mkdir()
    (one_photo / "alps.png").write_bytes((folders / "train" / "alps.png").read_bytes())
    cases = [
        (["train", "image", "--data", "png", *TINY, "--out", str(tmp_path / "a")], "png needs a folder of .png images"),
        (["train", "image", "--data", "digits", "--tile", "4", "--out", str(tmp_path / "c")], "--tile applies"),
        (
            ["train", "image", "--data", "png", "--data-path", str(one_photo), *TINY, "--out", str(tmp_path / "d")],
            "1 source image(s) (alps) cannot give 1 test",
        ),
        (
            [
                "evaluate",
                str(trained / "checkpoint.safetensors"),
                "--masks",
                str(tmp_path / "none.npz"),
                "--out",
                str(tmp_path / "e"),
            ],
            "--masks",
        ),
        (
            ["evaluate", str(trained / "checkpoint.safetensors"), "--predictors", "et,oracle", "--out", str(tmp_path / "f")],
            "--predictors must name",
        ),
        (["train", "image", *TINY[:-2], "--max-time", "-1", "--out", str(tmp_path / "g")], "--max-time"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, (argv, message)
    # any data of the model's size can be scored: the 8x8 digits' test split
    assert (
        main(
            [
                "evaluate",
                str(trained / "checkpoint.safetensors"),
                "--data",
                "digits",
                "--limit",
                "5",
                "--predictors",
                "et,biharmonic",
                "--grid",
                "0",
                "--no-progress",
                "--out",
                str(tmp_path / "digits"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "digits" / "evaluation.json").read_text())["images"] == 5


def test_max_time_stops_the_run_with_a_checkpoint(folders, tmp_path):
    out = tmp_path / "budget"
    assert (
        main(
            [
                "train",
                "image",
                "--data",
                "png",
                "--data-path",
                str(folders / "train"),
                "--test-path",
                str(folders / "test"),
                *TINY,
                "--epochs",
                "100000",
                "--max-time",
                "0.03",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["stopped"] in ("max_time", "planned_steps")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["time"] <= 0.03 * 60 + 1.0 and records[-1]["stopped"] == results["stopped"]
    assert 10 <= results["train_cost"]["steps"] < 100000 * 6
    model, _ = load_trained(out / "checkpoint.safetensors")  # the checkpoint holds the stopped model
    assert model.image_shape == (1, 8, 8)


@pytest.mark.parametrize(
    "argv, options",
    [
        (
            ["evaluate", "--help"],
            ("--test-path", "--masks", "--mask-seed", "--overwrite", "--predictors", "--split", "--threads"),
        ),
        (
            ["train", "image", "--help"],
            ("--test-path", "--tile", "--stride", "--channels", "--validation-fraction", "--max-time"),
        ),
    ],
)
def test_help_names_the_options(argv, options, capsys):
    from et_ode.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    text = capsys.readouterr().out
    for option in options:
        assert option in text, option


def test_complete_by_index_reads_the_test_split(trained, tmp_path, capsys):
    """`et-ode complete --index I` completes image I of the run's test split (here the --test-path tiles)."""
    from et_ode.tasks.image import load_run_split

    _, run = load_trained(trained / "checkpoint.safetensors")
    test = load_run_split(run, "test")
    assert main(["complete", str(trained / "checkpoint.safetensors"), "--index", "5", "--out", str(tmp_path / "c")]) == 0
    film = torch.load(tmp_path / "c" / "film.pt")
    assert torch.equal(film["target"], test.images[5]) and test.sources[5] == "fjord"
    assert main(["complete", str(trained / "checkpoint.safetensors"), "--index", "8", "--out", str(tmp_path / "d")]) == 2
    assert "--index must be in [0, 8)" in capsys.readouterr().err


def test_evaluate_with_another_solver(trained, tmp_path):
    """--solver/--rtol integrate the trained model differently: the setup records it, the ET row reflects it."""
    out = tmp_path / "dopri5"
    assert (
        main(
            [
                "evaluate",
                str(trained / "checkpoint.safetensors"),
                "--solver",
                "dopri5",
                "--rtol",
                "1e-4",
                "--predictors",
                "et",
                "--grid",
                "0",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    setup = json.loads((out / "config.json").read_text())
    assert setup["dynamics"]["solver"]["method"] == "dopri5" and setup["dynamics"]["solver"]["rtol"] == 1e-4
    results = json.loads((out / "evaluation.json").read_text())
    model, run = load_trained(trained / "checkpoint.safetensors")
    images, hidden, scored = (torch.from_numpy(np.load(out / "completions.npz")[k]) for k in ("images", "hidden", "scored"))
    with torch.no_grad():
        patches = model(images, hidden, run.integration.replace(solver=Adaptive("dopri5", 1e-4, Adaptive().atol))).patches
    assert results["predictors"]["et"]["mse"] == pytest.approx(
        float(((patches - patchify(images, 4)) ** 2)[scored].mean()), rel=1e-5
    )
    assert results["predictors"]["et"]["nfe_per_batch"] > 3  # an adaptive solve, not the run's 3 Euler steps
