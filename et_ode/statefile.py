"""Data-only files: a nested state (dicts, lists, tuples, numbers, strings, tensors, NumPy arrays) in one
safetensors file.

The tensors go into the safetensors body; everything else becomes JSON in the header's ``__metadata__``, with
each tensor replaced by a reference to its name. Reading such a file parses JSON and copies bytes: unlike a
pickle (``torch.save``), it cannot run code, whoever wrote it. Used for training checkpoints
(:mod:`et_ode.train`).

Public API::

    atomic_write(path, write) -> Path           # write(stream) into a temporary file beside path, fsync, os.replace
    save_state(path, state, format) -> Path     # atomic (atomic_write)
    load_state(path, format, map_location="cpu") -> dict
    describe(path) -> str                       # what a file is, for error messages (never unpickles)

Python floats round-trip exactly (JSON keeps their ``repr``), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile
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

_TENSOR, _NUMPY, _TUPLE, _ITEMS = "__tensor__", "__ndarray__", "__tuple__", "__items__"
_MARKERS = (_TENSOR, _NUMPY, _TUPLE, _ITEMS)
_PICKLE_ADVICE = ("it is a pickle (torch.save) file; et-ode never unpickles it with weights_only=False, since a "
                  "pickle can run arbitrary code when loaded")


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
        return {_ITEMS: [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")]
                         for k, v in value.items()]}
    raise TypeError(f"cannot store {where}: {type(value).__name__} is not data (state files hold tensors, NumPy "
                    f"arrays, numbers, strings, None, and lists, tuples and dicts of them)")


def _decode(value: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, inner), = value.items()
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

    Raises:
        TypeError: ``state`` holds something that is not data (an object, a function), naming where.
    """
    tensors: dict[str, Tensor] = {}
    skeleton = _encode(state, tensors, "state")
    blob = save_tensors(tensors, metadata={"format": format, "state": json.dumps(skeleton)})
    return atomic_write(path, lambda stream: stream.write(blob))


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(stream)`` on a temporary file beside ``path``, flush it to the disk (fsync), then rename it
    over ``path`` (``os.replace``): a crash or an exception mid-write leaves the previous file intact and no
    temporary file behind. Creates the parent folder. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def _header(raw: bytes) -> dict[str, Any] | None:
    """The JSON header of a safetensors blob, or None when ``raw`` is not one."""
    if len(raw) < 10:
        return None
    size = int.from_bytes(raw[:8], "little")
    if not 2 <= size <= len(raw) - 8 or raw[8:9] != b"{":
        return None
    try:
        header = json.loads(raw[8:8 + size])
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
    if header is not None:
        meta = header.get("__metadata__") or {}
        if "format" in meta:
            return f"an et-ode state file (format {meta['format']!r})"
        return "a safetensors file without et-ode metadata"
    if zipfile.is_zipfile(path) or raw[:1] == b"\x80":
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


def load_state(path: str | os.PathLike[str], format: str, map_location: str | torch.device = "cpu",
               what: str = "state file") -> dict[str, Any]:
    """Read a file written by :func:`save_state` with ``format``; never runs code from the file.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: empty, truncated or corrupt; a pickle; or another format (the message says which), naming
            ``path`` and calling it ``what``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (looked for a file at {path.resolve()})")
    raw = path.read_bytes()
    if not raw:
        raise ValueError(f"{what} {path} is empty (0 bytes): truncated or corrupt")
    header = _header(raw)
    if header is None:
        kind = describe(path)
        if kind.startswith("a pickle"):
            raise ValueError(f"{what} {path} is refused: {_PICKLE_ADVICE}. et-ode {what}s are safetensors files "
                             f"(format {format!r}); see the README's Safety section")
        raise ValueError(f"{what} {path} ({len(raw)} bytes) is truncated or corrupt: not a safetensors file")
    meta = header.get("__metadata__") or {}
    if meta.get("format") != format:
        found = f"format {meta['format']!r}" if "format" in meta else "no et-ode format tag"
        raise ValueError(f"{path} is not an et-ode {what} (expected format {format!r}, found {found})")
    try:
        tensors = load_tensors(raw)
        skeleton = json.loads(meta["state"])
        state = _decode(skeleton, tensors)
    except (SafetensorError, KeyError, ValueError, TypeError, RecursionError) as error:
        raise ValueError(f"{what} {path} ({len(raw)} bytes) is truncated or corrupt and cannot be read: "
                         f"{type(error).__name__}: {error}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{what} {path} does not hold a dict (got {type(state).__name__})")
    if torch.device(map_location).type != "cpu":
        state = _to_device(state, torch.device(map_location))
    return state


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value
