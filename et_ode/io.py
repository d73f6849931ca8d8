"""Saving and loading an :class:`EnergyTransformer` with the settings needed to rebuild it.

Files are written atomically (a temporary file in the same folder, then ``os.replace``), so an
interrupted save never leaves a truncated model behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .model import EnergyTransformer

FORMAT = "et-ode/energy-transformer/1"


def model_config(model: EnergyTransformer) -> dict[str, Any]:
    """The constructor arguments that rebuild ``model``'s architecture."""
    a, h, n = model.attention, model.hopfield, model.neuron
    return {"dim": model.dim, "heads": a.heads, "head_dim": a.head_dim, "memories": h.memories, "hopfield": h.form,
            "beta": a.beta.tolist(), "beta_hn": h.beta, "self_attention": a.self_attention, "eps": n.eps,
            "positive_gamma": n.positive_gamma}


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(obj, stream)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def save_model(model: EnergyTransformer, path: str | os.PathLike[str], **meta: Any) -> Path:
    """Write ``model`` (weights and architecture) and any JSON-like ``meta`` to ``path``."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return atomic_save({"format": FORMAT, "config": model_config(model), "state_dict": state, "meta": meta}, path)


def load_model(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu"
               ) -> tuple[EnergyTransformer, dict[str, Any]]:
    """Read a file written by :func:`save_model`: returns the model and its ``meta``.

    Raises FileNotFoundError for a missing file and ValueError for one that is truncated, corrupt
    or not an et-ode model file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path.resolve()} (write one with et_ode.io.save_model)")
    try:
        blob = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises several types for damaged archives
        raise ValueError(f"{path} is not a readable model file (truncated or corrupt?): {error}") from error
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError(f"{path} is not an et-ode model file (expected format {FORMAT!r})")
    model = EnergyTransformer(**blob["config"])
    state = blob["state_dict"]
    dtype = next(iter(state.values())).dtype
    model = model.to(dtype)
    model.load_state_dict(state)
    return model, dict(blob.get("meta", {}))
