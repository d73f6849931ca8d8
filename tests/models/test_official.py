"""The official release's checkpoint format: our model reproduces the release's own outputs, and files round-trip.

The reference is ``tests/fixtures/official-format/official_outputs.npz``, written by the release's code (jax, float64
and float32) for the small random checkpoint ``plaindict_ckpt.npz`` (image (3, 32, 32), 8x8 patches, D = 48, H = 3,
Y = 16, 192 memories, gamma = 1.3, a non-zero bias).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from et_ode import EulerET
from et_ode.models import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    OFFICIAL_KEYS,
    ImageET,
    default_masked,
    denormalize,
    load_official,
    normalize_pixels,
    official_integration,
    official_masks,
    read_official,
    save_official,
    unpatchify,
)

SHAPE, PATCH = (3, 32, 32), 8
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
NAMES = {torch.float64: "float64", torch.float32: "float32"}


@pytest.fixture
def official(fixtures):
    folder = fixtures / "official-format"
    with np.load(folder / "official_outputs.npz", allow_pickle=False) as outputs:
        return folder / "plaindict_ckpt.npz", dict(outputs)


def _relative(ours: torch.Tensor, reference: np.ndarray) -> float:
    reference = torch.from_numpy(np.asarray(reference, dtype=np.float64))
    return float((ours.detach().double() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reproduces_the_official_pipeline(official, dtype):
    path, outputs = official
    name, tol = NAMES[dtype], TOLERANCE[dtype]
    model = load_official(path, SHAPE, PATCH, dtype=dtype)
    images = torch.from_numpy(outputs["images"]).to(dtype)  # already normalized by the release's scheme
    hidden = torch.from_numpy(outputs["masks"]).bool()
    with torch.no_grad():
        completion = model(images, hidden)  # the default dynamics: the official 12 Euler steps of 0.1
        reconstruction = unpatchify(completion.patches, PATCH, SHAPE)
        x0 = model.tokens(images, hidden)
        trajectory = model.dynamics.solve(model.field(), x0)
    assert reconstruction.dtype == dtype
    assert _relative(reconstruction, outputs[f"out_{name}"]) < tol
    assert _relative(x0, outputs[f"tokens0_{name}"]) < tol
    assert _relative(completion.solution.x, outputs[f"tokens12_{name}"]) < tol
    assert len(trajectory.ts) == 13
    # E = E_ATT + E_HN (no LayerNorm term) at the state before each of the 12 steps, per image
    reference = torch.from_numpy(outputs[f"energies_{name}"])
    energies = trajectory.energies[:12].T.double()
    assert float(((energies - reference) / reference).abs().max()) < tol


def test_each_step_of_the_pipeline_matters(official):
    """Leaving out any one of the release's conventions misses its output by far more than the tolerance."""
    path, outputs = official
    images = torch.from_numpy(outputs["images"])
    hidden = torch.from_numpy(outputs["masks"]).bool()
    reference = outputs["out_float64"]
    variants = {
        "decoder reads g, not LayerNorm(g)": dict(renormalize=False),
        "no position on CLS": dict(cls_position=False),
    }
    for what, change in variants.items():
        model = load_official(path, SHAPE, PATCH, dtype=torch.float64)
        if "cls_position" in change:  # the same vectors, the CLS row left out
            model.cls_position = False
            model.position = torch.nn.Parameter(model.position[1:].detach().clone())
        else:
            model.renormalize = False
        with torch.no_grad():
            out = unpatchify(model(images, hidden).patches, PATCH, SHAPE)
        assert _relative(out, reference) > 1e-3, what
    model = load_official(path, SHAPE, PATCH, dtype=torch.float64)
    with torch.no_grad():
        model.block.attention.self_attention = False
        out = unpatchify(model(images, hidden).patches, PATCH, SHAPE)
    assert _relative(out, reference) > 1e-3, "attention without the diagonal"


def test_float64_model_holds_exact_constants(official):
    path, _ = official
    arrays = read_official(path)
    model = load_official(path, SHAPE, PATCH, dtype=torch.float64)
    block = model.block
    assert block.attention.beta.dtype == torch.float64
    assert torch.equal(block.attention.beta, torch.full((3,), 1 / math.sqrt(16), dtype=torch.float64))
    assert float(block.neuron.gamma.detach()) == float(arrays["LNORM_gamma"])  # 1.2999999523..., the float32 value exactly
    assert block.neuron.eps == 1e-5
    assert torch.equal(block.hopfield.xi, torch.from_numpy(arrays["Xi"]).double().T)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model.dynamics == official_integration() and model.dynamics.solver == EulerET(alpha=0.1, steps=12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_is_bit_exact(official, tmp_path, dtype):
    path, _ = official
    original = read_official(path)
    model = load_official(path, SHAPE, PATCH, dtype=dtype)
    written = save_official(model, tmp_path / "copy.npz")
    assert written == tmp_path / "copy.npz"
    again = read_official(written)
    for key in OFFICIAL_KEYS:
        assert again[key].dtype == np.float32, key
        assert np.array_equal(again[key], original[key]), key
    reloaded = load_official(written, SHAPE, PATCH, dtype=dtype)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_round_trip_of_a_fresh_model_at_another_size(tmp_path):
    """A rectangular image, 2 channels: the layout is general, and every tensor lands where it came from."""
    torch.manual_seed(0)
    model = ImageET(
        (2, 8, 12),
        4,
        16,
        2,
        8,
        24,
        cls_token=True,
        self_attention=True,
        cls_position=True,
        renormalize=True,
        dynamics=official_integration(),
    )
    path = save_official(model, tmp_path / "fresh.npz")
    loaded = load_official(path, (2, 8, 12), 4)
    images = torch.randn(3, 2, 8, 12)
    hidden = official_masks(3, 6, 2, seed=1)
    with torch.no_grad():
        assert torch.equal(loaded.tokens(images, hidden), model.tokens(images, hidden))
        assert torch.allclose(loaded(images, hidden).patches, model(images, hidden).patches, rtol=1e-5, atol=1e-6)
    with pytest.raises(FileExistsError, match="overwrite"):
        save_official(model, path)
    save_official(model, path, overwrite=True)


def test_loading_leaves_the_global_rng_alone(official):
    path, _ = official
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    load_official(path, SHAPE, PATCH)
    assert torch.equal(torch.rand(4), expected)


def _corrupt(official, tmp_path, **changes):
    path, _ = official
    arrays = read_official(path)
    for key, value in changes.items():
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    target = tmp_path / "corrupt.npz"
    np.savez(target, **arrays)
    return target, arrays


def test_a_missing_key_is_named(official, tmp_path):
    target, _ = _corrupt(official, tmp_path, MASK_token=None)
    with pytest.raises(ValueError, match="MASK_token missing"):
        load_official(target, SHAPE, PATCH)


def test_xi_in_our_layout_is_caught(official, tmp_path):
    arrays = read_official(official[0])
    target, _ = _corrupt(official, tmp_path, Xi=np.ascontiguousarray(arrays["Xi"].T))
    with pytest.raises(ValueError, match=r"Xi must have shape \(D, M\).*found \(192, 48\).*transposed"):
        load_official(target, SHAPE, PATCH)


def test_positions_without_the_cls_row_are_caught(official, tmp_path):
    arrays = read_official(official[0])
    target, _ = _corrupt(official, tmp_path, POS_embed=arrays["POS_embed"][1:])
    with pytest.raises(ValueError, match=r"POS_embed must have shape \(17, 48\), found \(16, 48\).*CLS"):
        load_official(target, SHAPE, PATCH)


def test_shapes_that_do_not_fit_the_image_or_patch(official):
    path, _ = official
    with pytest.raises(ValueError, match=r"POS_embed must have shape \(65, 48\), found \(17, 48\)"):
        load_official(path, (3, 64, 64), PATCH)
    with pytest.raises(ValueError, match=r"Wenc must have shape .*\(768, 48\).*found \(192, 48\).*side 8"):
        load_official(path, SHAPE, 16)
    with pytest.raises(ValueError, match="patch must be a positive integer dividing"):
        load_official(path, SHAPE, 5)
    with pytest.raises(ValueError, match="dtype"):
        load_official(path, SHAPE, PATCH, dtype=torch.float16)


def test_bad_files_are_refused_without_running_them(official, tmp_path):
    target, _ = _corrupt(official, tmp_path, LNORM_gamma=np.float32(-1.0))
    with pytest.raises(ValueError, match="LNORM_gamma must be positive"):
        load_official(target, SHAPE, PATCH)
    target, _ = _corrupt(official, tmp_path, Benc=np.full(48, np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="Benc holds NaN"):
        load_official(target, SHAPE, PATCH)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **{**read_official(official[0]), "Wk": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match="pickle"):
        load_official(pickled, SHAPE, PATCH)
    text = tmp_path / "text.npz"
    text.write_text("not an archive")
    with pytest.raises(ValueError, match="text.npz"):
        load_official(text, SHAPE, PATCH)
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        load_official(tmp_path / "nowhere.npz", SHAPE, PATCH)


def test_a_model_the_format_cannot_hold_is_refused(tmp_path):
    model = ImageET(SHAPE, PATCH, 16, 2, 8, cls_token=True)  # no diagonal, no CLS position, no renormalizing
    with pytest.raises(ValueError, match="cls_position=True.*renormalize=True.*self_attention=True"):
        save_official(model, tmp_path / "no.npz")
    assert not (tmp_path / "no.npz").exists()
    with pytest.raises(ValueError, match="cls_token=True"):
        ImageET(SHAPE, PATCH, 16, 2, 8, cls_position=True)


def test_new_options_survive_the_config():
    model = ImageET(SHAPE, PATCH, 16, 2, 8, cls_token=True, cls_position=True, renormalize=True)
    rebuilt = ImageET.from_config(model.config())
    assert rebuilt.cls_position and rebuilt.renormalize and rebuilt.position.shape == (17, 16)


def test_normalization_is_the_releases():
    pixels = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    normalized = normalize_pixels(pixels)
    expected = (pixels.numpy().astype(np.float64) / 255 - np.array(IMAGENET_MEAN)[:, None, None]) / np.array(IMAGENET_STD)[
        :, None, None
    ]
    assert normalized.dtype == torch.float64
    np.testing.assert_allclose(normalized.numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(denormalize(normalized).numpy(), pixels.numpy() / 255, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="pixels"):
        normalize_pixels(torch.zeros(1, 4, 2, 2))


def test_masks_hide_the_releases_number_of_patches():
    assert default_masked(196) == 100 and default_masked(16) == 8 and default_masked(1) == 1
    masks = official_masks(5, 196, seed=7)
    assert masks.dtype == torch.bool and masks.shape == (5, 196)
    assert masks.sum(dim=1).tolist() == [100] * 5
    assert torch.equal(masks, official_masks(5, 196, seed=7))
    assert not torch.equal(masks, official_masks(5, 196, seed=8))
    assert len({tuple(row.tolist()) for row in masks}) == 5
    with pytest.raises(ValueError, match="masked"):
        official_masks(1, 16, 17)
