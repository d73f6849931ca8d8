"""The classical baselines of masked completion, each checked against an independent computation."""

import numpy as np
import pytest
import torch

from et_ode.models import patchify, random_masks
from et_ode.tasks.baselines import Biharmonic, MeanImage, NearestNeighbour

skimage = pytest.importorskip("skimage")


def _pixel_mask(hidden_row, patch, h, w):
    """The (H, W) pixel mask of the hidden patches of one image, built by loops (independent of unpatchify)."""
    mask = np.zeros((h, w), dtype=bool)
    per_row = w // patch
    for k, is_hidden in enumerate(hidden_row.tolist()):
        if is_hidden:
            r, c = divmod(k, per_row)
            mask[r * patch : (r + 1) * patch, c * patch : (c + 1) * patch] = True
    return mask


@pytest.mark.parametrize("channels", [1, 3])
def test_biharmonic_matches_skimage_called_directly(channels):
    from skimage.restoration import inpaint_biharmonic

    generator = torch.Generator().manual_seed(0)
    h, w, patch = 12, 16, 4
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    smooth = torch.stack([torch.sin(3 * xx + k) * torch.cos(2 * yy - k) for k in range(channels)]) * 0.4 + 0.5
    images = torch.stack([smooth, smooth.flip(-1)]) + 0.02 * torch.rand(2, channels, h, w, generator=generator)
    hidden, _ = random_masks(2, (h // patch) * (w // patch), 0.4, generator=generator)
    out = Biharmonic((channels, h, w), patch)(images, hidden)
    assert out.patches.dtype == images.dtype and out.patches.shape == (2, 12, channels * patch * patch)
    for i in range(2):
        mask = _pixel_mask(hidden[i], patch, h, w)
        image = images[i].double().numpy()
        if channels == 1:
            expected = inpaint_biharmonic(image[0], mask)[None]
        else:
            expected = np.moveaxis(inpaint_biharmonic(np.moveaxis(image, 0, -1), mask, channel_axis=-1), -1, 0)
        got = patchify(torch.from_numpy(expected)[None].float(), patch)[0]
        assert torch.allclose(out.patches[i], got, atol=1e-6)
        # visible patches are the input; the hidden ones are filled close to the smooth truth
        truth = patchify(images[i : i + 1], patch)[0]
        assert torch.equal(out.patches[i][~hidden[i]], truth[~hidden[i]])
        assert float((out.patches[i][hidden[i]] - truth[hidden[i]]).square().mean()) < 0.01


def test_mean_and_nearest_neighbour_by_hand():
    train = torch.rand(5, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    test = train[[3]] + 0.01
    hidden = torch.tensor([[True, False, False, True]])
    assert torch.allclose(MeanImage(train, 2)(test, hidden).patches[0], patchify(train.mean(0, keepdim=True), 2)[0])
    nearest = NearestNeighbour(train, 2, chunk=2)(test, hidden)
    distances = [float(((patchify(train[[k]], 2) - patchify(test, 2))[:, ~hidden[0]]).square().sum()) for k in range(5)]
    assert int(nearest.extra["index"][0]) == int(np.argmin(distances)) == 3
