"""Biharmonic fill: exact on cubic polynomials, equal to scikit-image's inpaint_biharmonic, argument errors."""

import json

import numpy as np
import pytest
import torch

from et_ode.models.fill import biharmonic_fill, biharmonic_matrix


def _cubic(h: int, w: int) -> torch.Tensor:
    y, x = torch.meshgrid(
        torch.linspace(0, 1, h, dtype=torch.float64), torch.linspace(0, 1, w, dtype=torch.float64), indexing="ij"
    )
    return 0.2 + 0.3 * x**3 - 0.2 * x * y**2 + 0.25 * y**2 + 0.1 * x * y


def test_interior_stencil_is_the_13_point_biharmonic():
    matrix = biharmonic_matrix(7, 9)
    row = matrix[3 * 9 + 4].reshape(7, 9)
    expected = torch.zeros(7, 9, dtype=torch.float64)
    expected[3, 4] = 20
    for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
        expected[3 + dy, 4 + dx] = -8
        expected[3 + 2 * dy, 4 + 2 * dx] = 1
    for dy, dx in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
        expected[3 + dy, 4 + dx] = 2
    assert torch.equal(row, expected)


def test_a_cubic_is_filled_exactly_away_from_the_border():
    # the discrete Laplacian of a cubic is linear, so its biharmonic vanishes: the unique fill is the cubic itself
    image = _cubic(12, 14)
    hidden = torch.zeros(2, 12, 14, dtype=torch.bool)
    hidden[0, 3:8, 4:9] = True
    hidden[1, 2:10, 2:5] = True
    hidden[1, 5:7, 8:12] = True
    images = image.expand(2, 1, 12, 14).clone()
    images[hidden[:, None]] = 7.0  # values under the mask are ignored
    filled = biharmonic_fill(images, hidden)
    assert filled.dtype == torch.float64
    torch.testing.assert_close(filled[:, 0], image.expand(2, 12, 14), atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape,channels", [((16, 16), 1), ((11, 7), 3)])
def test_equals_scikit_image(shape, channels):
    restoration = pytest.importorskip("skimage.restoration")
    generator = torch.Generator().manual_seed(3)
    images = torch.rand(3, channels, *shape, generator=generator, dtype=torch.float64)
    hidden = torch.rand(3, *shape, generator=generator) < torch.tensor([0.2, 0.5, 0.7])[:, None, None]
    hidden[0, :4, :4] = True  # a corner block: the truncated border stencils
    filled = biharmonic_fill(images, hidden)
    for i in range(3):
        expected = restoration.inpaint_biharmonic(images[i].permute(1, 2, 0).numpy(), hidden[i].numpy(), channel_axis=-1)
        np.testing.assert_allclose(filled[i].permute(1, 2, 0).numpy(), expected, atol=1e-10, rtol=0)


def test_float32_in_float32_out_and_visible_pixels_kept():
    images = torch.rand(4, 1, 8, 8)
    hidden = torch.rand(4, 8, 8) < 0.5
    filled = biharmonic_fill(images, hidden)
    assert filled.dtype == torch.float32
    assert torch.equal(filled[~hidden[:, None].expand_as(images)], images[~hidden[:, None].expand_as(images)])
    # clipped to the range of the visible pixels
    assert bool((filled.amax((1, 2, 3)) <= images.masked_fill(hidden[:, None], -1).amax((1, 2, 3))).all())


def test_errors():
    with pytest.raises(ValueError, match="images"):
        biharmonic_fill(torch.rand(8, 8), torch.zeros(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="hidden"):
        biharmonic_fill(torch.rand(1, 1, 8, 8), torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match="every pixel"):
        biharmonic_fill(torch.rand(1, 1, 4, 4), torch.ones(1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="height"):
        biharmonic_matrix(0, 3)


# ----------------------------------------------------------------------------------------------- ImageET(fill=...)
def _model(**kwargs):
    from et_ode import Adaptive, Direct, Integration
    from et_ode.models import ImageET

    torch.manual_seed(0)
    integration = Integration(Adaptive("bosh3", rtol=1e-3, atol=1e-5), Direct(), t1=0.5)
    return ImageET((1, 12, 12), 4, 16, 2, 8, 32, fill="biharmonic", dynamics=integration, **kwargs)


def _batch():
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(3, 1, 12, 12, generator=generator)
    hidden = torch.zeros(3, 9, dtype=torch.bool)
    hidden[0, [4]] = True
    hidden[1, [0, 4, 8]] = True
    hidden[2, [1, 2, 3, 5]] = True
    return images, hidden


def _pixel_mask(hidden):
    return hidden.reshape(-1, 3, 3).repeat_interleave(4, 1).repeat_interleave(4, 2)


def test_untrained_fill_model_returns_scikit_images_biharmonic_fill():
    from et_ode.models import patchify

    restoration = pytest.importorskip("skimage.restoration")
    model = _model()
    images, hidden = _batch()
    out = model(images, hidden)
    expected = torch.stack(
        [
            torch.from_numpy(
                restoration.inpaint_biharmonic(images[i, 0].double().numpy(), _pixel_mask(hidden)[i].numpy())
            ).float()[None]
            for i in range(3)
        ]
    )
    torch.testing.assert_close(out.patches, patchify(expected, 4), atol=1e-5, rtol=0)
    assert out.solution.stats.nfe_forward > 0


def test_fill_tokens_encode_the_fill_plus_mask_and_training_moves_the_answer():
    from et_ode.models import masked_mse, patchify

    model = _model()
    images, hidden = _batch()
    filled = biharmonic_fill(images, _pixel_mask(hidden))
    x0 = model.tokens(images, hidden)
    encoded = model.encoder(patchify(filled, 4))
    expected = torch.where(hidden[..., None], encoded + model.mask_token, encoded) + model.position
    torch.testing.assert_close(x0, expected)
    # the visible tokens do not see the hidden pixels' true values
    changed = images.clone()
    changed[_pixel_mask(hidden)[:, None]] = 0.0
    torch.testing.assert_close(model.tokens(changed, hidden), x0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        loss = masked_mse(model(images, hidden).patches, patchify(images, 4), hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model.block.attention.WQ.grad is not None and model.block.attention.WQ.grad.abs().sum() > 0
    after = masked_mse(model(images, hidden).patches, patchify(images, 4), hidden)
    assert after.item() < masked_mse(patchify(filled, 4), patchify(images, 4), hidden).item()


def test_fill_round_trips_through_config_and_checkpoint(tmp_path):
    from et_ode.models import ImageET
    from et_ode.training.train import load_checkpoint, save_checkpoint

    model = _model()
    with torch.no_grad():
        model.decoder.weight.normal_()
    save_checkpoint(tmp_path / "c.safetensors", {"model": model.state_dict(), "config": model.config()})
    state = load_checkpoint(tmp_path / "c.safetensors")
    again = ImageET.from_config(state["config"])
    again.load_state_dict(state["model"])
    assert again.fill == "biharmonic"
    images, hidden = _batch()
    torch.testing.assert_close(again(images, hidden).patches, model(images, hidden).patches)


def test_fill_errors(tmp_path):
    from et_ode.models import ImageET
    from et_ode.models.official import save_official

    with pytest.raises(ValueError, match="fill"):
        ImageET((1, 8, 8), 4, 8, 1, 8, fill="harmonic")
    with pytest.raises(ValueError, match="fill=None"):
        save_official(_model(), tmp_path / "m.npz")


def test_train_image_fill_flag_round_trips_through_the_run(tmp_path):
    from et_ode.cli import main
    from et_ode.tasks.image import load_trained

    tiny = [
        "--train-limit",
        "48",
        "--test-limit",
        "24",
        "--patch",
        "2",
        "--dim",
        "8",
        "--heads",
        "2",
        "--head-dim",
        "4",
        "--solver",
        "bosh3",
        "--t1",
        "0.3",
        "--rtol",
        "1e-2",
        "--gradient",
        "adjoint",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--no-progress",
        "--threads",
        "1",
        "--fill",
        "biharmonic",
    ]
    assert main(["train", "image", *tiny, "--out", str(tmp_path)]) == 0
    model, run = load_trained(tmp_path / "checkpoint.safetensors")
    assert model.fill == "biharmonic" and run.fill == "biharmonic"
    # the reloaded model scores what the run reported: its fill came back with it (without it the score differs)
    from et_ode.data import load_images
    from et_ode.models import evaluate_completion, fixed_mask_set

    test = fixed_mask_set(load_images("digits", None, "test").images[:24], model.num_patches, run.ratio, seed=run.mask_seed)
    batches = [test.tensors]
    reported = json.loads((tmp_path / "results.json").read_text())["model"]["mse"]
    with torch.no_grad():
        assert evaluate_completion(model, batches)["mse"] == pytest.approx(reported, rel=1e-5)
        model.fill = None
        assert evaluate_completion(model, batches)["mse"] != pytest.approx(reported, rel=1e-2)


def test_film_of_a_fill_model_starts_at_fill_plus_correction_and_ends_at_forward():
    from et_ode import Direct, EulerET, Integration
    from et_ode.models import patchify, unpatchify

    model = _model(tau=0.5)
    model.dynamics = Integration(EulerET(alpha=0.1, steps=4), Direct())
    with torch.no_grad():
        model.decoder.weight.normal_(std=0.3)
    images, hidden = _batch()
    frames, _ = model.film(images, hidden, keep_visible=False)
    with torch.no_grad():
        filled = biharmonic_fill(images, _pixel_mask(hidden))
        first = patchify(filled, 4) + model.decode(model.block.neuron(model.tokens(images, hidden)))
        last = model(images, hidden).patches
    torch.testing.assert_close(frames[0], unpatchify(first, 4, (1, 12, 12)).clamp(0, 1))
    torch.testing.assert_close(frames[-1], unpatchify(last, 4, (1, 12, 12)).clamp(0, 1))


def test_a_callable_fill_is_used_like_the_biharmonic_one_and_checked():
    from et_ode.models import ImageET, patchify

    calls = []

    def grey_fill(images, hidden):  # every hidden pixel at 0.25 + the image's visible mean / 2
        calls.append((tuple(images.shape), tuple(hidden.shape)))
        pixels = _pixel_mask(hidden)[:, None]
        visible_mean = (images * ~pixels).sum((1, 2, 3)) / (~pixels).sum((1, 2, 3))
        return torch.where(pixels, 0.25 + visible_mean[:, None, None, None] / 2, images)

    model = ImageET((1, 12, 12), 4, 8, 2, 4, fill=grey_fill)
    images, hidden = _batch()
    out = model(images, hidden)
    assert calls[-1] == ((3, 1, 12, 12), (3, 9))
    # untrained (zero decoder): the answer is the fill, and a hidden token starts from the encoded fill plus MASK
    torch.testing.assert_close(out.patches, patchify(grey_fill(images, hidden), 4))
    encoded = model.encoder(patchify(grey_fill(images, hidden), 4))
    torch.testing.assert_close(
        model.tokens(images, hidden), torch.where(hidden[..., None], encoded + model.mask_token, encoded) + model.position
    )
    with pytest.raises(TypeError, match="fill"):
        model.config()
    with pytest.raises(ValueError, match="shape"):
        ImageET((1, 12, 12), 4, 8, 2, 4, fill=lambda x, h: x[:, :, :8])(images, hidden)
    with pytest.raises(ValueError, match="visible"):
        ImageET((1, 12, 12), 4, 8, 2, 4, fill=lambda x, h: x * 0.5)(images, hidden)
