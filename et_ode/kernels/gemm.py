"""Which GEMM back end the fused field uses on this machine: probes of oneDNN, timings, and the answers remembered.

The large products of :mod:`et_ode.kernels.fused` run on ``torch.matmul`` (MKL) or on oneDNN's
``mkldnn._linear_pointwise`` with a pre-packed weight; ``gemm="auto"`` times both once per problem size
(:func:`choose_gemm`). CUDA and float64 use ``torch.matmul``. Whether oneDNN packs a dtype is asked of the library,
never assumed (:func:`supports_onednn`).

The per-head products (thousands of small matrices) have the same two candidates: ATen sends a float32 batched product
to oneDNN's matmul only while reduced precision is allowed for it (:func:`onednn_matmul`), and oneDNN may then round
to bfloat16 where the CPU has bfloat16 matrix hardware. :func:`choose_head_products` therefore keeps oneDNN only
where every entry of the three products is within float32 rounding of a float64 product and, when timed, clearly
faster; the permission is granted around those products alone.

Every answer is remembered for the process in this module's caches, keyed by shape, dtype and device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor

GEMMS = ("auto", "matmul", "onednn")


def onednn_available() -> bool:
    """Whether oneDNN's dense linear with pre-packed weights is available in this PyTorch build."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def onednn_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight^T`` by oneDNN; ``weight`` ``(out, in)`` is dense or pre-packed."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


_ONEDNN_PROBES: dict[torch.dtype, bool] = {}


def supports_onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack and multiply a weight of ``dtype`` on this CPU.

    Asked of the library, not assumed from the dtype: a tiny pack-and-multiply is tried once per dtype and
    the answer remembered. PyTorch's oneDNN refuses bfloat16 packing on CPUs without AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and the answer differs between machines of the same kind; where it refuses, the field
    uses ``torch.matmul`` for that dtype (slower on such hardware, never wrong). float64 is never packed.
    """
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if dtype not in _ONEDNN_PROBES:
        _ONEDNN_PROBES[dtype] = onednn_available() and probe_onednn(dtype)
    return _ONEDNN_PROBES[dtype]


def probe_onednn(dtype: torch.dtype) -> bool:
    """Pack a small weight and multiply by it; False where oneDNN refuses this dtype on this CPU."""
    weight = torch.arange(48, dtype=torch.float32).reshape(6, 8).div_(48).to(dtype)
    x = torch.ones(4, 8, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[0])
        out = onednn_linear(x, packed)
    except (RuntimeError, NotImplementedError):
        return False
    return out.shape == (4, 6) and bool(torch.allclose(out.float(), x.float() @ weight.float().T, rtol=2e-2, atol=2e-2))


_GEMM_CHOICE: dict[tuple[Any, ...], str] = {}


def choose_gemm(m: int, d: int, r: int, dtype: torch.dtype, device: torch.device, reps: int = 7) -> str:
    """The faster of ``"matmul"`` and ``"onednn"`` for ``(m, d) @ (d, r)`` products, timed once (the fastest of
    ``reps`` interleaved runs of the projection and its transpose: on a machine shared with other jobs the minimum
    stays near the unloaded time, a median does not) and remembered for the process."""
    if not supports_onednn(dtype, device):
        return "matmul"
    key = (m, d, r, dtype, str(device))
    if key not in _GEMM_CHOICE:
        local = torch.Generator().manual_seed(0)  # the global random stream stays untouched (reproducible training)
        x, y, w = (torch.randn(*shape, dtype=dtype, generator=local) for shape in ((m, d), (m, r), (r, d)))
        w_t = w.T.contiguous()
        packed, packed_t = (torch.ops.mkldnn._reorder_linear_weight(a, m) for a in (w, w_t))
        candidates: dict[str, Callable[[], Any]] = {
            "matmul": lambda: (x @ w.T, y @ w),
            "onednn": lambda: (onednn_linear(x, packed), onednn_linear(y, packed_t)),
        }
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for rep in range(reps + 2):
            for name, run in candidates.items():
                start = time.perf_counter()
                run()
                if rep >= 2:  # the first two are warm-up
                    times[name].append(time.perf_counter() - start)
        _GEMM_CHOICE[key] = min(times, key=lambda name: min(times[name]))
    return _GEMM_CHOICE[key]


def onednn_matmul_available() -> bool:
    """Whether this PyTorch build can send float32 batched products to oneDNN's matmul (see :func:`onednn_matmul`)."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return torch.backends.mkldnn.is_available() and hasattr(matmul, "fp32_precision")


@contextlib.contextmanager
def onednn_matmul() -> Iterator[None]:
    """Within this block, ATen's float32 ``matmul``/``bmm`` on CPU go to oneDNN's matmul (reduced precision allowed
    for oneDNN alone); the previous setting is restored on exit. Only for products that :func:`choose_head_products`
    found within float32 rounding at their shape. The setting is global: a float32 product of another thread during
    the block gets the same permission."""
    matmul = cast(Any, torch.backends.mkldnn).matmul  # set at import by PyTorch; absent from its type stubs
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def _head_products(keys: Tensor, queries: Tensor, attn: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The three per-head product patterns of the field and its backward: ``K Q^T``, ``S Q`` and ``S^T K`` for
    ``keys``, ``queries`` ``(G, N, Y)`` and ``attn`` ``(G, N, N)``."""
    return (
        torch.matmul(keys, queries.transpose(-1, -2)),
        torch.matmul(attn, queries),
        torch.matmul(attn.transpose(-1, -2), keys),
    )


def _within_float_rounding(got: tuple[Tensor, ...], operands: tuple[tuple[Tensor, Tensor], ...]) -> bool:
    """Whether every entry of each product ``a @ b`` in ``got`` is within ``k eps |a| @ |b|`` of the float64 product
    (``k`` the inner dimension, ``eps`` of ``got``'s dtype): the worst case of float32 summation, far below the
    error of any product that rounds its inputs to bfloat16 or tf32."""
    for product, (a, b) in zip(got, operands, strict=True):
        a64, b64 = a.double(), b.double()
        bound = (a.shape[-1] * torch.finfo(product.dtype).eps) * (a64.abs() @ b64.abs())
        if not bool(((product.double() - a64 @ b64).abs() <= bound).all()):
            return False
    return True


# oneDNN's per-head products are kept only where they take less than this fraction of MKL's: where the two are close,
# a training step costs more with oneDNN's than the three timed products show.
HEAD_MARGIN = 0.8

_HEAD_ACCURATE: dict[tuple[Any, ...], bool] = {}
_HEAD_CHOICE: dict[tuple[Any, ...], str] = {}


def _head_operands(groups: int, n: int, y: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Random keys, queries ``(groups, n, y)`` and attention ``(groups, n, n)`` of a shape, the same on every call
    (the global random stream stays untouched)."""
    local = torch.Generator().manual_seed(0)
    keys, queries = (torch.randn(groups, n, y, dtype=dtype, generator=local) for _ in range(2))
    return keys, queries, torch.softmax(torch.randn(groups, n, n, dtype=dtype, generator=local), dim=-2)


def choose_head_products(
    groups: int, n: int, y: int, dtype: torch.dtype, device: torch.device, *, timed: bool = True, reps: int = 9
) -> str:
    """The back end of the per-head products at this shape (``groups`` = batch x heads matrices of ``n x y``):
    ``"onednn"`` where :func:`onednn_matmul` computes all three patterns within float32 rounding (checked once per
    shape on random data) and, if ``timed``, clearly faster (the fastest of ``reps`` interleaved runs each, below
    :data:`HEAD_MARGIN` of MKL's, timed only when first asked for); else ``"matmul"``.
    Remembered for the process; float32 on CPU only (float64 never leaves MKL)."""
    if device.type != "cpu" or dtype != torch.float32 or not onednn_matmul_available():
        return "matmul"
    key = (groups, n, y, dtype, str(device))
    if key not in _HEAD_ACCURATE:
        keys, queries, attn = _head_operands(groups, n, y, dtype)
        with onednn_matmul():
            got = _head_products(keys, queries, attn)
        operands = ((keys, queries.transpose(-1, -2)), (attn, queries), (attn.transpose(-1, -2), keys))
        _HEAD_ACCURATE[key] = _within_float_rounding(got, operands)
    if not _HEAD_ACCURATE[key]:
        return "matmul"
    if not timed:
        return "onednn"
    if key not in _HEAD_CHOICE:
        keys, queries, attn = _head_operands(groups, n, y, dtype)
        times: dict[str, list[float]] = {"matmul": [], "onednn": []}
        for rep in range(reps + 2):
            for name in times:
                start = time.perf_counter()
                with onednn_matmul() if name == "onednn" else contextlib.nullcontext():
                    _head_products(keys, queries, attn)
                if rep >= 2:  # the first two are warm-up
                    times[name].append(time.perf_counter() - start)
        _HEAD_CHOICE[key] = "onednn" if min(times["onednn"]) < HEAD_MARGIN * min(times["matmul"]) else "matmul"
    return _HEAD_CHOICE[key]
