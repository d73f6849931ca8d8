"""Saving and loading an :class:`EnergyTransformer` with the settings needed to rebuild it.

Files are written atomically (:func:`et_ode.training.statefile.atomic_write`: a temporary file in the same folder, fsync,
then ``os.replace``), so an interrupted save never leaves a truncated model behind. A model file is a
``torch.save`` archive of a dict of tensors, numbers and strings; :func:`load_model` reads it with
``torch.load(weights_only=True)``, PyTorch's data-only unpickler, which refuses any other object (so nothing in
the file can run code; torch >= 2.6).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from et_ode.backend.memory import is_out_of_memory, memory_named
from et_ode.data._files import MAX_EXPANSION, MAX_EXPANSION_BYTES, is_zip
from et_ode.energy.checks import dense_floating
from et_ode.energy.model import EnergyTransformer
from et_ode.models.image import check_model_size
from et_ode.training.statefile import (
    MAX_ARRAY_ELEMENTS,
    FileFormatError,
    atomic_write,
    check_file,
    describe,
    read_tensors,
)

FORMAT = "et-ode/energy-transformer/1"


def model_config(model: EnergyTransformer) -> dict[str, Any]:
    """The constructor arguments that rebuild ``model``'s architecture (JSON-friendly): ``EnergyTransformer(**it)``."""
    a, h, n = model.attention, model.hopfield, model.neuron
    return {
        "dim": model.dim,
        "heads": a.heads,
        "head_dim": a.head_dim,
        "memories": h.memories,
        "hopfield": h.form,
        "beta": a.beta.tolist(),
        "beta_hn": h.beta,
        "self_attention": a.self_attention,
        "eps": n.eps,
        "positive_gamma": n.positive_gamma,
    }


def save_model(model: EnergyTransformer, path: str | os.PathLike[str], **meta: Any) -> Path:
    """Write ``model`` (weights and architecture) and any JSON-like ``meta`` to ``path``.

    Raises:
        TypeError: ``model`` is not an :class:`EnergyTransformer` (e.g. an ``ImageET``: save its ``.block``).
    """
    if not isinstance(model, EnergyTransformer):
        block = getattr(model, "block", None)
        hint = (
            "; save its ET block: save_model(model.block, path) (its tau and solver belong in meta, as `et-ode train` does)"
            if isinstance(block, EnergyTransformer)
            else ""
        )
        raise TypeError(f"model must be an et_ode.EnergyTransformer, got {type(model).__name__}{hint}")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    blob = {"format": FORMAT, "config": model_config(model), "state_dict": state, "meta": meta}
    return atomic_write(path, lambda stream: torch.save(blob, stream))


def load_model(
    path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu"
) -> tuple[EnergyTransformer, dict[str, Any]]:
    """Read a file written by :func:`save_model`: returns the model and its ``meta``.

    Data only: the file is read with ``torch.load(weights_only=True)``, so a file holding code is refused.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a training checkpoint (the message says how to get the model out of it).
        et_ode.training.statefile.FileFormatError (a ValueError): the file is not a regular file or too large, truncated
            or corrupt, holds objects other than data (refused unread), or is not a complete et-ode model file
            (wrong format, missing entries, sizes beyond ``et_ode.models.image.MAX_PARAMETERS``, weights that do
            not fit the settings); naming the file and the entry.
        et_ode.backend.memory.OutOfMemoryError: the model does not fit in memory.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model file at {path.resolve()} (write one with et_ode.training.io.save_model)")
    check_file(path, "model file")
    kind = describe(path)
    if kind.startswith("an et-ode state file"):
        raise ValueError(
            f"{path} is {kind}: a training checkpoint (model, optimizer, RNG states), not a model file. "
            f"Get the model with `model, run = et_ode.tasks.image.load_trained(path)` (image runs; the "
            f"EnergyTransformer is model.block; save it with save_model(model.block, 'et_block.pt')), "
            f"or use the et_block.pt that `et-ode train image` writes beside the checkpoint"
        )
    try:
        with memory_named(f"loading the model file {path}"):
            blob = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises several types for damaged archives and refused objects
        if isinstance(error, MemoryError):
            raise
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise FileFormatError(
            path,
            None,
            f"not a readable model file (truncated or corrupt, or holding objects "
            f"other than tensors and numbers, refused unread by weights_only=True): "
            f"{reason}",
        ) from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise FileFormatError(path, "format", f"not an et-ode model file (expected format {FORMAT!r})")
    missing = [key for key in ("config", "state_dict") if not isinstance(blob.get(key), dict)]
    if missing or not blob["state_dict"]:
        key = (missing or ["state_dict"])[0]
        raise FileFormatError(path, key, f"an incomplete et-ode model file: {missing or ['state_dict']} missing or empty")
    config, state = blob["config"], blob["state_dict"]
    try:
        check_model_size(config.get("dim"), config.get("heads"), config.get("head_dim"), config.get("memories"))
        dtype = next(iter(state.values())).dtype
        if not dtype.is_floating_point:
            raise ValueError(f"the weights are {dtype}, not floating point")
        model = EnergyTransformer(**config).to(dtype)
        model.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError) as error:
        first = " ".join(str(error).split())[:300] or type(error).__name__
        raise FileFormatError(
            path, "config", f"its settings and weights do not make an EnergyTransformer: {first}"
        ) from None
    meta = blob.get("meta", {})
    return model, dict(meta) if isinstance(meta, dict) else {}


MAX_STATE_BYTES = 8 * MAX_ARRAY_ELEMENTS + 2**20  # a states file: MAX_ARRAY_ELEMENTS float64 numbers and a header


def load_states(path: str | os.PathLike[str], dim: int | None = None, *, name: str = "x0") -> Tensor:
    """Token states ``(batch, N, D)`` or ``(N, D)`` saved at ``path``: a ``torch.save`` file of one tensor (read with
    ``torch.load(weights_only=True)``) or a safetensors file of one tensor; data only, so nothing in the file runs.

    Sizes are checked before anything is allocated (the file's, a compressed member's growth, the header's element
    counts); the tensor is then checked: floating point, dense, two or three dimensions with ``D = dim`` (if given),
    not empty, finite.

    Raises:
        FileNotFoundError: no file at ``path``.
        et_ode.training.statefile.FileFormatError (a ValueError): a file that is not a regular file, larger than
            ``MAX_STATE_BYTES``, unreadable, holding objects other than data (refused unread), or not one tensor of
            states as above; the message starts with ``name`` and names the file.
        et_ode.backend.memory.OutOfMemoryError: the states do not fit in memory.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{name}: no file at {path.resolve()} (expected token states (batch, N, D))")
    check_file(path, f"{name} file", MAX_STATE_BYTES)
    with memory_named(f"{name}: loading {path}"):
        states = _read_states(path, name)
    return _checked_states(states, path, dim, name)


def _read_states(path: Path, name: str) -> object:
    """The one object of a safetensors or ``torch.save`` file (a zip whose members may not expand beyond reason)."""
    if describe(path).startswith("a safetensors file"):
        tensors = read_tensors(path, f"{name} file")
        if len(tensors) != 1:
            raise FileFormatError(path, None, f"{name}: {path} holds {len(tensors)} tensors, not one", named=True)
        return next(iter(tensors.values()))
    if is_zip(path):
        _check_members(path, name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for damaged archives and refused objects
        if is_out_of_memory(error):
            raise
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise FileFormatError(
            path,
            None,
            f"{name}: {path} is not a readable torch-saved tensor (truncated or corrupt, or holding objects "
            f"other than tensors, refused unread by weights_only=True): {reason}",
            named=True,
        ) from None


def _check_members(path: Path, name: str) -> None:
    """The members of the zip archive ``path`` (a ``torch.save`` file): readable, none expanding beyond reason."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as error:
        raise FileFormatError(
            path, None, f"{name}: {path} is not a readable torch-saved tensor (a damaged zip archive: {error})", named=True
        ) from None
    for info in members:
        if info.file_size > MAX_EXPANSION_BYTES and info.file_size > MAX_EXPANSION * max(info.compress_size, 1):
            raise FileFormatError(
                path, info.filename, f"{name}: {info.compress_size} compressed bytes expand to {info.file_size}"
            )


def _checked_states(states: object, path: Path, dim: int | None, name: str) -> Tensor:
    """``states`` if it is one dense, finite floating tensor ``(batch, N, D)`` or ``(N, D)`` (``D = dim``), not empty."""

    def refuse(problem: str) -> FileFormatError:
        return FileFormatError(path, None, f"{name}: {path} {problem}", named=True)

    states = dense_floating(states, lambda problem: refuse(f"holds {problem}"))
    shape = tuple(states.shape)
    if states.dim() not in (2, 3) or (dim is not None and shape[-1] != dim) or states.numel() == 0:
        wanted = f"(batch, N, D) or (N, D) with D={dim}" if dim is not None else "(batch, N, D) or (N, D)"
        raise refuse(f"holds states of shape {shape}, not {wanted} with at least one token")
    if states.numel() > MAX_ARRAY_ELEMENTS:
        raise refuse(f"holds {states.numel()} numbers, more than the {MAX_ARRAY_ELEMENTS} et-ode reads")
    if not bool(torch.isfinite(states).all()):
        raise refuse("holds NaN or infinite values")
    return states
