"""Krylov methods for the symmetric operators of the ET's geometry, one Krylov space per sample.

Operators act on batches ``(B, ...)``: every leading index is its own problem (the Riemannian Hessian of each
sample, say), and everything here is matrix-free (``apply(v)`` only). Used by the attractor finder's certificate
(:mod:`et_ode.attractor`) and the stability analysis (:mod:`et_ode.analysis.stability`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Operator = Callable[[Tensor], Tensor]


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample inner product: ``(B, ...) x (B, ...) -> (B,)``."""
    return (a * b).flatten(1).sum(dim=1)


def _expand(v: Tensor, like: Tensor) -> Tensor:
    return v.reshape(-1, *([1] * (like.dim() - 1)))


def lanczos(apply: Operator, v0: Tensor, *, iterations: int, project: Operator | None = None,
            generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Lanczos with full reorthogonalisation, one Krylov space per sample.

    Args:
        apply: the symmetric operator, acting per sample on ``(B, ...)``.
        v0: starting vectors ``(B, ...)``.
        iterations: Krylov dimension (at most the dimension of the space; the iteration stops earlier
            when every sample's space is exhausted).
        project: a projector onto the subspace to work in (applied to every Lanczos vector).
        generator: for the fresh random vectors drawn when a sample's Krylov space closes early.

    Returns ``(ritz_values, residuals)``, each ``(B, m)``, values ascending; ``residuals[b, i]`` bounds
    the distance of ``ritz_values[b, i]`` from an eigenvalue of the operator.
    """
    if not (isinstance(iterations, int) and iterations >= 1):
        raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
    project = project or (lambda v: v)
    tiny = torch.finfo(v0.dtype).eps ** 0.75

    def orthonormalize(w: Tensor, basis: list[Tensor]) -> tuple[Tensor, Tensor]:
        if basis:
            q = torch.stack(basis, dim=1).flatten(2)  # (B, j, size)
            flat = w.flatten(1)[:, :, None]
            for _ in range(2):  # classical Gram-Schmidt, twice
                flat = flat - q.transpose(1, 2) @ (q @ flat)
            w = flat.reshape(w.shape)
        w = project(w)
        norm = _dot(w, w).sqrt()
        return w / _expand(norm.clamp_min(torch.finfo(w.dtype).tiny), w), norm

    v, norm = orthonormalize(project(v0), [])
    if bool((norm == 0).any()):
        raise ValueError("v0 has no component in the subspace of project for some sample")
    basis: list[Tensor] = []
    alphas: list[Tensor] = []
    betas: list[Tensor] = []
    for _ in range(iterations):
        basis.append(v)
        w = project(apply(v))
        alphas.append(_dot(w, v))
        w, beta = orthonormalize(w, basis)
        betas.append(beta)
        closed = beta <= tiny * alphas[-1].abs().clamp_min(1.0)
        if bool(closed.any()):
            fresh, fresh_norm = orthonormalize(torch.randn(v.shape, generator=generator, dtype=v.dtype).to(v.device),
                                               basis)
            if bool((fresh_norm[closed] <= tiny).any()):
                break  # the whole space is spanned
            betas[-1] = torch.where(closed, torch.zeros_like(beta), beta)
            w = torch.where(_expand(closed, w), fresh, w)
        v = w
    m = len(alphas)
    tridiagonal = torch.diag_embed(torch.stack(alphas, dim=1))
    if m > 1:
        off = torch.stack(betas[:-1], dim=1)
        tridiagonal = tridiagonal + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
    values, vectors = torch.linalg.eigh(tridiagonal)
    residuals = (betas[-1][:, None] * vectors[:, -1, :]).abs()
    return values, residuals
