"""Photographs that Python packages ship, each assigned to one split (nothing is downloaded).

22 photographs: 19 bundled with scikit-image (only files inside the installed package, none that it fetches), 2 with
scikit-learn and 1 with matplotlib. :data:`PHOTOGRAPHS` fixes the split of each (``name -> (split, colour?)``), so
the tiles of a photograph never straddle two splits; :func:`photograph` reads one as ``uint8`` pixels ``(H, W)`` or
``(H, W, 3)`` at its own resolution. The tiles, grey (all 22, ITU-R BT.601 weights) or RGB (the 11 colour ones),
are :func:`et_ode.data.load_photographs`.
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
