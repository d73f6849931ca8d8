"""Hostile and damaged files, generated small: every loader checks sizes from headers before it allocates, and
refuses with one documented error (``FileFormatError``, a ValueError) that names the file and the key."""

from __future__ import annotations

import gzip
import io
import json
import struct
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest
import torch

from et_ode import EnergyTransformer
from et_ode.data.images import check_image, read_idx, read_photo, read_png
from et_ode.models.image import MAX_PARAMETERS, ImageET
from et_ode.models.official import OFFICIAL_KEYS, load_official, official_arrays, read_official
from et_ode.tasks.image import ImageRunConfig, load_trained
from et_ode.training.io import load_model, save_model
from et_ode.training.statefile import FileFormatError, describe, read_npz
from et_ode.training.train import load_checkpoint, save_checkpoint


def _safetensors(path, header: dict, body: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


# ------------------------------------------------------------------------------------------ safetensors
@pytest.mark.parametrize("metadata", ["a string", ["format"], {"format": 3}, {"format": ["x"]}])
def test_a_safetensors_metadata_that_is_not_a_table_is_named(tmp_path, metadata):
    path = tmp_path / "checkpoint.safetensors"
    _safetensors(path, {"__metadata__": metadata})
    assert "not a table of strings" in describe(path) or "without et-ode metadata" in describe(path)
    with pytest.raises(FileFormatError, match=r"checkpoint.safetensors, key '__metadata__'") as caught:
        load_checkpoint(path)
    assert caught.value.key == "__metadata__" and caught.value.path == path


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [2**40, 2**10], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": "big", "data_offsets": [0, 4]},
        "not an entry",
    ],
)
def test_a_safetensors_header_declaring_absurd_tensors_is_refused(tmp_path, entry):
    path = tmp_path / "checkpoint.safetensors"
    _safetensors(path, {"__metadata__": {"format": "et-ode/training-checkpoint/2", "state": "{}"}, "w": entry}, b"\0" * 8)
    with pytest.raises(FileFormatError, match=r"key 'w'"):
        load_checkpoint(path)


def test_a_checkpoint_path_that_is_a_device_or_folder_is_refused(tmp_path):
    link = tmp_path / "zero.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(FileFormatError, match="not a regular file"):
        load_checkpoint(link)
    with pytest.raises(FileFormatError, match="not a regular file"):
        load_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------------ npz archives
def _official_file(tmp_path, **replace) -> object:
    torch.manual_seed(0)
    model = ImageET((1, 8, 8), 4, 8, 2, 4, 16, cls_token=True, cls_position=True, renormalize=True, self_attention=True)
    arrays = {**official_arrays(model), **replace}
    path = tmp_path / "official.npz"
    np.savez(path, **arrays)
    return path


def test_official_arrays_empty_or_big_endian(tmp_path):
    path = _official_file(tmp_path, Xi=np.zeros((8, 0), dtype=np.float32))
    with pytest.raises(FileFormatError, match=r"official.npz, key 'Xi': is empty"):
        read_official(path)
    reference = read_official(_official_file(tmp_path))
    swapped = _official_file(tmp_path, **{k: v.astype(v.dtype.newbyteorder(">")) for k, v in reference.items()})
    arrays = read_official(swapped)
    assert all(arrays[k].dtype == np.float32 and np.array_equal(arrays[k], reference[k]) for k in OFFICIAL_KEYS)
    assert load_official(swapped, (1, 8, 8), 4).block.hopfield.xi.shape == (16, 8)


def test_official_shape_errors_name_the_file_and_the_key(tmp_path):
    path = _official_file(tmp_path, POS_embed=np.zeros((3, 8), dtype=np.float32))
    with pytest.raises(FileFormatError, match=r"official.npz, key 'POS_embed': POS_embed must have shape") as caught:
        load_official(path, (1, 8, 8), 4)
    assert caught.value.key == "POS_embed"


def _npz_member(path, key: str, header_shape: tuple[int, ...], data: bytes, compress: bool = False) -> None:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": header_shape})
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method) as archive:
        archive.writestr(f"{key}.npy", buffer.getvalue() + data)


def test_a_header_claiming_a_huge_array_is_refused_unallocated(tmp_path):
    path = tmp_path / "claims.npz"
    _npz_member(path, "Xi", (4_000_000, 4_000_000), b"\0" * 64)
    with pytest.raises(FileFormatError, match=r"key 'Xi': its header declares 16000000000000 elements"):
        read_npz(path, ["Xi"], what="archive")
    _npz_member(path, "Xi", (4, 4), b"\0" * 60)  # a header that does not match its data
    with pytest.raises(FileFormatError, match=r"key 'Xi': its header declares shape \(4, 4\)"):
        read_npz(path, ["Xi"], what="archive")


def test_a_zip_bomb_is_refused_before_it_is_decompressed(tmp_path):
    path = tmp_path / "bomb.npz"
    count = 4_000_000  # 16 MB of zeros, a few KB compressed
    _npz_member(path, "Xi", (count,), bytes(4 * count), compress=True)
    assert path.stat().st_size < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(FileFormatError, match=r"key 'Xi'.*more than the 1000"):
            read_npz(path, ["Xi"], what="archive", max_elements=1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000


def test_pickled_and_non_numeric_members_are_refused(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, Xi=np.array([{"a": 1}], dtype=object), s=np.array(["text"]))
    with pytest.raises(FileFormatError, match=r"key 'Xi'.*pickle"):
        read_npz(path, ["Xi"], what="archive")
    with pytest.raises(FileFormatError, match=r"key 's'.*not numbers"):
        read_npz(path, ["s"], what="archive")


def test_an_idx_bomb_is_refused_from_its_header(tmp_path):
    path = tmp_path / "images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as file:
        file.write(bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 2**20, 2**10, 2**10) + bytes(1 << 16))
    with pytest.raises(FileFormatError, match=r"images-idx3-ubyte.gz, key 'data'.*more than"):
        read_idx(path)
    big_endian = tmp_path / "floats-idx1"
    big_endian.write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 2) + struct.pack(">2f", 1.5, -2.0))
    values = read_idx(big_endian)
    assert values.dtype == np.float32 and values.dtype.isnative and values.tolist() == [1.5, -2.0]


# ------------------------------------------------------------------------------------------ images
def _png_header_only(path, width: int, height: int) -> None:
    """A PNG whose header claims ``width x height`` grey pixels (its data is never needed to read the size)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.mark.parametrize("side", [10_000, 20_000])
def test_image_bombs_are_refused_from_their_header(tmp_path, side):
    path = tmp_path / "bomb.png"
    _png_header_only(path, side, side)
    for read in (check_image, read_png, lambda p: read_photo(p, (8, 8))):
        with pytest.raises(FileFormatError, match="bomb.png.*(too large|more than)"):
            read(path)


# ------------------------------------------------------------------------------------------ model files
def test_a_model_file_asking_for_absurd_sizes_is_refused_unallocated(tmp_path):
    path = tmp_path / "model.pt"
    config = {"dim": 200_000, "heads": 1, "head_dim": 4, "memories": 200_000}
    torch.save(
        {"format": "et-ode/energy-transformer/1", "config": config, "state_dict": {"w": torch.zeros(1)}, "meta": {}}, path
    )
    with pytest.raises(FileFormatError, match=rf"model.pt, key 'config'.*more than the {MAX_PARAMETERS}"):
        load_model(path)


def test_model_weights_that_do_not_match_the_description_are_named(tmp_path):
    path = tmp_path / "model.pt"
    save_model(EnergyTransformer(dim=8, heads=2, head_dim=4, memories=16), path)
    blob = torch.load(path, weights_only=True)
    blob["config"]["memories"] = 12
    torch.save(blob, path)
    with pytest.raises(FileFormatError, match=r"key 'config'.*hopfield"):
        load_model(path)


def _trained_file(tmp_path, edit) -> object:
    torch.manual_seed(0)
    model = ImageET((1, 8, 8), 4, 8, 2, 4, 16)
    meta = {"model": model.config(), "run": ImageRunConfig().to_dict()}
    state = {"model": model.state_dict(), "meta": meta}
    edit(state)
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, state)
    return path


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda s: s["meta"]["model"].pop("dim"), "meta.model"),
        (lambda s: s["meta"]["model"]["dynamics"].update(solver={"bogus": 1}), "meta.model"),
        (lambda s: s["meta"]["model"].update(dynamics="text"), "meta.model"),
        (lambda s: s["meta"]["model"].update(dim=200_000, memories=200_000), "meta.model"),
        (lambda s: s["meta"]["model"].update(memories=12), "model"),
        (lambda s: s["model"].pop("decoder.bias"), "model"),
        (lambda s: s["meta"].update(run="not a run"), "meta.run"),
        (lambda s: s.update(meta="text"), "meta"),
    ],
)
def test_a_trained_checkpoint_that_does_not_make_its_model_is_named(tmp_path, edit, key):
    path = _trained_file(tmp_path, edit)
    with pytest.raises(FileFormatError, match=rf"checkpoint.safetensors, key '{key}'") as caught:
        load_trained(path)
    assert caught.value.key == key


# ------------------------------------------------------------------------------------------ text files
def _tu_folder(tmp_path, a_text: bytes | None = None):
    raw = tmp_path / "T" / "raw"
    raw.mkdir(parents=True)
    (raw / "T_graph_indicator.txt").write_text("1\n1\n2\n2\n")
    (raw / "T_graph_labels.txt").write_text("0\n1\n")
    if a_text is not None:
        (raw / "T_A.txt").write_bytes(a_text)
    return raw


def test_a_tu_file_linked_to_a_device_is_refused_unread(tmp_path):
    from et_ode.data.graphs import check_tu_files

    raw = _tu_folder(tmp_path)
    (raw / "T_A.txt").symlink_to("/dev/zero")
    with pytest.raises(FileFormatError, match=r"T_A.txt: the text file is not a regular file"):
        check_tu_files(tmp_path, "T")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"1, 2\n\xff\xfe\x00\x01\n", r"T_A.txt: not a text file"),
        (b"1, 2\n1, " + b"9" * 30 + b"\n", r"T_A.txt:2: expected two"),
        (b"1, 2\n1, " + b"9" * 5000 + b"\n", r"T_A.txt:2: expected two"),
    ],
)
def test_tu_text_that_is_binary_or_out_of_range_is_named_by_line(tmp_path, content, message):
    from et_ode.data.graphs import check_tu_files

    _tu_folder(tmp_path, content)
    with pytest.raises(ValueError, match=message):
        check_tu_files(tmp_path, "T")


def test_an_oversized_text_file_is_refused_before_reading(tmp_path):
    from et_ode.data.graphs import MAX_TEXT_BYTES, check_tu_files

    raw = _tu_folder(tmp_path, b"")
    with open(raw / "T_A.txt", "wb") as file:
        file.truncate(MAX_TEXT_BYTES + 1)  # sparse: nothing written to the disk
    with pytest.raises(FileFormatError, match=rf"T_A.txt: the text file holds {MAX_TEXT_BYTES + 1} bytes"):
        check_tu_files(tmp_path, "T")


def test_a_member_that_expands_beyond_reason_is_refused_unread(tmp_path, monkeypatch):
    from et_ode.data import _files as files

    monkeypatch.setattr(files, "MAX_EXPANSION_BYTES", 2**20)
    path = tmp_path / "bomb.npz"
    _npz_member(path, "Xi", (1_000_000,), bytes(4_000_000), compress=True)  # 4 MB of zeros, a few KB stored
    with pytest.raises(FileFormatError, match=r"key 'Xi': \d+ compressed bytes expand to 4000128 .*zip bomb"):
        read_npz(path, ["Xi"], what="archive")
    random = tmp_path / "random.npz"
    values = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    np.savez_compressed(random, Xi=values)  # incompressible data of the same size is read
    assert np.array_equal(read_npz(random, ["Xi"], what="archive")["Xi"], values)


def test_a_text_line_beyond_the_line_limit_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    from et_ode.data import graphs

    monkeypatch.setattr(graphs, "MAX_LINE_CHARACTERS", 100)
    _tu_folder(tmp_path, b"1, 2\n" + b"1 " * 200 + b"\n")
    with pytest.raises(ValueError, match=r"T_A.txt:2: a line of 401 characters, more than the 100"):
        graphs.check_tu_files(tmp_path, "T")
