"""The official release's checkpoint format and image pipeline (bhoov/energy-transformer-jax).

The release ships its pretrained ImageNet Energy Transformer as a plain-dict ``.npz`` file of float32 arrays
(:data:`OFFICIAL_KEYS`). :func:`read_official` reads one without running code and :func:`official_sizes` checks every
shape; :func:`load_official` builds the :class:`~et_ode.models.image.ImageET` that computes the release's output
(patches, MASK and CLS tokens, positions, 12 Euler steps ``x <- x - 0.1 dE/dg``, a decoder that reads
``LayerNorm(LayerNorm(x))``), and :func:`save_official` writes the format back. Photos are normalised as the release
does (:func:`normalize_pixels`) and masked with its scheme (:func:`official_masks`). The arrays' layout and the
pipeline step by step are in the tasks guide (docs/guides/tasks.md, "The release's file and pipeline").
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from et_ode.backend.validation import check_positive
from et_ode.data._files import FileFormatError, read_npz
from et_ode.energy.neurons import inverse_softplus
from et_ode.integrators.solvers import EulerET
from et_ode.models.image import ImageET
from et_ode.solving.gradients import Direct
from et_ode.solving.integration import Integration

OFFICIAL_KEYS = (
    "Wk",
    "Wq",
    "Xi",
    "Wenc",
    "Benc",
    "Wdec",
    "Bdec",
    "LNORM_gamma",
    "LNORM_bias",
    "CLS_token",
    "MASK_token",
    "POS_embed",
)
OFFICIAL_EPS = 1e-5
OFFICIAL_STEPS = 12
OFFICIAL_ALPHA = 0.1
OFFICIAL_MASKED = 100
OFFICIAL_PATCHES = 196
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def official_integration() -> Integration:
    """The release's dynamics: 12 Euler steps ``x <- x - 0.1 dE/dg`` (tau = 1), gradients straight through."""
    return Integration(solver=EulerET(OFFICIAL_ALPHA, OFFICIAL_STEPS), gradient=Direct())


# ----------------------------------------------------------------------------------------------- reading
def read_official(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The arrays of an official-format checkpoint, by key (keys other than :data:`OFFICIAL_KEYS` are ignored).

    Reads with :func:`et_ode.training.statefile.read_npz`: each array's header (dtype, shape, size) is checked before its
    data is read; a file holding pickled objects is refused, never run; big-endian arrays come back native.

    Args:
        path: the ``.npz`` file.

    Returns:
        ``{key: array}``.

    Raises:
        FileNotFoundError: no file at ``path``.
        et_ode.training.statefile.FileFormatError (a ValueError): not an ``.npz`` archive, a key missing, an array that is
            empty, too large, not floating point or not finite; naming the file and the key.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"official checkpoint: no file at {path}")
    arrays = read_npz(path, OFFICIAL_KEYS, what="official checkpoint", allow_empty=False)
    for key, array in arrays.items():
        if not np.issubdtype(array.dtype, np.floating):
            raise FileFormatError(path, key, f"{key} must hold floating-point numbers, got {array.dtype}")
        if not np.isfinite(array).all():
            raise FileFormatError(path, key, f"{key} holds NaN or infinite values")
    return arrays


def _check_layout(image_shape: Sequence[int], patch: int) -> tuple[tuple[int, int, int], int]:
    shape = tuple(image_shape)
    if len(shape) != 3 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise ValueError(f"image_shape must be (C, H, W) of positive integers, got {shape}")
    c, h, w = shape
    if not (isinstance(patch, int) and patch >= 1) or h % patch or w % patch:
        raise ValueError(f"patch must be a positive integer dividing H={h} and W={w}, got {patch!r}")
    return (c, h, w), (h // patch) * (w // patch)


def official_sizes(arrays: dict[str, np.ndarray], image_shape: Sequence[int], patch: int) -> dict[str, int]:
    """Check every array's shape against each other and against ``image_shape`` ``(C, H, W)`` and ``patch``.

    Args:
        arrays: the checkpoint's arrays by key, every one of :data:`OFFICIAL_KEYS` (``Wk`` ``(H, Y, D)``, ``Xi``
            ``(D, M)``, ``Wenc`` ``(C P P, D)``, ``POS_embed`` ``(1 + N, D)``, ...).
        image_shape: ``(C, H, W)`` of the images.
        patch: the patch side ``P``, dividing ``H`` and ``W``.

    Returns:
        ``dim`` (D), ``heads`` (H), ``head_dim`` (Y), ``memories`` (M) and ``num_patches`` (N).

    Raises:
        ValueError: naming the key, the shape expected and the shape found (and the likely cause: ``Xi`` stored
            in our ``(K, D)`` layout, a checkpoint made for another image size or patch); a bad ``image_shape`` or
            ``patch``; an ``LNORM_gamma`` that is not positive.
    """
    (c, h, w), num_patches = _check_layout(image_shape, patch)
    wk = arrays["Wk"]
    if wk.ndim != 3:
        raise ValueError(f"official checkpoint: Wk must have shape (H, Y, D), found {wk.shape}")
    heads, head_dim, dim = wk.shape
    xi = arrays["Xi"]
    if xi.ndim != 2 or xi.shape[0] != dim:
        hint = (
            f"; it looks like our (K, D) layout: the official file stores Xi transposed, ({dim}, {xi.shape[0]})"
            if xi.ndim == 2 and xi.shape[1] == dim
            else ""
        )
        raise ValueError(
            f"official checkpoint: Xi must have shape (D, M) = ({dim}, M) with D from Wk, found {xi.shape}{hint}"
        )
    memories = xi.shape[1]
    patch_dim = c * patch * patch
    wenc = arrays["Wenc"]
    if wenc.ndim == 2 and wenc.shape[1] == dim and wenc.shape[0] != patch_dim:
        side = math.isqrt(wenc.shape[0] // c) if wenc.shape[0] % c == 0 else None
        fits = f"; a checkpoint for {c}-channel patches of side {side}?" if side and side * side * c == wenc.shape[0] else ""
        raise ValueError(
            f"official checkpoint: Wenc must have shape (C P P, D) = ({patch_dim}, {dim}) for "
            f"image_shape {(c, h, w)} and patch {patch}, found {wenc.shape}{fits}"
        )
    expected = {
        "Wq": (heads, head_dim, dim),
        "Wenc": (patch_dim, dim),
        "Benc": (dim,),
        "Wdec": (dim, patch_dim),
        "Bdec": (patch_dim,),
        "LNORM_gamma": (),
        "LNORM_bias": (dim,),
        "CLS_token": (dim,),
        "MASK_token": (dim,),
        "POS_embed": (1 + num_patches, dim),
    }
    for key, shape in expected.items():
        found = arrays[key].shape
        if found != shape:
            why = ""
            if key == "POS_embed" and len(found) == 2 and found[1] == dim:
                why = (
                    f" (1 + {num_patches} patches of image_shape {(c, h, w)} with patch {patch}; a checkpoint "
                    f"for {found[0] - 1} patches?)"
                    if found[0] != num_patches
                    else " (the CLS token's row is missing: 1 + patches rows)"
                )
            raise ValueError(f"official checkpoint: {key} must have shape {shape}, found {found}{why}")
    gamma = float(arrays["LNORM_gamma"])
    if not gamma > 0:
        raise ValueError(
            f"official checkpoint: LNORM_gamma must be positive (the energy is then a Lyapunov function), found {gamma}"
        )
    return dict(dim=dim, heads=heads, head_dim=head_dim, memories=memories, num_patches=num_patches)


# ----------------------------------------------------------------------------------------------- the mapping
def _exact_gamma_raw(gamma: float, dtype: torch.dtype) -> Tensor:
    """The raw parameter whose softplus, computed in ``dtype``, is ``gamma`` rounded to ``dtype`` (exactly when
    such a value exists, which a few ulp steps from the inverse find; else the closest)."""
    target = torch.tensor(gamma, dtype=dtype)
    raw = torch.tensor(inverse_softplus(gamma), dtype=dtype)
    best, best_error = raw, math.inf
    for _ in range(64):
        value = F.softplus(raw)
        error = abs(float(value) - float(target))
        if error < best_error:
            best, best_error = raw, error
        if error == 0:
            break
        raw = torch.nextafter(raw, torch.tensor(math.inf if value < target else -math.inf, dtype=dtype))
    return best


def load_official(
    path: str | os.PathLike[str],
    image_shape: Sequence[int] = (3, 224, 224),
    patch: int = 16,
    *,
    dtype: torch.dtype = torch.float32,
) -> ImageET:
    """An :class:`ImageET` holding the weights of an official-format checkpoint, its default integration the official one.

    The model: CLS token with its own position (``cls_position``), attention including the diagonal, ``beta =
    1/sqrt(Y)`` for every head, eps = 1e-5, ReLU memories ``Xi^T``, the decoder reading ``LayerNorm(g)``
    (``renormalize``), tau = 1, :func:`official_integration`. ``dtype``: float32 (the file's precision) or float64
    (the weights converted exactly; beta and eps are then float64 values). Loading leaves the global RNG's state unchanged.

    Args:
        path: the ``.npz`` file.
        image_shape: ``(C, H, W)`` of the model's images.
        patch: the patch side.
        dtype: float32 or float64.

    Returns:
        The :class:`ImageET`.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a bad ``image_shape``, ``patch`` or ``dtype``.
        et_ode.training.statefile.FileFormatError (a ValueError): see :func:`read_official`; a shape that does not fit
            the others or ``image_shape`` and ``patch`` (:func:`official_sizes`), naming the file and the key.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    _check_layout(image_shape, patch)
    arrays = read_official(path)
    try:
        sizes = official_sizes(arrays, image_shape, patch)
    except ValueError as error:  # a shape of the file's: named with the file and the key
        problem = str(error).removeprefix("official checkpoint: ")
        key = next((k for k in OFFICIAL_KEYS if problem.startswith(f"{k} ")), None)
        raise FileFormatError(path, key, problem) from None
    with torch.random.fork_rng(devices=[]):
        model = ImageET(
            tuple(image_shape),
            patch,
            sizes["dim"],
            sizes["heads"],
            sizes["head_dim"],
            sizes["memories"],
            cls_token=True,
            hopfield="relu",
            self_attention=True,
            tau=1.0,
            dynamics=official_integration(),
            cls_position=True,
            renormalize=True,
        )
    model = model.to(dtype)
    block = model.block

    def tensor(key: str) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(arrays[key])).to(dtype)

    with torch.no_grad():
        block.attention.WK.copy_(tensor("Wk"))
        block.attention.WQ.copy_(tensor("Wq"))
        block.attention.beta.fill_(1.0 / math.sqrt(sizes["head_dim"]))
        block.hopfield.xi.copy_(tensor("Xi").T)
        block.neuron.delta.copy_(tensor("LNORM_bias"))
        block.neuron.gamma_raw.copy_(_exact_gamma_raw(float(arrays["LNORM_gamma"]), dtype))
        block.neuron.eps = OFFICIAL_EPS
        model.encoder.weight.copy_(tensor("Wenc").T)
        model.encoder.bias.copy_(tensor("Benc"))
        model.decoder.weight.copy_(tensor("Wdec").T)
        model.decoder.bias.copy_(tensor("Bdec"))
        assert model.cls is not None  # built with cls_token=True above
        model.cls.copy_(tensor("CLS_token")[None])
        model.mask_token.copy_(tensor("MASK_token"))
        model.position.copy_(tensor("POS_embed"))
    return model.eval()


def official_arrays(model: ImageET) -> dict[str, np.ndarray]:
    """The arrays of ``model`` in the official layout, float32 (a float64 model is rounded).

    Args:
        model: the image model to export.

    Returns:
        The arrays by key of :data:`OFFICIAL_KEYS`, in the shapes :func:`official_sizes` checks.

    Raises:
        TypeError: ``model`` is not an :class:`ImageET`.
        ValueError: a model the official pipeline cannot express (no CLS token with its own position, no
            renormalizing decoder, attention without the diagonal, memories other than ReLU, beta other than
            ``1/sqrt(Y)``, eps other than 1e-5, tau other than 1).
    """
    if not isinstance(model, ImageET):
        raise TypeError(f"model must be an et_ode.models.ImageET, got {type(model).__name__}")
    block = model.block
    attention, hopfield, neuron = block.attention, block.hopfield, block.neuron
    beta = 1.0 / math.sqrt(attention.head_dim)
    problems = [
        name
        for name, ok in (
            ("cls_token=True", model.cls is not None),
            ("cls_position=True", model.cls_position),
            ("renormalize=True", model.renormalize),
            ("self_attention=True", attention.self_attention),
            ("fill=None", model.fill is None),
            ("hopfield='relu'", hopfield.form == "relu"),
            ("eps=1e-5", neuron.eps == OFFICIAL_EPS),
            ("tau=1", model.tau == 1.0),
            ("positive gamma", neuron.positive_gamma),
            (
                f"beta=1/sqrt(Y)={beta:.6g} for every head",
                bool(
                    torch.allclose(
                        attention.beta.double().cpu(), torch.tensor(beta, dtype=torch.float64), rtol=1e-6, atol=0.0
                    )
                ),
            ),
        )
        if not ok
    ]
    if problems:
        raise ValueError(f"the official format cannot hold this model: it needs {', '.join(problems)}")

    def array(tensor: Tensor) -> np.ndarray:
        return tensor.detach().cpu().to(torch.float32).numpy().copy()

    assert model.cls is not None  # "cls_token=True" is among the checks above

    return {
        "Wk": array(attention.WK),
        "Wq": array(attention.WQ),
        "Xi": array(hopfield.xi.T),
        "Wenc": array(model.encoder.weight.T),
        "Benc": array(model.encoder.bias),
        "Wdec": array(model.decoder.weight.T),
        "Bdec": array(model.decoder.bias),
        "LNORM_gamma": array(neuron.gamma),
        "LNORM_bias": array(neuron.delta),
        "CLS_token": array(model.cls[0]),
        "MASK_token": array(model.mask_token),
        "POS_embed": array(model.position),
    }


def save_official(model: ImageET, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``model`` as an official-format ``.npz`` at exactly ``path`` (no suffix added).

    ``load_official(save_official(model, p), model.image_shape, model.patch)`` gives back a float32 model with the
    same values bit for bit.

    Args:
        model: a model of the official layout.
        path: the file to write.
        overwrite: replace an existing file.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ValueError, TypeError: see :func:`official_arrays`.
    """
    arrays = official_arrays(model)
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb" if overwrite else "xb") as handle:
        # numpy's stub types savez's keyword allow_pickle: bool, which a dict of arrays cannot rule out
        np.savez(handle, **arrays)  # type: ignore[arg-type]
    return path


# ----------------------------------------------------------------------------------------------- photos and masks
def normalize_pixels(pixels: Tensor) -> Tensor:
    """The release's photo normalization: ``(pixels - 255 mean) / (255 std)`` per RGB channel, in float64.

    Args:
        pixels: ``(..., 3, H, W)`` with values 0..255 (uint8 or any real type).

    Returns:
        The normalized images, ``(..., 3, H, W)`` float64.
    """
    if not isinstance(pixels, Tensor) or pixels.dim() < 3 or pixels.shape[-3] != 3:
        raise ValueError(
            f"pixels must be a tensor (..., 3, H, W) of RGB values 0..255, got "
            f"{tuple(pixels.shape) if isinstance(pixels, Tensor) else type(pixels).__name__}"
        )
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64)[:, None, None] * 255
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64)[:, None, None] * 255
    return (pixels.to(torch.float64) - mean) / std


def denormalize(images: Tensor) -> Tensor:
    """Inverse of :func:`normalize_pixels`, scaled to ``[0, 1]`` and clipped there (for pictures).

    Args:
        images: normalized images ``(..., 3, H, W)``.

    Returns:
        The images in ``[0, 1]``, ``(..., 3, H, W)``.
    """
    mean = torch.tensor(IMAGENET_MEAN, dtype=images.dtype, device=images.device)[:, None, None]
    std = torch.tensor(IMAGENET_STD, dtype=images.dtype, device=images.device)[:, None, None]
    return (images * std + mean).clamp(0, 1)


def default_masked(num_patches: int) -> int:
    """The release's share of masked patches, 100 of 196, scaled to ``num_patches`` (at least 1).

    Args:
        num_patches: patches per image ``N``.

    Returns:
        The number of patches to mask, ``max(1, round(100 N / 196))``.
    """
    return max(1, round(OFFICIAL_MASKED * num_patches / OFFICIAL_PATCHES))


def official_masks(batch: int, num_patches: int, masked: int | None = None, *, seed: int = 0) -> Tensor:
    """Boolean masks ``(batch, num_patches)``, each hiding exactly ``masked`` patches drawn uniformly (the release's
    scheme; default :func:`default_masked`), reproducible from ``seed``.

    Args:
        batch: the number of images, a positive integer.
        num_patches: patches per image ``N``.
        masked: patches hidden per image, an integer in ``[1, N]`` (None: :func:`default_masked`).
        seed: the seed of the draw.

    Returns:
        The hidden patches, boolean ``(batch, N)`` with ``masked`` True per row.

    Raises:
        ValueError: ``masked`` is not an integer in ``[1, N]``, or ``batch`` not a positive integer.
    """
    masked = default_masked(num_patches) if masked is None else masked
    if not (isinstance(masked, int) and 1 <= masked <= num_patches):
        raise ValueError(f"masked must be an integer in [1, {num_patches}] (patches hidden per image), got {masked!r}")
    check_positive("batch", batch, integer=True)
    generator = torch.Generator().manual_seed(seed)
    order = torch.rand(batch, num_patches, generator=generator).argsort(dim=1)
    hidden = torch.zeros(batch, num_patches, dtype=torch.bool)
    return hidden.scatter_(1, order[:, :masked], True)
