"""Baselines for masked image completion, scored by the same code as the ET (:func:`evaluate_completion`).

Each baseline is called like :class:`et_ode.models.ImageET`: ``baseline(images (B,C,H,W), hidden (B,N))``
returns a :class:`Completion` whose ``patches (B, N, C P P)`` are its guesses.

- :class:`MeanImage`: every patch is the training set's mean at that position.
- :class:`NearestNeighbour`: the training image closest to the test image on the visible patches
  (squared distance over visible pixels); its patches are the guesses.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..models.image import Completion, _check_images, patchify


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
            b = self.train_patches[start:start + self.chunk].flatten(1)
            b_sq = self.train_sq[start:start + self.chunk].flatten(1)
            # |v * (a - b)|^2 = v.a^2 - 2 (v a).b + v.b^2  for the 0/1 visibility v
            dist = (visible * a.square()).sum(1, keepdim=True) - 2 * (visible * a) @ b.T + visible @ b_sq.T
            value, index = dist.min(dim=1)
            better = value < best_dist
            best_dist = torch.where(better, value, best_dist)
            best_index = torch.where(better, index + start, best_index)
        return Completion(self.train_patches[best_index].to(images.dtype), extra={"index": best_index})
