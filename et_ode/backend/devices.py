"""Where and how a run computes: the device (:func:`resolve_device`, :func:`move_to`), the seeds
(:func:`seed_everything`) and this process's rank (:func:`rank` and :func:`world_size`: 0 and 1 outside a process
group, which :mod:`et_ode.training.distributed` opens). A leaf: imports only torch and NumPy.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; checks that a requested CUDA device exists (ValueError naming
    it otherwise; TypeError for a value that is not a device's name)."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a string ('auto', 'cpu', 'cuda', 'cuda:i'), got {type(device).__name__}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:i', got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available on this machine")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} was requested but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (recursing into tuples, lists, dicts; objects with ``.to``)."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


def _process_group() -> Any | None:
    """``torch.distributed`` when a process group is open, else None. A group needs the module imported first, so
    an unimported module means none (importing it just to ask costs seconds)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    """This process's rank (0 outside a process group)."""
    group = _process_group()
    return group.get_rank() if group is not None else 0


def world_size() -> int:
    """Number of processes (1 outside a process group)."""
    group = _process_group()
    return group.get_world_size() if group is not None else 1
