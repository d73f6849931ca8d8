"""The ET's ``dE/dg`` as two large matrix products, with a closed-form backward (a Hessian-vector product).

All three linear maps of ``g`` (keys, queries, memory overlaps) are one product with the stacked weight
``W = [WK; WQ; xi]`` of shape ``(R, D)``, ``R = 2 H Y + K``, and their transposes are one product back:

    P = g W^T = [K | Q | h]                                    (M, R),  M = batch * N tokens
    c = [S Q | S^T K | phi(h)]     (S: softmax over keys of beta K Q^T, per head; phi: the Hopfield form)
    dE/dg = -c W                                               (M, D)

where ``phi`` is ``relu(h)``, ``softplus(s h)/s * sigmoid(s h)`` or ``softmax(beta h)``. The rest (per-head score
products ``N x N x Y``, softmax, the rectifier) is small next to these two products at the paper's sizes. ``S`` is
indexed key-major, ``S[h, B, C]``, the softmax over axis -2; from :data:`QUERY_MAJOR_FROM` tokens on it is stored
query-major, a transposed view of ``Q K^T``, so the softmax runs along contiguous rows (:func:`_key_softmax`).

Backward. For a cotangent ``u`` of ``dE/dg`` (shape ``(M, D)``), ``L = <u, dE/dg> = -<U, c>`` with
``U = u W^T = [uK | uQ | uh]``, and ``R_ = -dL/dP`` has the blocks

    Pm = uK Q^T + K uQ^T                 Z = beta S * (Pm - colsum_B(S * Pm))       (per head, N x N)
    R_K = S uQ + Z Q                     R_Q = S^T uK + Z^T K                       R_h = phi'(h) [uh]
    dL/dg = -R_ W                        dL/dW = -(c^T u + R_^T g)

(``phi'(h)[uh]`` is ``1[h>0] uh`` for relu, ``(sigma^2 + softplus(s h) sigma (1 - sigma)) uh`` for softplus
and ``beta p (uh - p.uh)`` for softmax.) ``dL/dg`` is the Hessian of ``E`` applied to ``u``: a VJP of the field
costs two more large products for ``g`` and two for the weights (on :mod:`et_ode.kernels.gemm`'s back end).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from et_ode.energy.energies import EnergyAttention, HopfieldMemory, softplus
from et_ode.energy.masks import is_dense, key_query
from et_ode.energy.model import EnergyTransformer
from et_ode.kernels import gemm as backends

_NO_BLOCK = contextlib.nullcontext()  # reusable


# From this many tokens the scores are stored query-major (see the module's docstring): below it, the softmax over a
# non-last axis of key-major storage vectorizes across the queries and is the faster one; from it on, the softmax
# along the contiguous query-major rows is.
QUERY_MAJOR_FROM = 32


def _scores(a: Tensor, b: Tensor, query_major: bool) -> Tensor:
    """``a b^T`` per head, ``(..., N, Y), (..., N, Y) -> (..., N, N)`` indexed ``[B, C]`` (``a``'s tokens first):
    contiguous, or with ``query_major`` a transposed view of the contiguous ``b a^T``."""
    if query_major:
        return torch.matmul(b, a.transpose(-1, -2)).transpose(-1, -2)
    return torch.matmul(a, b.transpose(-1, -2))


# The row sum below which the shifted softmax of _key_softmax declines: at or above it a row's largest term exceeds
# tiny ** 0.5 / N, so every term that counts at the dtype's precision is a normal number. (PyTorch's CPU exp2 is
# faster than its exp, which its softmax uses.)
_SAFE_ROW_SUM = {dtype: torch.finfo(dtype).tiny ** 0.5 for dtype in (torch.float32, torch.float64)}


def _key_softmax(scores: Tensor, beta: float | Tensor, query_major: bool, shifted: bool = True) -> Tensor | None:
    """``S = softmax over keys of beta * scores`` per head, for ``scores`` laid out as :func:`_scores` (``(..., B, C)``,
    the keys on axis -2; -inf for excluded pairs) and ``beta`` a float or ``(H, 1, 1)``. Overwrites ``scores``.

    With ``shifted`` (on CPU, where PyTorch's softmax is bound by its slow ``exp``; query-major storage; a float
    ``beta``; float32 or float64): one shift per head's block, its largest score (a fast reduction, where per-row
    maxima over short rows are not), then ``2 ** (beta log2(e) (scores - shift))``, each row divided by its sum. The
    shift changes no ratio within a row; its argument's rounding, ``eps |beta (scores - shift)|``, is below the score
    product's own (``eps Y |K| |Q|``). It can only underflow a row whose largest score lies far below its block's:
    that shows in the row's sum, and None is returned (the scores are spent; compute them again for the exact
    softmax).
    """
    safe = _SAFE_ROW_SUM.get(scores.dtype)
    if shifted and query_major and isinstance(beta, float) and safe is not None and scores.device.type == "cpu":
        rows = scores.transpose(-1, -2)  # [C, B], contiguous along the keys
        rate = beta / math.log(2)
        shift = rows.amax(dim=(-1, -2), keepdim=True).mul_(-rate)
        weights = torch.add(shift, rows, alpha=rate, out=rows).exp2_()  # one pass for the argument, one for exp2
        sums = weights.sum(dim=-1, keepdim=True)
        if not bool(sums.amin() >= safe):  # NaN fails too: the exact softmax then propagates it, as it always did
            return None
        return weights.div_(sums).transpose(-1, -2)
    if query_major:  # the softmax along the stored rows
        return torch.softmax(scores.transpose(-1, -2).mul_(beta), dim=-1).transpose(-1, -2)
    return torch.softmax(scores.mul_(beta), dim=-2)  # contiguous along the queries: vectorised across them


def _version_key(*tensors: Tensor) -> tuple[Any, ...]:
    return tuple((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in tensors)


def _same_objects(refs: tuple[weakref.ref, ...], tensors: tuple[Tensor, ...]) -> bool:
    """Whether ``tensors`` are the very objects behind ``refs`` (a new tensor at a freed one's address is not)."""
    return len(refs) == len(tensors) and all(ref() is t for ref, t in zip(refs, tensors, strict=True))


class FusedGrad:
    """``dE/dg`` of an :class:`EnergyTransformer` by the fused closed form, differentiable by a closed-form
    backward.

    Args:
        model: the energy (read, never modified; its weights may change between calls, e.g. by an optimizer:
            the stacked and packed copies are rebuilt when a parameter's version changes).
        gemm: ``"auto"`` (time the back ends once per size), ``"matmul"`` or ``"onednn"``.

    ``supports(g, mask)`` says whether this path applies (masks: ``None`` or a dense boolean tensor; the
    model's modules of the exact core types); ``__call__(g, mask)`` maps ``(..., N, D) -> (..., N, D)``.
    The backward is first-order only (``once_differentiable``).
    """

    def __init__(self, model: EnergyTransformer, gemm: str = "auto"):
        if gemm not in backends.GEMMS:
            raise ValueError(f"gemm must be one of {backends.GEMMS}, got {gemm!r}")
        self.model = model
        self.gemm = gemm
        self._cache_key: tuple[Any, ...] | None = None
        self._cache_refs: tuple[weakref.ref, ...] = ()
        self._weights: Tensor | None = None
        self._packed: dict[str, Tensor] = {}
        self._beta_h: Tensor | None = None
        self._beta_scalar: float | None = None
        self._head_choices: dict[tuple[Any, ...], str] = {}  # choose_head_products' answers, looked up fast

    # -- applicability --------------------------------------------------------------------------
    def supports(self, g: Tensor, mask: object) -> bool:
        model = self.model
        if type(model.attention) is not EnergyAttention or type(model.hopfield) is not HopfieldMemory:
            return False
        if mask is not None and not is_dense(mask):
            return False
        weight = model.attention.WK
        return g.dtype == weight.dtype and g.device == weight.device and g.dim() >= 2 and g.numel() > 0

    # -- weights --------------------------------------------------------------------------------
    def _stacked(self) -> Tensor:
        """``[WK; WQ; xi]`` as ``(R, D)``, detached, rebuilt only when a parameter (or beta) changed."""
        attention, hopfield = self.model.attention, self.model.hopfield
        tensors = (attention.WK, attention.WQ, hopfield.xi, attention.beta)
        key = _version_key(*tensors)
        if key != self._cache_key or self._weights is None or not _same_objects(self._cache_refs, tensors):
            d = attention.dim
            with torch.no_grad():
                self._weights = torch.cat([attention.WK.reshape(-1, d), attention.WQ.reshape(-1, d), hopfield.xi])
            beta = attention.beta.to(self._weights.dtype)
            self._beta_h = beta[:, None, None]
            self._beta_scalar = float(beta[0]) if bool((beta == beta[0]).all()) else None
            self._packed = {}
            self._cache_key = key
            self._cache_refs = tuple(weakref.ref(t) for t in tensors)
        return self._weights

    def _backend(self, m: int, weights: Tensor) -> str:
        if self.gemm == "auto":  # timed once per power-of-two bucket of the row count
            bucket = 1 << max(m - 1, 1).bit_length()
            return backends.choose_gemm(bucket, weights.shape[1], weights.shape[0], weights.dtype, weights.device)
        if self.gemm == "onednn" and not backends.supports_onednn(weights.dtype, weights.device):
            return "matmul"
        return self.gemm

    def _head_product_block(self, groups: int, n: int, like: Tensor) -> contextlib.AbstractContextManager[None]:
        """The block in which the per-head products run: :func:`~et_ode.kernels.gemm.onednn_matmul` where
        :func:`~et_ode.kernels.gemm.choose_head_products` picks oneDNN for ``groups`` matrices of ``n`` tokens (dtype
        and device of ``like``), else a no-op."""
        key = (groups, n, self.gemm, like.dtype, like.device)
        choice = self._head_choices.get(key)
        if choice is None:
            head_dim = self.model.attention.head_dim
            timed = self.gemm == "auto"
            choice = self._head_choices[key] = (
                "matmul"
                if self.gemm == "matmul"
                else backends.choose_head_products(groups, n, head_dim, like.dtype, like.device, timed=timed)
            )
        return backends.onednn_matmul() if choice == "onednn" else _NO_BLOCK

    def _project(self, x: Tensor, weights: Tensor, backend: str) -> Tensor:
        """``x @ W^T``: ``(M, D) -> (M, R)``."""
        if backend == "matmul":
            return x @ weights.T
        packed = self._packed.get("forward")  # packed for the first row count seen; valid for any
        if packed is None:
            packed = self._packed["forward"] = torch.ops.mkldnn._reorder_linear_weight(weights, x.shape[0])
        return backends.onednn_linear(x, packed)

    def _back_project(
        self, y: Tensor, weights: Tensor, backend: str, negate: bool = True, out: Tensor | None = None
    ) -> Tensor:
        """``-y @ W`` (``y @ W`` with ``negate=False``): ``(M, R) -> (M, D)``, the sign folded into a cached copy of
        ``-W`` (a product with ``-W`` is the exact negative of one with ``W``); written into ``out`` (contiguous
        ``(M, D)``, no gradients) where given, by the product itself on ``torch.matmul``."""
        sign = "minus" if negate else "plus"
        if weights is not self._weights:  # stale weights saved by a forward pass (see _backward)
            result = y @ weights
            result = result.neg_() if negate else result
        elif backend == "matmul":
            signed = self._packed.get(f"back_matmul_{sign}")
            if signed is None:
                signed = self._packed[f"back_matmul_{sign}"] = -weights if negate else weights
            return y @ signed if out is None else torch.mm(y, signed, out=out)
        else:
            packed = self._packed.get(f"back_{sign}")
            if packed is None:
                signed_t = (-weights.T if negate else weights.T).contiguous()
                packed = self._packed[f"back_{sign}"] = torch.ops.mkldnn._reorder_linear_weight(signed_t, y.shape[0])
            result = backends.onednn_linear(y, packed)  # (oneDNN's linear takes no out)
        return result if out is None else out.copy_(result)

    # -- the computation ------------------------------------------------------------------------
    def _allowed(self, mask: Tensor | None, batch: tuple[int, ...], n: int) -> Tensor | None:
        """Allowed (key B, query C) pairs as ``(Bt or 1, 1, B, C)``, or None (all pairs, diagonal handled apart)."""
        if mask is None:
            return None
        if mask.dim() > 2:
            mask = mask.expand(*batch, n, n).reshape(-1, n, n)
        return key_query(mask.reshape(-1, 1, n, n))

    def _phi(self, h: Tensor, out: Tensor) -> None:
        """The Hopfield coefficient ``phi(h)`` written into ``out`` (same shape)."""
        hopfield = self.model.hopfield
        if hopfield.form == "relu" and out is h:
            h.clamp_min_(0.0)  # in place: twice as fast as out= on this strided slice
        elif hopfield.form == "relu":
            torch.clamp_min(h, 0.0, out=out)
        elif hopfield.form == "softplus":
            sh = h * hopfield.beta
            out.copy_(softplus(sh).div_(hopfield.beta).mul_(torch.sigmoid(sh)))
        else:
            out.copy_(torch.softmax(h * hopfield.beta, dim=-1))

    def _masked(self, scores: Tensor, mask: Tensor | None, batch: tuple[int, ...]) -> Tensor | None:
        """Writes -inf into ``scores`` ``(Bt, H, N, N)`` (laid out as :func:`_scores`) where a pair is excluded, and 0
        into the column of a query without any key; returns those queries' indicator ``(Bt or 1, 1, 1, N)``, or
        None if every query has a key. (-inf and 0 are left as they are by any positive beta.)"""
        attention = self.model.attention
        n = scores.shape[-1]
        if not attention.self_attention:
            scores.diagonal(dim1=-2, dim2=-1).fill_(-math.inf)
        allowed = self._allowed(mask, batch, n)
        has_key = None
        if allowed is not None:
            scores.masked_fill_(~allowed, -math.inf)
            if not attention.self_attention:
                allowed = allowed & ~torch.eye(n, dtype=torch.bool, device=scores.device)
            has_key = allowed.any(dim=-2, keepdim=True)  # (Bt or 1, 1, 1, C)
        elif not attention.self_attention and n == 1:
            has_key = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=scores.device)
        if has_key is not None:
            scores.masked_fill_(~has_key, 0.0)
        return has_key

    def _attention(self, keys: Tensor, queries: Tensor, mask: Tensor | None, batch: tuple[int, ...]) -> Tensor:
        """``S``: per head, the softmax over keys ``B`` of ``beta_h K_B . Q_C`` with the masks, indexed ``[B, C]``
        and laid out as :func:`_scores`: ``keys``, ``queries`` ``(Bt, H, N, Y) -> (Bt, H, N, N)``."""
        n = keys.shape[-2]
        query_major = n >= QUERY_MAJOR_FROM
        beta = self._beta_scalar if self._beta_scalar is not None else self._beta_h
        assert beta is not None  # set by self._stacked()
        attn = None
        for shifted in (True, False):  # the exact softmax, from the scores again, only where the shifted one fails
            with self._head_product_block(keys.shape[0] * keys.shape[1], n, keys):
                scores = _scores(keys, queries, query_major)
            has_key = self._masked(scores, mask, batch)
            attn = _key_softmax(scores, beta, query_major, shifted)
            if attn is not None:
                break
        assert attn is not None  # the exact softmax always answers
        if has_key is not None:
            attn.mul_(has_key)
        return attn

    def _forward(
        self, g: Tensor, mask: Tensor | None, keep: bool, negate: bool = True, out: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        attention = self.model.attention
        heads, head_dim, dim = attention.heads, attention.head_dim, attention.dim
        hy = heads * head_dim
        batch, n = tuple(g.shape[:-2]), g.shape[-2]
        g2 = g.reshape(-1, dim)
        if not g2.is_contiguous():
            g2 = g2.contiguous()
        m = g2.shape[0]
        bt = m // n
        weights = self._stacked()
        backend = self._backend(m, weights)
        p = self._project(g2, weights, backend)  # (M, R): [K | Q | h]
        r = p.shape[1]
        p3 = p.view(bt, n, r)
        coefficient = torch.empty_like(p) if keep else p  # reuse P's memory when nothing is saved
        # phi(h) while the product's output is still in cache: after the per-head work it cost twice as much (28x28)
        h = p[:, 2 * hy :]
        self._phi(h, h if coefficient is p else coefficient[:, 2 * hy :])
        keys = p3[..., :hy].view(bt, n, heads, head_dim).transpose(1, 2).contiguous()  # (Bt, H, N, Y)
        queries = p3[..., hy : 2 * hy].view(bt, n, heads, head_dim).transpose(1, 2).contiguous()
        attn = self._attention(keys, queries, mask, batch)
        beta_h = self._beta_h
        with self._head_product_block(bt * heads, n, g2):
            d_keys = torch.matmul(attn, queries)  # (Bt, H, N, Y): sum_C S[B, C] Q[C]
            d_queries = torch.matmul(attn.transpose(-1, -2), keys)  # sum_B S[B, C] K[B]
        c3 = coefficient.view(bt, n, r)
        c3[..., :hy].view(bt, n, heads, head_dim).copy_(d_keys.transpose(1, 2))
        c3[..., hy : 2 * hy].view(bt, n, heads, head_dim).copy_(d_queries.transpose(1, 2))
        into = None if out is None else out.view(m, dim)
        result = self._back_project(coefficient, weights, backend, negate, into).view(*batch, n, dim)
        saved = (g2, keys, queries, attn, p, coefficient, beta_h, weights) if keep else ()
        return result, saved

    def _backward(self, u: Tensor, saved: tuple[Any, ...], need_g: bool, need_w: bool) -> tuple[Tensor | None, ...]:
        g2, keys, queries, attn, p, coefficient, beta_h, weights = saved
        attention, hopfield = self.model.attention, self.model.hopfield
        heads, head_dim, dim = attention.heads, attention.head_dim, attention.dim
        hy = heads * head_dim
        m, r = p.shape
        n = attn.shape[-1]
        bt = m // n
        u2 = u.reshape(m, dim)
        if not u2.is_contiguous():
            u2 = u2.contiguous()
        # the weights of the forward pass; weights changed in place since then make the packed copies stale
        backend = self._backend(m, weights) if weights is self._stacked() else "matmul"

        def per_head(t: Tensor, lo: int, hi: int) -> Tensor:
            return t.view(bt, n, r)[..., lo:hi].view(bt, n, heads, head_dim).transpose(1, 2)

        big_u = self._project(u2, weights, backend)  # [uK | uQ | uh], becomes dL/dP in place
        u_keys, u_queries = per_head(big_u, 0, hy).contiguous(), per_head(big_u, hy, 2 * hy).contiguous()
        query_major = n >= QUERY_MAJOR_FROM
        with self._head_product_block(bt * heads, n, g2):
            pm = _scores(keys, u_queries, query_major)  # [B, C], stored like attn
            pm.add_(_scores(u_keys, queries, query_major))
        pm.mul_(attn)
        z = pm.addcmul_(attn, pm.sum(dim=-2, keepdim=True), value=-1.0).mul_(beta_h)  # Z[B, C]
        with self._head_product_block(bt * heads, n, g2):
            r_keys = torch.matmul(attn, u_queries).add_(torch.matmul(z, queries))
            r_queries = torch.matmul(attn.transpose(-1, -2), u_keys).add_(torch.matmul(z.transpose(-1, -2), keys))
        per_head(big_u, 0, hy).copy_(r_keys)
        per_head(big_u, hy, 2 * hy).copy_(r_queries)
        uh = big_u[:, 2 * hy :]
        h = p[:, 2 * hy :]
        if hopfield.form == "relu":
            uh.mul_(h > 0)
        elif hopfield.form == "softplus":
            s = hopfield.beta
            sig = torch.sigmoid(h * s)
            uh.mul_(softplus(h * s).mul_(1 - sig).add_(sig).mul_(sig))
        else:
            prob = coefficient[:, 2 * hy :]
            uh.sub_((prob * uh).sum(dim=-1, keepdim=True)).mul_(prob).mul_(hopfield.beta)
        grad_g = self._back_project(big_u, weights, backend) if need_g else None
        grad_w = None
        if need_w:
            if backend == "onednn":
                grad_w = backends.onednn_linear(coefficient.T, u2.T).add_(backends.onednn_linear(big_u.T, g2.T)).neg_()
            else:
                grad_w = torch.addmm(coefficient.T @ u2, big_u.T, g2).neg_()
        return grad_g, grad_w

    def __call__(self, g: Tensor, mask: Tensor | None = None, *, negate: bool = False, out: Tensor | None = None) -> Tensor:
        """``dE/dg`` (``-dE/dg`` with ``negate=True``, at no extra cost without gradients): ``(..., N, D) ->
        (..., N, D)``; differentiable w.r.t. ``g``, ``WK``, ``WQ`` and ``xi``. ``out``: a contiguous tensor of
        ``g``'s shape to write the result into and return, without gradients (None: a new tensor)."""
        attention, hopfield = self.model.attention, self.model.hopfield
        params = (attention.WK, attention.WQ, hopfield.xi)
        if torch.is_grad_enabled() and (g.requires_grad or any(p.requires_grad for p in params)):
            if out is not None:
                raise ValueError("out is for evaluations without gradients")
            # views give the weights graph nodes whose use the backward can query (see _weights_needed)
            result = _FusedGradFunction.apply(g, mask, self, *(p.view_as(p) for p in params))
            return -result if negate else result
        result, _ = self._forward(g, mask, keep=False, negate=not negate, out=out)
        return result if out is None else out


def _weights_needed(ctx: Any) -> bool:
    """Whether this backward pass needs the weight gradients: not for ``autograd.grad(out, g)`` alone (a
    Hessian-vector product), which then costs two large products instead of four."""
    if not any(ctx.needs_input_grad[3:]):
        return False
    try:
        return any(node is not None and torch._C._will_engine_execute_node(node) for node, _ in ctx.next_functions[3:])
    except (AttributeError, RuntimeError):  # API missing in this PyTorch, or a leaf node: assume needed
        return True


class _FusedGradFunction(torch.autograd.Function):
    """``dE/dg`` with the closed-form backward of :class:`FusedGrad` (inputs: g, mask, fused, WK, WQ, xi)."""

    @staticmethod
    def forward(ctx: Any, g: Tensor, mask: Tensor | None, fused: FusedGrad, wk: Tensor, wq: Tensor, xi: Tensor) -> Tensor:
        out, saved = fused._forward(g, mask, keep=True)
        ctx.fused = fused
        ctx.saved_rest = saved[4:]
        ctx.g_shape = g.shape
        ctx.save_for_backward(*saved[:4])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, u: Tensor) -> tuple[Tensor | None, ...]:
        need_g = ctx.needs_input_grad[0]
        need_w = _weights_needed(ctx)
        saved = (*ctx.saved_tensors, *ctx.saved_rest)
        grad_g, grad_w = ctx.fused._backward(u, saved, need_g, need_w)
        if grad_g is not None:
            grad_g = grad_g.view(ctx.g_shape)
        grads_w: list[Tensor | None] = [None, None, None]
        if grad_w is not None:
            attention = ctx.fused.model.attention
            hy = attention.heads * attention.head_dim
            shape = attention.WK.shape
            grads_w = [grad_w[:hy].view(shape), grad_w[hy : 2 * hy].view(shape), grad_w[2 * hy :]]
        needs = ctx.needs_input_grad[3:]
        return (grad_g, None, None, *(gw if need else None for gw, need in zip(grads_w, needs, strict=True)))
