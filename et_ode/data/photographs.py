"""Photographs that Python packages ship, each assigned to one split (nothing is downloaded).

22 photographs: 19 bundled with scikit-image (``skimage.data``: only files inside the installed package, none of
the functions that fetch with pooch), 2 with scikit-learn (``load_sample_images``) and 1 with matplotlib (its
``sample_data``). Each photograph belongs to one split, fixed here (:data:`PHOTOGRAPHS`), so the tiles of a
photograph never straddle two splits:

========== ======================================================================== ================================
split      colour photographs                                                      grey photographs
========== ======================================================================== ================================
train      rocket, hubble_deep_field, immunohistochemistry, retina,                moon, page, clock, grass, cell,
           motorcycle (the left view of stereo_motorcycle), china                  microaneurysms
validation chelsea, flower                                                          text, gravel
test       astronaut, coffee, grace_hopper                                          camera, coins, brick
========== ======================================================================== ================================

``channels=1`` uses all 22 (colour ones converted to grey with the ITU-R BT.601 weights ``0.299 R + 0.587 G +
0.114 B``, like :func:`et_ode.data.load_png_folder`); ``channels=3`` the 11 colour ones. Photographs are kept at
their own resolution (from 102x102, microaneurysms, to 1411x1411, retina) and cut into ``tile x tile`` tiles
``stride`` apart (default ``tile``). Values in ``[0, 1]``; labels ``-1``; :attr:`ImageSet.sources` names each
tile's photograph (the tiling is :func:`et_ode.data.load_photographs`).

Public API (the tiles: :func:`et_ode.data.load_photographs`)::

    PHOTOGRAPHS: dict[str, tuple[str, bool]]     # name -> (split, colour?)
    photograph(name) -> np.ndarray (H, W) or (H, W, 3), uint8
"""

from __future__ import annotations

import numpy as np

# name -> (split, is it a colour photograph)
PHOTOGRAPHS: dict[str, tuple[str, bool]] = {
    "rocket": ("train", True),
    "hubble_deep_field": ("train", True),
    "immunohistochemistry": ("train", True),
    "retina": ("train", True),
    "motorcycle": ("train", True),
    "china": ("train", True),
    "moon": ("train", False),
    "page": ("train", False),
    "clock": ("train", False),
    "grass": ("train", False),
    "cell": ("train", False),
    "microaneurysms": ("train", False),
    "chelsea": ("validation", True),
    "flower": ("validation", True),
    "text": ("validation", False),
    "gravel": ("validation", False),
    "astronaut": ("test", True),
    "coffee": ("test", True),
    "grace_hopper": ("test", True),
    "camera": ("test", False),
    "coins": ("test", False),
    "brick": ("test", False),
}


def photograph(name: str) -> np.ndarray:
    """The photograph ``name`` (a key of :data:`PHOTOGRAPHS`) as stored: uint8 ``(H, W)`` or ``(H, W, 3)``."""
    if name not in PHOTOGRAPHS:
        raise ValueError(f"unknown photograph {name!r}; valid: {', '.join(sorted(PHOTOGRAPHS))}")
    if name in ("china", "flower"):
        from sklearn.datasets import load_sample_image

        return np.asarray(load_sample_image(f"{name}.jpg"))
    if name == "grace_hopper":
        from matplotlib import cbook
        from matplotlib.image import imread

        return np.asarray(imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))))
    try:
        from skimage import data
    except ImportError:
        raise ImportError("the photos data set needs scikit-image: pip install scikit-image (or et-ode[images])") from None
    if name == "motorcycle":
        return np.asarray(data.stereo_motorcycle()[0])
    return np.asarray(getattr(data, name)())
