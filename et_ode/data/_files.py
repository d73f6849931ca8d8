"""Reading untrusted files within limits: the one error of every et-ode file loader, and the checks made before
anything is allocated.

:class:`FileFormatError` is a ValueError naming the file and the key at fault. :func:`check_file` accepts a regular
file (not a folder, device or pipe) within a size, :func:`check_elements` an array size declared in a header within a
count, :func:`read_npz` reads an ``.npz`` archive with every member's header checked first, and :func:`is_zip` tells
a zip archive, damaged or not. The limits are ``MAX_FILE_BYTES``, ``MAX_ARRAY_ELEMENTS``, ``MAX_TOTAL_ELEMENTS``,
``MAX_EXPANSION`` and ``MAX_EXPANSION_BYTES`` (a compressed member's growth).
"""

from __future__ import annotations

import math
import os
import stat
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from et_ode.backend.memory import memory_named

MAX_FILE_BYTES = 2**33  # 8 GiB: the largest state, model or archive file read
MAX_ARRAY_ELEMENTS = 2**28  # elements of one array (1 GiB of float32), checked from the file's header before reading
MAX_TOTAL_ELEMENTS = 2**29  # all the arrays of one file together
MAX_EXPANSION, MAX_EXPANSION_BYTES = 100, 2**26  # a compressed member may expand 100-fold once it exceeds 64 MiB


class FileFormatError(ValueError):
    """A file that cannot be read as what it should be: the message names the file (``path``) and, where one entry
    is at fault, its ``key`` (None: the whole file). Raised by every et-ode file loader for damaged, hostile or
    oversized files (sizes are checked from headers before anything is allocated)."""

    def __init__(self, path: str | os.PathLike[str], key: str | None, problem: str, *, named: bool = False):
        """``problem`` is prefixed with the file and the key, unless ``named`` (it names them itself)."""
        where = f"{path}" if key is None else f"{path}, key {key!r}"
        super().__init__(problem if named else f"{where}: {problem}")
        self.path = Path(path)
        self.key = key


def check_file(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_FILE_BYTES) -> int:
    """The size of the regular file ``path`` (a link is followed), checked before it is read.

    Raises:
        FileNotFoundError: nothing at ``path``.
        FileFormatError: not a regular file (a folder, a device such as ``/dev/zero``, a pipe), or larger than
            ``max_bytes``, naming ``path`` and calling it ``what``.
    """
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path} (looked for a file at {path.resolve()})") from None
    except OSError as error:
        raise FileFormatError(path, None, f"the {what} cannot be read ({error.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise FileFormatError(path, None, f"the {what} is not a regular file (a folder, a device or a pipe)")
    if info.st_size > max_bytes:
        raise FileFormatError(path, None, f"the {what} holds {info.st_size} bytes, more than the {max_bytes} et-ode reads")
    return info.st_size


def check_elements(
    path: str | os.PathLike[str], key: str, shape: Sequence[int], max_elements: int = MAX_ARRAY_ELEMENTS
) -> int:
    """The element count of an array of ``shape`` declared in a file's header: FileFormatError naming ``path`` and
    ``key`` if a dimension is not a non-negative integer or the count exceeds ``max_elements``."""
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise FileFormatError(path, key, f"its shape {list(shape)!r} is not a list of non-negative integers")
    count = math.prod(shape)
    if count > max_elements:
        raise FileFormatError(
            path,
            key,
            f"its header declares {count} elements (shape {tuple(shape)}), more than the {max_elements} et-ode reads",
        )
    return count


def is_zip(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a zip archive (an ``.npz``, a ``torch.save`` file), damaged ones included: ``zipfile``'s own
    test raises on some corrupt end records instead of answering."""
    try:
        return zipfile.is_zipfile(path)
    except (zipfile.BadZipFile, ValueError):
        return True


def read_npz(
    path: str | os.PathLike[str],
    keys: Sequence[str],
    *,
    what: str,
    max_elements: int = MAX_ARRAY_ELEMENTS,
    allow_empty: bool = False,
) -> dict[str, np.ndarray]:
    """The arrays ``keys`` of the ``.npz`` archive ``path``, in native byte order; never runs code.

    Each member's ``.npy`` header is read first: its dtype (numbers and booleans only: no objects, so no pickle),
    its shape (at most ``max_elements`` elements, ``MAX_TOTAL_ELEMENTS`` in all) and its size must agree with the
    archive, and a member over ``MAX_EXPANSION_BYTES`` may not expand more than ``MAX_EXPANSION`` times its
    compressed size, before the array is read: a zip bomb or a header claiming a huge array is refused unallocated.

    Raises:
        FileNotFoundError: no file at ``path``.
        FileFormatError: not an ``.npz`` archive, a key missing, an object (pickled) array, a header that does not
            match its data, too many elements, or an empty array without ``allow_empty``; naming ``path`` and the key.
        et_ode.backend.memory.OutOfMemoryError: an array does not fit in memory.
    """
    path = Path(path)
    check_file(path, what)
    if not is_zip(path):
        raise FileFormatError(path, None, f"the {what} is not an .npz archive (a zip of .npy arrays)")
    try:
        with zipfile.ZipFile(path) as archive:
            members = {info.filename[:-4]: info for info in archive.infolist() if info.filename.endswith(".npy")}
            missing = [key for key in keys if key not in members]
            if missing:
                raise FileFormatError(
                    path,
                    missing[0],
                    f"key(s) {', '.join(missing)} missing (found: {', '.join(sorted(members)) or 'no arrays'})",
                )
            total, arrays = 0, {}
            for key in keys:
                with memory_named(f"{path}, key {key!r}: reading the {what}"):
                    arrays[key] = _read_member(archive, members[key], path, key, max_elements, allow_empty)
                total += arrays[key].size
                if total > MAX_TOTAL_ELEMENTS:
                    raise FileFormatError(path, key, f"the arrays hold more than {MAX_TOTAL_ELEMENTS} elements")
            return arrays
    except (OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError) as error:
        raise FileFormatError(path, None, f"the {what} is not a readable .npz archive: {error}") from None


def _read_exactly(stream: BinaryIO | Any, size: int) -> bytearray | None:
    """``size`` bytes of ``stream`` into one writable buffer (read in chunks), or None when it ends before."""
    data = bytearray(size)
    view, filled = memoryview(data), 0
    while filled < size:
        chunk = stream.read(min(size - filled, 1 << 24))
        if not chunk:
            return None
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return data


def _read_member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path, key: str, max_elements: int, allow_empty: bool
) -> np.ndarray:
    """One ``.npy`` member, its header checked before its data is read (see :func:`read_npz`)."""
    with archive.open(info) as stream:
        try:
            version = np.lib.format.read_magic(stream)
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = reader(stream)
        except ValueError as error:
            raise FileFormatError(path, key, f"not a valid .npy array header: {error}") from None
        if dtype.hasobject or dtype.kind not in "biufc":
            raise FileFormatError(
                path,
                key,
                f"holds {dtype} values, not numbers: object arrays are pickles, which "
                f"et-ode never loads (they can run code)",
            )
        count = check_elements(path, key, shape, max_elements)
        if count == 0 and not allow_empty:
            raise FileFormatError(path, key, f"is empty (shape {tuple(shape)})")
        header = stream.tell()
        if info.file_size > MAX_EXPANSION_BYTES and info.file_size > MAX_EXPANSION * max(info.compress_size, 1):
            raise FileFormatError(
                path,
                key,
                f"{info.compress_size} compressed bytes expand to {info.file_size} (more "
                f"than {MAX_EXPANSION} times: a zip bomb?); refused unread",
            )
        if info.file_size - header != count * dtype.itemsize:
            raise FileFormatError(
                path,
                key,
                f"its header declares shape {tuple(shape)} of {dtype} "
                f"({count * dtype.itemsize} bytes) but it holds {info.file_size - header}",
            )
        data = _read_exactly(stream, count * dtype.itemsize)
        if data is None:
            raise FileFormatError(path, key, "its data is truncated")
    array = np.frombuffer(data, dtype=dtype, count=count).reshape(shape, order="F" if fortran else "C")
    native = dtype.newbyteorder("=")
    return array if array.flags.c_contiguous and dtype == native else array.astype(native, order="C")
