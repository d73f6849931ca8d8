"""Data-only files: a nested state (dicts, lists, tuples, numbers, strings, tensors, NumPy arrays) in one
safetensors file.

The tensors go into the safetensors body; everything else becomes JSON in the header's ``__metadata__``, each
tensor replaced by a reference to its name. Reading such a file parses JSON and copies bytes: unlike a pickle
(``torch.save``) it cannot run code, whoever wrote it. Python floats round-trip exactly (JSON keeps their ``repr``),
so a resumed run continues bit for bit. :func:`save_state` writes atomically (:func:`atomic_write`), :func:`load_state`
reads, and :func:`describe` says what a file is, for error messages. The file limits of every loader
(``FileFormatError``, ``check_file``, ``check_elements``, ``read_npz``) are :mod:`et_ode.data._files`'s, named here.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from numbers import Integral
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from et_ode.backend.memory import memory_named
from et_ode.data._files import (  # noqa: F401 (FileFormatError and the checks are part of this module's API)
    MAX_ARRAY_ELEMENTS,
    MAX_FILE_BYTES,
    MAX_TOTAL_ELEMENTS,
    FileFormatError,
    check_elements,
    check_file,
    is_zip,
    read_npz,
)
from et_ode.training.runs import RunWriteError

_TENSOR, _NUMPY, _TUPLE, _ITEMS = "__tensor__", "__ndarray__", "__tuple__", "__items__"
_MARKERS = (_TENSOR, _NUMPY, _TUPLE, _ITEMS)
_PICKLE_ADVICE = (
    "it is a pickle (torch.save) file; et-ode never unpickles it with weights_only=False, since a "
    "pickle can run arbitrary code when loaded"
)


def _encode(value: Any, tensors: dict[str, Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Tensor):
        if value.layout != torch.strided:
            raise TypeError(f"cannot store {where}: a {value.layout} tensor (only dense tensors)")
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()  # a copy: no shared storage
        return {_TENSOR: name}
    if isinstance(value, np.ndarray):
        name = f"t{len(tensors)}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value).copy())
        return {_NUMPY: name}
    if isinstance(value, np.generic):
        return _encode(value.item(), tensors, where)
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in value):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        return {
            _ITEMS: [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]
        }
    raise TypeError(
        f"cannot store {where}: {type(value).__name__} is not data (state files hold tensors, NumPy "
        f"arrays, numbers, strings, None, and lists, tuples and dicts of them)"
    )


def _decode(value: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((key, inner),) = value.items()
        if key == _TENSOR:
            return tensors[inner]
        if key == _NUMPY:
            return tensors[inner].numpy()
        if key == _TUPLE:
            return tuple(_decode(v, tensors) for v in inner)
        if key == _ITEMS:
            return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in inner}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def save_state(path: str | os.PathLike[str], state: dict[str, Any], format: str) -> Path:
    """Write ``state`` to ``path`` as safetensors + JSON, tagged with ``format``, atomically.

    Args:
        path: the file to write (replaced whole, or left as it is if the write fails).
        state: nested dicts, lists and tuples of numbers, strings, None, tensors and NumPy arrays.
        format: the tag :func:`load_state` checks (e.g. ``"et-ode/training-checkpoint/2"``).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: ``state`` holds something that is not data (an object, a function), naming where.
        et_ode.training.runs.RunWriteError: the disk refused (:func:`atomic_write`).
    """
    tensors: dict[str, Tensor] = {}
    skeleton = _encode(state, tensors, "state")
    blob = save_tensors(tensors, metadata={"format": format, "state": json.dumps(skeleton)})
    return atomic_write(path, lambda stream: stream.write(blob))


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(stream)`` on a temporary file beside ``path``, flush it to the disk (fsync), then rename it
    over ``path`` (``os.replace``): a crash or an exception mid-write leaves the previous file intact and no
    temporary file behind (a killed process's is deleted when its run folder is next locked,
    :func:`et_ode.training.runs.lock`). The file gets the permissions of the one it replaces, else those ``open`` gives.
    Creates the parent folder. Returns ``path``.

    Raises:
        et_ode.training.runs.RunWriteError (a ValueError): the disk refused (full, read-only, no permission), naming ``path``
            and keeping the ``errno``; the previous file is intact.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise RunWriteError(path, error) from None
    try:
        os.fchmod(handle, _mode_for(path))
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise RunWriteError(path, error) from None
        raise
    return path


def _mode_for(path: Path) -> int:
    """The permissions of a file written over ``path``: those of the file it replaces, else ``0o666`` less the
    process's umask (as ``open`` creates files)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mask = os.umask(0o022)
        os.umask(mask)
        return 0o666 & ~mask


def _header(raw: bytes) -> dict[str, Any] | None:
    """The JSON header of a safetensors blob, or None when ``raw`` is not one."""
    if len(raw) < 10:
        return None
    size = int.from_bytes(raw[:8], "little")
    if not 2 <= size <= len(raw) - 8 or raw[8:9] != b"{":
        return None
    try:
        header = json.loads(raw[8 : 8 + size])
    except (ValueError, RecursionError):  # RecursionError: a header nested thousands deep
        return None
    return header if isinstance(header, dict) else None


def describe(path: str | os.PathLike[str]) -> str:
    """What the file at ``path`` is, from its first bytes and header (never unpickles): e.g.
    ``"an et-ode state file (format 'et-ode/training-checkpoint/2')"`` or ``"a pickle (torch.save) file"``."""
    path = Path(path)
    with open(path, "rb") as file:
        head = file.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        raw = head + file.read(size) if 2 <= size <= 100_000_000 else head
    header = _header(raw)
    if header is None and raw[8:9] == b"{":  # a header's length, then its opening brace: a safetensors file cut short
        return "a safetensors file whose header is truncated or corrupt"
    if header is not None:
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict):
            return "a safetensors file whose __metadata__ is not a table of strings"
        if isinstance(meta.get("format"), str):
            return f"an et-ode state file (format {meta['format']!r})"
        return "a safetensors file without et-ode metadata"
    if is_zip(path) or raw[:1] == b"\x80":
        return "a pickle (torch.save) file"
    return "not a file et-ode knows (neither safetensors nor torch.save)"


def torch_file_format(path: str | os.PathLike[str]) -> str | None:
    """The ``"format"`` entry of a ``torch.save`` file holding a dict (e.g. an et-ode model file), read with
    ``weights_only=True`` (data only, no code runs); None when it has none or cannot be read that way."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a payload, a damaged file, ...: torch refuses it in several ways
        return None
    return blob.get("format") if isinstance(blob, dict) and isinstance(blob.get("format"), str) else None


def load_state(
    path: str | os.PathLike[str], format: str, map_location: str | torch.device = "cpu", what: str = "state file"
) -> dict[str, Any]:
    """Read a file written by :func:`save_state` with ``format``; never runs code from the file.

    Args:
        path: the file.
        format: the tag the file must carry.
        map_location: where the tensors go.
        what: what the file is, for the messages (e.g. ``"checkpoint"``).

    Returns:
        The state as :func:`save_state` received it (tuples and NumPy arrays included), tensors on ``map_location``.

    Raises:
        FileNotFoundError: no file at ``path``.
        FileFormatError (a ValueError): not a regular file or too large (:func:`check_file`); empty, truncated or
            corrupt; a pickle; a header entry that is not a tensor, declares too many elements, or a
            ``__metadata__`` that is not a table of strings; or another format (the message says which), naming
            ``path`` (calling it ``what``) and the key at fault.
        et_ode.backend.memory.OutOfMemoryError: the file's tensors do not fit in memory.
    """
    path = Path(path)
    check_file(path, what)
    with memory_named(f"loading the {what} {path}"):
        raw = path.read_bytes()
    if not raw:
        raise FileFormatError(path, None, f"{what} {path} is empty (0 bytes): truncated or corrupt", named=True)
    header = _header(raw)
    if header is None:
        kind = describe(path)
        if kind.startswith("a pickle"):
            raise FileFormatError(
                path,
                None,
                f"{what} {path} is refused: {_PICKLE_ADVICE}. et-ode {what}s are "
                f"safetensors files (format {format!r}); see the README's Safety "
                f"section",
                named=True,
            )
        raise FileFormatError(
            path, None, f"{what} {path} ({len(raw)} bytes) is truncated or corrupt: not a safetensors file", named=True
        )
    meta = _metadata(header, path)
    if meta.get("format") != format:
        found = f"format {meta['format']!r}" if "format" in meta else "no et-ode format tag"
        raise FileFormatError(
            path, "__metadata__", f"{path} is not an et-ode {what} (expected format {format!r}, found {found})", named=True
        )
    _check_tensor_headers(header, path)
    try:
        with memory_named(f"loading the {what} {path}"):
            tensors = load_tensors(raw)
        skeleton = json.loads(meta["state"])
        state = _decode(skeleton, tensors)
    except (SafetensorError, KeyError, ValueError, TypeError, RecursionError) as error:
        raise FileFormatError(
            path,
            None,
            f"{what} {path} ({len(raw)} bytes) is truncated or corrupt and cannot be read: {type(error).__name__}: {error}",
            named=True,
        ) from None
    if not isinstance(state, dict):
        raise FileFormatError(path, "state", f"{what} {path} does not hold a dict (got {type(state).__name__})", named=True)
    if torch.device(map_location).type != "cpu":
        state = _to_device(state, torch.device(map_location))
    return state


def read_tensors(path: str | os.PathLike[str], what: str) -> dict[str, Tensor]:
    """The tensors of the safetensors file ``path`` (whatever its metadata), on the CPU; never runs code.

    Raises:
        FileNotFoundError: no file at ``path``.
        FileFormatError (a ValueError): not a regular file or too large (:func:`check_file`); not a safetensors file
            (the message says what it is); a ``__metadata__`` that is not a table of strings; a header entry that is
            not a tensor or declares too many elements (checked before anything is allocated); truncated or corrupt
            data; naming ``path`` (calling it ``what``) and the key at fault.
        et_ode.backend.memory.OutOfMemoryError: the file's tensors do not fit in memory.
    """
    path = Path(path)
    check_file(path, what)
    with memory_named(f"loading the {what} {path}"):
        raw = path.read_bytes()
    header = _header(raw)
    if header is None:
        raise FileFormatError(path, None, f"the {what} is not a readable safetensors file: {describe(path)}")
    _metadata(header, path)
    _check_tensor_headers(header, path)
    try:
        with memory_named(f"loading the {what} {path}"):
            return load_tensors(raw)
    except SafetensorError as error:
        raise FileFormatError(path, None, f"the {what} is truncated or corrupt: {error}") from None


def _metadata(header: dict[str, Any], path: Path) -> dict[str, str]:
    """The ``__metadata__`` table of a safetensors header: FileFormatError naming it unless strings to strings."""
    meta = header.get("__metadata__", {})
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FileFormatError(path, "__metadata__", f"must be a table of strings, got {type(meta).__name__}")
    return meta


def _check_tensor_headers(header: dict[str, Any], path: Path) -> None:
    """Every tensor entry of a safetensors header: a dtype, a shape (element counts within the limits) and offsets."""
    total = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("dtype"), str)
            or not isinstance(entry.get("shape"), list)
            or not isinstance(entry.get("data_offsets"), list)
        ):
            raise FileFormatError(path, key, "not a tensor entry (dtype, shape, data_offsets)")
        total += check_elements(path, key, entry["shape"])
        if total > MAX_TOTAL_ELEMENTS:
            raise FileFormatError(path, key, f"the tensors hold more than {MAX_TOTAL_ELEMENTS} elements")


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value
