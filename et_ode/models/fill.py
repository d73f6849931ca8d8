"""Classical fills of hidden pixels: biharmonic inpainting, batched in torch.

:func:`biharmonic_fill` solves, for every image, the linear system of scikit-image's
``skimage.restoration.inpaint_biharmonic`` (one region, no splitting): at each hidden pixel ``p``,
``sum_q K[p, q] u[q] = 0``, where row ``p`` of ``K`` (:func:`biharmonic_matrix`) is the discrete biharmonic operator
(the 5-point Laplacian applied twice, a 13-point stencil) computed on the window of radius 2 around ``p`` cut at the
image border, with reflected borders inside the window (scikit-image's rule); visible pixels keep their values. The
result is clipped to the range of the visible pixels of each image and channel, as scikit-image does. The systems of
a batch are solved together by one dense solve over the hidden pixels (float64), without scikit-image, so every
training batch can be filled: ``ImageET(..., fill="biharmonic")`` starts the hidden tokens from this smooth guess.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from et_ode.backend.validation import check_positive

__all__ = ["biharmonic_fill", "biharmonic_matrix"]


def _laplace_reflect(array: np.ndarray) -> np.ndarray:
    """The 5-point Laplacian of a 2-D array with reflected borders (``d c b a | a b c d``)."""
    padded = np.pad(array, 1, mode="symmetric")
    return padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:] - 4 * array


@lru_cache(maxsize=16)
def _matrix(height: int, width: int) -> np.ndarray:
    matrix = np.zeros((height * width, height * width))
    for row in range(height):
        for col in range(width):
            r0, r1 = max(row - 2, 0), min(row + 3, height)
            c0, c1 = max(col - 2, 0), min(col + 3, width)
            delta = np.zeros((r1 - r0, c1 - c0))
            delta[row - r0, col - c0] = 1.0
            coefficients = np.zeros((height, width))
            coefficients[r0:r1, c0:c1] = _laplace_reflect(_laplace_reflect(delta))
            matrix[row * width + col] = coefficients.ravel()
    matrix.setflags(write=False)
    return matrix


def biharmonic_matrix(height: int, width: int) -> Tensor:
    """The biharmonic operator ``K (H W, H W)`` (float64, row-major pixels) whose rows are the equations of the
    hidden pixels; interior rows hold the stencil 20 / -8 (edge neighbours) / 2 (diagonals) / 1 (two away)."""
    check_positive("height", height, integer=True)
    check_positive("width", width, integer=True)
    return torch.from_numpy(_matrix(height, width).copy())


def biharmonic_fill(images: Tensor, hidden: Tensor) -> Tensor:
    """Biharmonic inpainting of the ``hidden`` pixels of ``images``; visible pixels are returned unchanged.

    Args:
        images: ``(B, C, H, W)`` floating point; the values under ``hidden`` are ignored.
        hidden: ``(B, H, W)`` boolean, the pixels to fill (the same for every channel). An image with every pixel
            hidden has nothing to fill from: a ``ValueError``.

    Returns:
        ``(B, C, H, W)`` in the dtype of ``images``: scikit-image's ``inpaint_biharmonic`` of each image (to
        rounding), clipped to the range of its visible pixels per channel.
    """
    if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
        raise ValueError(
            f"images must be a floating point tensor (B, C, H, W), got "
            f"{tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__}"
        )
    b, c, h, w = images.shape
    if not isinstance(hidden, Tensor) or hidden.dtype != torch.bool or tuple(hidden.shape) != (b, h, w):
        raise ValueError(
            f"hidden must be a boolean tensor of shape ({b}, {h}, {w}), got "
            f"{(hidden.dtype, tuple(hidden.shape)) if isinstance(hidden, Tensor) else hidden!r}"
        )
    flat_hidden = hidden.reshape(b, h * w)
    counts = flat_hidden.sum(1)
    if bool((counts == h * w).any()):
        raise ValueError("hidden covers every pixel of an image: nothing to fill from")
    matrix = biharmonic_matrix(h, w).to(images.device)
    pixels = images.detach().reshape(b, c, h * w).to(torch.float64)
    visible = (~flat_hidden)[:, None, :]
    known = pixels * visible
    out = pixels.clone()
    for count in counts.unique().tolist():
        if count == 0:
            continue
        rows = (counts == count).nonzero().flatten()
        index = flat_hidden[rows].nonzero()[:, 1].reshape(len(rows), count)  # (b', m) hidden pixels, ascending
        system = matrix[index[:, :, None], index[:, None, :]]  # (b', m, m): the hidden pixels' couplings
        # the visible pixels' part of each equation (``known`` is zero where hidden), at the hidden rows only
        rhs = -(known[rows] @ matrix.T).gather(2, index[:, None, :].expand(-1, c, -1)).transpose(1, 2)  # (b', m, C)
        solution = torch.linalg.solve(system, rhs).transpose(1, 2)  # (b', C, m)
        out[rows] = out[rows].scatter(2, index[:, None, :].expand(-1, c, -1), solution)
    big = torch.finfo(torch.float64).max
    low = torch.where(visible, pixels, big).amin(2, keepdim=True)
    high = torch.where(visible, pixels, -big).amax(2, keepdim=True)
    out = torch.minimum(torch.maximum(out, low), high)
    return torch.where(visible, pixels, out).reshape(b, c, h, w).to(images.dtype)
