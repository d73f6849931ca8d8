"""examples/inpaint_recipe.py (the README's completion recipe) runs end to end at a tiny size."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("skimage")
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "inpaint_recipe.py"


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("inpaint_recipe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_photo_split_is_by_photograph(recipe):
    data = recipe.load("photos")
    assert [data[s].shape[1:] for s in ("train", "val", "test")] == [(1, 16, 16)] * 3
    # the fixed split of et_ode.data.photographs: 12 / 4 / 6 photographs
    assert [len(data[s]) for s in ("train", "val", "test")] == [19814, 2848, 5613]
    assert 0.0 <= float(data["test"].min()) and float(data["test"].max()) <= 1.0


def test_knn_fill_is_the_mean_of_the_nearest_on_visible_patches(recipe):
    generator = torch.Generator().manual_seed(0)
    bank_images = torch.rand(30, 1, 8, 8, generator=generator)
    images = torch.rand(2, 1, 8, 8, generator=generator)
    hidden = torch.tensor([[True, False, False, True], [False, True, False, False]])
    bank = recipe.patchify(bank_images, 4)
    filled = recipe.knn_fill(bank, images, hidden, k=3, chunk=7)
    target = recipe.patchify(images, 4)
    for b in range(2):
        dist = ((bank - target[b]).square().sum(-1) * (~hidden[b])).sum(-1)
        nearest = dist.argsort()[:3]
        expected = torch.where(hidden[b][:, None], bank[nearest].mean(0), target[b])
        torch.testing.assert_close(recipe.patchify(filled, 4)[b], expected)
        # leaving out the nearest one (the image itself, in training) gives the next nearest
        alone = recipe.knn_fill(bank, images[b : b + 1], hidden[b : b + 1], exclude=nearest[:1], k=1, chunk=7)
        expected = torch.where(hidden[b][:, None], bank[nearest[1]], target[b])
        torch.testing.assert_close(recipe.patchify(alone, 4)[0], expected)


def test_train_resume_and_evaluate_at_a_tiny_size(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    common = [
        "train",
        "--data",
        "photos",
        "--out",
        str(out),
        "--limit",
        "40",
        "--dim",
        "8",
        "--heads",
        "2",
        "--head-dim",
        "4",
        "--batch",
        "8",
        "--planned-steps",
        "4",
        "--print-every",
        "1",
    ]
    recipe.main([*common[:-4], "--planned-steps", "4", "--minutes", "0"])  # a zero budget: nothing trained yet
    recipe.main(common)
    text = capsys.readouterr().out
    assert "resumed at step 0" in text and "step 4 " in text
    assert json.loads(text.strip().splitlines()[-1])["steps"] == 4
    recipe.main(["evaluate", "--out", str(out), "--split", "val"])
    scores = json.loads((out / "evaluate_val.json").read_text())
    assert set(scores) == {
        "as trained",
        "dopri5, rtol 0.001",
        "dopri5, rtol 1e-06",
        "12 Euler steps",
        "fill alone",
        "per photograph",
    }
    assert scores["dopri5, rtol 1e-06"]["nfe_per_batch"] > scores["dopri5, rtol 0.001"]["nfe_per_batch"]
    with pytest.raises(SystemExit, match="other settings"):
        recipe.main([*common, "--dim", "16"])


def test_rgb_and_32_pixel_tiles_euler_training_and_per_photograph_scores(recipe, tmp_path, capsys):
    """The photographs' other tile size and RGB, trained with Euler steps, and the per-photograph breakdown."""
    test = recipe.photo_split("test", 32, 3)
    assert test.images.shape[1:] == (3, 32, 32)
    out = tmp_path / "rgb32"
    recipe.main(
        [
            "train",
            "--data",
            "photos",
            "--tile",
            "32",
            "--channels",
            "3",
            "--method",
            "et",
            "--steps",
            "3",
            "--gradient",
            "direct",
            "--out",
            str(out),
            "--limit",
            "60",
            "--dim",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "4",
            "--batch",
            "4",
            "--planned-steps",
            "2",
            "--print-every",
            "1",
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["nfe_per_step"] == [3, 0]  # 3 Euler steps, backpropagated (no adjoint evaluations)
    recipe.main(["evaluate", "--out", str(out), "--split", "test"])
    scores = json.loads((out / "evaluate_test.json").read_text())
    assert scores["as trained"]["nfe_per_batch"] == 3
    # the fill alone is biharmonic inpainting of the hidden pixels, scored on them
    x = test.images[:60]
    hidden = recipe.split_masks("test", 60, 64)
    pixels = recipe.pixel_mask(hidden, (3, 32, 32))[:, None].expand_as(x)
    from skimage.restoration import inpaint_biharmonic

    reference = sum(
        float(
            (
                (
                    torch.from_numpy(
                        inpaint_biharmonic(x[b].permute(1, 2, 0).double().numpy(), pixels[b, 0].numpy(), channel_axis=-1)
                    ).permute(2, 0, 1)
                    - x[b]
                ).square()[pixels[b]]
            ).sum()
        )
        for b in range(60)
    )
    assert scores["fill alone"]["mse"] == pytest.approx(reference / float(pixels.sum()), rel=1e-4)
    # the first 60 test tiles are all of the first test photograph
    assert list(scores["per photograph"]) == [test.sources[0]] == list(set(test.sources[:60]))
    for key, name in (("mse", "as trained"), ("fill mse", "fill alone")):
        assert scores["per photograph"][test.sources[0]][key] == pytest.approx(scores[name]["mse"], rel=1e-9)
    with pytest.raises(SystemExit):
        recipe.main(["baselines", "--data", "fashion", "--tile", "32"])


def test_per_source_scores_pool_the_pixels_of_each_source(recipe):
    squared = torch.tensor([1.0, 3.0, 2.0, 8.0], dtype=torch.float64)
    fill = torch.tensor([2.0, 2.0, 1.0, 4.0], dtype=torch.float64)
    count = torch.tensor([2.0, 2.0, 1.0, 4.0], dtype=torch.float64)
    per = recipe.per_source(squared, fill, count, ("b", "a", "b", "a"))
    assert list(per) == ["b", "a"]  # in order of appearance
    assert per["b"] == {"tiles": 2, "mse": 1.0, "fill mse": 1.0, "change %": 0.0}  # (1 + 2) / (2 + 1)
    assert per["a"] == {"tiles": 2, "mse": 11 / 6, "fill mse": 1.0, "change %": round(100 * (11 / 6 - 1), 2)}


def recipe_patchify(images):
    from et_ode.models import patchify

    return patchify(images, 4)


def _brute_force_neighbours(bank, images, hidden, k):
    """The k bank images nearest on the visible patches, by explicit squared distances (nearest first)."""
    target = recipe_patchify(images)
    dist = ((bank[None] - target[:, None]).square().sum(-1) * (~hidden)[:, None]).sum(-1)  # (B, n)
    return dist.argsort(1)[:, :k]


@pytest.mark.parametrize("context", ["residual", "retrieval"])
def test_knn_et_starts_as_its_fill_and_blends_the_neighbours(recipe, context):
    generator = torch.Generator().manual_seed(1)
    bank_images = torch.rand(40, 1, 8, 8, generator=generator)
    images = torch.rand(3, 1, 8, 8, generator=generator)
    hidden = torch.tensor([[True, False, False, True], [False, True, True, False], [True, True, True, False]])
    bank = recipe_patchify(bank_images)
    integration = recipe.Integration.from_options("bosh3", t1=0.5, rtol=1e-3, atol=1e-5)
    model = recipe.KnnFillET((1, 8, 8), 4, 8, 2, 4, dynamics=integration, bank=bank, k=3, context=context)
    nearest = _brute_force_neighbours(bank, images, hidden, 3)
    target = recipe_patchify(images)
    with torch.no_grad():
        start = model(images, hidden).patches  # zero decoder (and weigher): the plain mean of the 3 nearest
        expected = torch.where(hidden[..., None], bank[nearest].mean(1), target)
        torch.testing.assert_close(start, expected)
        torch.testing.assert_close(start, recipe_patchify(recipe.knn_fill(bank, images, hidden, k=3)))
        if context == "retrieval":  # a weigher that trusts the second-nearest neighbour only returns its patches
            model.weigher.bias.copy_(torch.tensor([0.0, 60.0, 0.0]))
            torch.testing.assert_close(
                model(images, hidden).patches, torch.where(hidden[..., None], bank[nearest[:, 1]], target)
            )
            # a visible token carries each neighbour's centred squared error on its patch; a hidden one none
            assert model.encoder.in_features == 3 * 16 + 3


def test_knn_retrieval_trains_and_evaluates_at_a_tiny_size(recipe, tmp_path, capsys):
    out = tmp_path / "knn"
    recipe.main(
        [
            "train",
            "--data",
            "photos",
            "--out",
            str(out),
            "--limit",
            "40",
            "--fill",
            "knn",
            "--k",
            "3",
            "--context",
            "retrieval",
            "--augment",
            "0",
            "--dim",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "4",
            "--batch",
            "8",
            "--planned-steps",
            "2",
            "--print-every",
            "1",
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
    recipe.main(["evaluate", "--out", str(out), "--split", "val"])
    scores = json.loads((out / "evaluate_val.json").read_text())
    solvers = ("as trained", "dopri5, rtol 0.001", "dopri5, rtol 1e-06", "12 Euler steps", "fill alone")
    assert all(0 < scores[name]["mse"] < 1 for name in solvers)


def test_local_knn_fill_weights_the_neighbours_by_their_errors_around_each_hidden_patch(recipe):
    generator = torch.Generator().manual_seed(2)
    bank_images = torch.rand(25, 1, 12, 12, generator=generator)
    images = torch.rand(2, 1, 12, 12, generator=generator)
    hidden = torch.zeros(2, 9, dtype=torch.bool)
    hidden[0, [0, 4, 5, 8]] = True
    hidden[1, [0, 1, 3, 4]] = True  # patch 0's window (patches 0, 1, 3, 4) is all hidden: uniform weights there
    bank = recipe_patchify(bank_images)
    filled = recipe_patchify(recipe.local_knn_fill(bank, images, hidden, k=4, temperature=0.05))
    nearest = _brute_force_neighbours(bank, images, hidden, 4)
    target = recipe_patchify(images)
    for b in range(2):
        for p in range(9):
            if not hidden[b, p]:
                torch.testing.assert_close(filled[b, p], target[b, p])
                continue
            row, col = divmod(p, 3)
            window = [q for q in range(9) if abs(q // 3 - row) <= 1 and abs(q % 3 - col) <= 1 and not hidden[b, q]]
            candidates = bank[nearest[b]]  # (4, N, P2)
            if window:  # the mean squared error per pixel over the visible pixels of the window
                error = (candidates[:, window] - target[b, window]).square().mean((1, 2))
            else:
                error = torch.zeros(4)
            weights = torch.softmax(-error / 0.05, 0)
            torch.testing.assert_close(filled[b, p], (weights[:, None] * candidates[:, p]).sum(0))
