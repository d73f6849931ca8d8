"""examples/inpaint_recipe.py (the README's completion recipe) runs end to end at a tiny size."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("skimage")
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "inpaint_recipe.py"


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
        alone = recipe.knn_fill(bank, images[b:b + 1], hidden[b:b + 1], exclude=nearest[:1], k=1, chunk=7)
        expected = torch.where(hidden[b][:, None], bank[nearest[1]], target[b])
        torch.testing.assert_close(recipe.patchify(alone, 4)[0], expected)


def test_train_resume_and_evaluate_at_a_tiny_size(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["train", "--data", "photos", "--out", str(out), "--limit", "40", "--dim", "8", "--heads", "2",
              "--head-dim", "4", "--batch", "8", "--planned-steps", "4", "--print-every", "1"]
    recipe.main([*common[:-4], "--planned-steps", "4", "--minutes", "0"])  # a zero budget: nothing trained yet
    recipe.main(common)
    text = capsys.readouterr().out
    assert "resumed at step 0" in text and "step 4 " in text
    assert json.loads(text.strip().splitlines()[-1])["steps"] == 4
    recipe.main(["evaluate", "--out", str(out), "--split", "val"])
    scores = json.loads((out / "evaluate_val.json").read_text())
    assert set(scores) == {"as trained", "dopri5, rtol 0.001", "dopri5, rtol 1e-06", "12 Euler steps", "fill alone",
                           "per photograph"}
    assert scores["dopri5, rtol 1e-06"]["nfe_per_batch"] > scores["dopri5, rtol 0.001"]["nfe_per_batch"]
    with pytest.raises(SystemExit, match="other settings"):
        recipe.main([*common, "--dim", "16"])


def test_rgb_and_32_pixel_tiles_euler_training_and_per_photograph_scores(recipe, tmp_path, capsys):
    """The photographs' other tile size and RGB, trained with Euler steps, and the per-photograph breakdown."""
    test = recipe.photo_split("test", 32, 3)
    assert test.images.shape[1:] == (3, 32, 32)
    out = tmp_path / "rgb32"
    recipe.main(["train", "--data", "photos", "--tile", "32", "--channels", "3", "--method", "et", "--steps", "3",
                 "--gradient", "direct", "--out", str(out), "--limit", "60", "--dim", "8", "--heads", "2",
                 "--head-dim", "4", "--batch", "4", "--planned-steps", "2", "--print-every", "1"])
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
    reference = sum(float(((torch.from_numpy(inpaint_biharmonic(x[b].permute(1, 2, 0).double().numpy(),
                                                                pixels[b, 0].numpy(), channel_axis=-1))
                            .permute(2, 0, 1) - x[b]).square()[pixels[b]]).sum()) for b in range(60))
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
