"""Input validation shared by the public entry points. Every error names the argument."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from et_ode.energy.masks import GraphMask, Mask


def value_range(x: Tensor) -> tuple[float, float]:
    """The smallest and largest entries of a non-empty ``x`` in one ``aminmax`` pass (NaN in both if any is NaN, an
    infinity in one if any is infinite: the finiteness check of every step, one pass that writes no mask, unlike
    ``isfinite(x).all()``)."""
    low, high = torch.aminmax(x.detach())
    return float(low), float(high)


def dense_floating(x: object, refuse: Callable[[str], Exception]) -> Tensor:
    """``x`` if it is a dense floating-point tensor, else the exception ``refuse(problem)`` raised, ``problem`` saying
    what ``x`` is instead: ``"a dict, not a tensor"``, ``"a torch.sparse_coo tensor, not a dense one"`` or
    ``"torch.int64 values, not floating point"``."""
    if not isinstance(x, Tensor):
        raise refuse(f"a {type(x).__name__}, not a tensor")
    if x.layout != torch.strided:
        raise refuse(f"a {x.layout} tensor, not a dense one")
    if not x.is_floating_point():
        raise refuse(f"{x.dtype} values, not floating point")
    return x


def check_tokens(name: str, x: object, dim: int, like: Tensor | None = None, normalisable: bool = False) -> Tensor:
    """``x`` must be a dense, finite floating tensor of shape ``(..., N, dim)`` with ``N >= 1``; with ``like`` (a model
    parameter), of its dtype (TypeError) and on its device (ValueError); with ``normalisable``, also one whose
    LayerNorm is computable in its dtype (:func:`check_normalisable`, from the same pass over ``x``)."""
    x = dense_floating(
        x, lambda problem: TypeError(f"{name} must be a dense floating tensor of shape (..., N, {dim}), got {problem}")
    )
    if x.dim() < 2 or x.shape[-1] != dim:
        raise ValueError(f"{name} must have shape (..., N, D) with D={dim}, got shape {tuple(x.shape)}")
    if x.shape[-2] == 0:
        raise ValueError(f"{name} has no tokens: N=0 in shape {tuple(x.shape)} (..., N, D); give at least one token")
    if like is not None and x.dtype != like.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but the model's parameters are {like.dtype}: convert one, e.g. "
            f"{name}.to({like.dtype}) or model.to({x.dtype})"
        )
    if like is not None and x.device != like.device:
        raise ValueError(
            f"{name} is on {x.device} but the model is on {like.device}: move one, e.g. {name}.to('{like.device}')"
        )
    low, high = value_range(x) if x.numel() else (0.0, 0.0)
    if not (math.isfinite(low) and math.isfinite(high)):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} has {bad} non-finite entries (NaN or inf); shape {tuple(x.shape)}")
    if normalisable:
        check_normalisable(name, x, (low, high))
    return x


def check_mask(mask: object, x: Tensor) -> Mask:
    """``mask`` must be ``None``, a boolean ``(N, N)`` / ``(*batch, N, N)`` tensor broadcastable to ``x``, or a
    :class:`GraphMask` (edge list, validated on construction: long ``(2, E)``, indices in range) of ``N`` nodes
    on the device of ``x``."""
    if mask is None:
        return None
    n = x.shape[-2]
    batch = tuple(x.shape[:-2])
    if isinstance(mask, GraphMask):
        if mask.num_nodes != n:
            raise ValueError(
                f"mask is a GraphMask of num_nodes={mask.num_nodes}, but the tokens have N={n} (shape {tuple(x.shape)})"
            )
        if mask.device != x.device:
            raise ValueError(f"mask (GraphMask) is on {mask.device} but the tokens are on {x.device}; use mask.to(device)")
        return mask
    if (
        isinstance(mask, Tensor)
        and not mask.is_floating_point()
        and mask.dtype != torch.bool
        and mask.dim() == 2
        and mask.shape[0] == 2
    ):
        raise TypeError(
            f"mask is an integer tensor of shape {tuple(mask.shape)}; an edge list must be wrapped: "
            "mask=GraphMask(edge_index, num_nodes)"
        )
    if not isinstance(mask, Tensor):
        raise TypeError(
            "mask must be a boolean torch.Tensor of shape (N, N) or (*batch, N, N), or an "
            f"et_ode.GraphMask (et_ode.energy.masks), got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool (True where query C may attend to key B), got {mask.dtype}")
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (n, n):
        raise ValueError(f"mask must have shape (N, N) or (*batch, N, N) with N={n}, got shape {tuple(mask.shape)}")
    try:
        broadcast = torch.broadcast_shapes(tuple(mask.shape[:-2]), batch)
    except RuntimeError:
        broadcast = None
    if broadcast != batch:  # e.g. a (2, N, N) mask with one sample: it would make two
        raise ValueError(f"mask batch shape {tuple(mask.shape[:-2])} does not broadcast to the tokens' batch shape {batch}")
    if len(mask.shape) - 2 > len(batch):
        raise ValueError(f"mask has more batch dimensions than the tokens: mask {tuple(mask.shape)}, x {tuple(x.shape)}")
    return mask


def check_normalisable(name: str, x: Tensor, bounds: tuple[float, float] | None = None) -> Tensor:
    """The LayerNorm of every token of ``x`` must be computable in ``x``'s dtype: its variance must not overflow
    (float32 squares overflow past ~1.8e19). ValueError naming the first bad token and the remedy. ``bounds``:
    ``x``'s smallest and largest entries where already known."""
    if x.numel() == 0:
        return x
    low, high = bounds if bounds is not None else value_range(x)
    if max(-low, high) <= math.sqrt(torch.finfo(x.dtype).max / (4 * x.shape[-1])) / 2:
        return x  # below this bound no centred square, sum or mean can overflow
    with torch.no_grad():
        spread = (x - x.mean(dim=-1, keepdim=True)).square().mean(dim=-1)
    bad = ~torch.isfinite(spread)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        largest = float(x.detach().abs().max())
        raise ValueError(
            f"{name} is too large for {x.dtype}: the LayerNorm variance of token {where} (index "
            f"(*batch, N)) overflows (|{name}| up to {largest:.3g}; {x.dtype} holds squares up to "
            f"{torch.finfo(x.dtype).max:.3g}); rescale {name} or use float64 ({name}.double() and "
            f"model.double())"
        )
    return x
