"""Running out of memory, named: the allocators' own failures turned into one documented error.

PyTorch reports an allocation it cannot make as ``torch.OutOfMemoryError`` on an accelerator and as a
``RuntimeError`` from ``DefaultCPUAllocator`` on the CPU; NumPy raises ``MemoryError``. :func:`memory_named` catches
each at an entry point of the library (a solve, an attractor search, a model's construction, a file's loading) and
raises :class:`OutOfMemoryError` instead, naming what is too large and the bytes the failed allocation asked for.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_REQUESTS = (
    re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE),  # the CPU allocator
    re.compile(r"tried to allocate ([\d.]+) ?([KMGTP]iB|B)\b", re.IGNORECASE),  # CUDA's caching allocator
    re.compile(r"unable to allocate ([\d.]+) ([KMGTP]iB|B)\b", re.IGNORECASE),  # NumPy
)
_CPU_ALLOCATOR = ("DefaultCPUAllocator", "can't allocate memory")
_OVERFLOW = "Storage size calculation overflowed"  # sizes whose byte count exceeds 64 bits


class OutOfMemoryError(MemoryError):
    """An allocation the machine could not make: the message names what is too large (the argument and its size)
    and the bytes asked for; ``requested`` holds those bytes (None where the allocator did not say).

    Args:
        message: what is too large: the argument, its size and the bytes asked for.
        requested: the bytes asked for, or None where the allocator did not say.
    """

    def __init__(self, message: str, requested: int | None = None):
        super().__init__(message)
        self.requested = requested


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's report of memory it could not allocate (CUDA's, the CPU's, NumPy's, or
    PyTorch's for sizes whose byte count overflows)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in (*_CPU_ALLOCATOR, _OVERFLOW))


def requested_bytes(error: BaseException) -> int | None:
    """The bytes the failed allocation of ``error`` asked for, read from the allocator's message (None if absent)."""
    text = str(error)
    for pattern in _REQUESTS:
        match = pattern.search(text)
        if match:
            unit = match.group(2).lower() if match.lastindex and match.lastindex >= 2 else "b"
            return round(float(match.group(1)) * _UNITS.get(unit, 1))
    return None


def describe_bytes(count: int) -> str:
    """``count`` bytes in a readable unit, e.g. ``"160 GB"``."""
    value, unit = float(count), "bytes"
    for name in ("kB", "MB", "GB", "TB", "PB", "EB"):
        if value < 1000:
            break
        value, unit = value / 1000, name
    return f"{value:.3g} {unit}"


@contextlib.contextmanager
def memory_named(what: str, advice: str = "") -> Iterator[None]:
    """Run the block; an allocator's out-of-memory error inside it becomes :class:`OutOfMemoryError` naming ``what``
    (e.g. ``"solve: x0 of shape (64, 196, 768)"``), the bytes asked for and ``advice``. Other errors pass unchanged."""
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, OutOfMemoryError) or not is_out_of_memory(error):
            raise
        requested = requested_bytes(error)
        asked = f"an allocation of {describe_bytes(requested)} failed" if requested else "an allocation failed"
        if _OVERFLOW in str(error):
            asked = "the sizes asked for more bytes than 64 bits count"
        raise OutOfMemoryError(f"{what}: out of memory ({asked}){'; ' + advice if advice else ''}", requested) from None
