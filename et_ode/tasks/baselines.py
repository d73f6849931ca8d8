"""Baselines for masked image completion, scored by the same code as the ET (:func:`evaluate_completion`).

Each baseline is called like :class:`et_ode.models.ImageET`: ``baseline(images (B,C,H,W), hidden (B,N))``
returns a :class:`Completion` whose ``patches (B, N, C P P)`` are its guesses.

- :class:`MeanImage`: every patch is the training set's mean at that position.
- :class:`NearestNeighbour`: the training image closest to the test image on the visible patches
  (squared distance over visible pixels); its patches are the guesses.
- :class:`Biharmonic`: no training; each image's hidden patches are filled by scikit-image's biharmonic
  inpainting (``skimage.restoration.inpaint_biharmonic``) from its visible pixels (needs scikit-image).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from et_ode.models.image import Completion, _check_images, patchify, unpatchify


class MeanImage(nn.Module):
    """Per-position mean of the training images ``(n, C, H, W)``, cut into ``patch x patch`` patches."""

    mean: Tensor  # (N, P2) buffer: the mean patch of each position

    def __init__(self, train_images: Tensor, patch: int):
        super().__init__()
        train_images = _check_images(train_images)
        self.patch = patch
        self.image_shape = tuple(train_images.shape[1:])
        self.register_buffer("mean", patchify(train_images.mean(dim=0, keepdim=True).float(), patch)[0])

    def forward(self, images: Tensor, hidden: Tensor) -> Completion:
        _check_images(images, self.image_shape)
        return Completion(self.mean.to(images.dtype).expand(images.shape[0], -1, -1))


class NearestNeighbour(nn.Module):
    """Nearest training image on the visible patches.

    Args:
        train_images: ``(n, C, H, W)``.
        patch: patch side.
        chunk: training images compared per matrix product (bounds memory at ``B * chunk`` floats).
    """

    train_patches: Tensor  # (n, N, P2) buffer
    train_sq: Tensor  # (n, N, P2) buffer: train_patches squared

    def __init__(self, train_images: Tensor, patch: int, chunk: int = 8192):
        super().__init__()
        train_images = _check_images(train_images)
        self.patch = patch
        self.chunk = chunk
        self.image_shape = tuple(train_images.shape[1:])
        flat = patchify(train_images.float(), patch)
        self.register_buffer("train_patches", flat)
        self.register_buffer("train_sq", flat.square())

    def forward(self, images: Tensor, hidden: Tensor) -> Completion:
        _check_images(images, self.image_shape)
        target = patchify(images.float(), self.patch)  # (B, N, P2)
        visible = (~hidden).to(target.dtype)[..., None].expand_as(target).flatten(1)  # (B, N P2)
        a = target.flatten(1)
        best_dist = torch.full((a.shape[0],), float("inf"), device=a.device)
        best_index = torch.zeros(a.shape[0], dtype=torch.long, device=a.device)
        for start in range(0, self.train_patches.shape[0], self.chunk):
            b = self.train_patches[start : start + self.chunk].flatten(1)
            b_sq = self.train_sq[start : start + self.chunk].flatten(1)
            # |v * (a - b)|^2 = v.a^2 - 2 (v a).b + v.b^2  for the 0/1 visibility v
            dist = (visible * a.square()).sum(1, keepdim=True) - 2 * (visible * a) @ b.T + visible @ b_sq.T
            value, index = dist.min(dim=1)
            better = value < best_dist
            best_dist = torch.where(better, value, best_dist)
            best_index = torch.where(better, index + start, best_index)
        return Completion(self.train_patches[best_index].to(images.dtype), extra={"index": best_index})


class Biharmonic(nn.Module):
    """Biharmonic inpainting of the hidden patches of each image (``skimage.restoration.inpaint_biharmonic``).

    Every hidden pixel is filled by the smooth (biharmonic) continuation of the visible pixels around it, image by
    image (RGB images: one solve with ``channel_axis``, the channels sharing the mask). Visible patches are returned
    unchanged. Runs on the CPU in float64; the patches come back in the images' dtype and device.

    Args:
        image_shape: ``(C, H, W)``.
        patch: patch side.
    """

    def __init__(self, image_shape: tuple[int, int, int], patch: int):
        super().__init__()
        try:
            from skimage.restoration import inpaint_biharmonic
        except ImportError:
            raise ImportError(
                "the biharmonic baseline needs scikit-image: pip install scikit-image (or et-ode[images])"
            ) from None
        self._inpaint = inpaint_biharmonic
        self.image_shape = tuple(image_shape)
        self.patch = patch

    def forward(self, images: Tensor, hidden: Tensor) -> Completion:
        _check_images(images, self.image_shape)
        c, h, w = self.image_shape
        pixels = images.detach().to("cpu", torch.float64)
        # the pixel mask of the hidden patches: (B, N) -> (B, 1, H, W)
        mask = (
            unpatchify(
                hidden.to("cpu", torch.float64)[..., None].expand(-1, -1, self.patch * self.patch), self.patch, (1, h, w)
            )[:, 0]
            > 0.5
        )
        filled = pixels.clone()
        for i in range(images.shape[0]):
            if not bool(mask[i].any()):
                continue
            if c == 1:
                filled[i, 0] = torch.from_numpy(self._inpaint(pixels[i, 0].numpy(), mask[i].numpy()))
            else:
                result = self._inpaint(pixels[i].permute(1, 2, 0).numpy(), mask[i].numpy(), channel_axis=-1)
                filled[i] = torch.from_numpy(result).permute(2, 0, 1)
        return Completion(patchify(filled, self.patch).to(images.device, images.dtype))
