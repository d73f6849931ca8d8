"""Krylov methods for the symmetric operators of the ET's geometry, one Krylov space per sample.

Operators act on batches ``(B, ...)``: every leading index is its own problem (the Riemannian Hessian of each
sample, say), and everything here is matrix-free (``apply(v)`` only). Used by the attractor finder's certificate
(:mod:`et_ode.equilibrium.attractor`) and the stability analysis (:mod:`et_ode.analysis.stability`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from et_ode.backend.validation import check_positive

Operator = Callable[[Tensor], Tensor]


def sample_dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample inner product: ``(B, ...) x (B, ...) -> (B,)``."""
    return (a * b).flatten(1).sum(dim=1)


def per_sample(v: Tensor, like: Tensor) -> Tensor:
    """``v`` ``(B,)`` shaped to broadcast over ``like`` ``(B, ...)``, one value per sample."""
    return v.reshape(-1, *([1] * (like.dim() - 1)))


def lanczos(
    apply: Operator,
    v0: Tensor,
    *,
    iterations: int,
    project: Operator | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
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
    check_positive("iterations", iterations, integer=True)
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
        norm = sample_dot(w, w).sqrt()
        return w / per_sample(norm.clamp_min(torch.finfo(w.dtype).tiny), w), norm

    v, norm = orthonormalize(project(v0), [])
    if bool((norm == 0).any()):
        raise ValueError("v0 has no component in the subspace of project for some sample")
    basis: list[Tensor] = []
    alphas: list[Tensor] = []
    betas: list[Tensor] = []
    for _ in range(iterations):
        basis.append(v)
        w = project(apply(v))
        alphas.append(sample_dot(w, v))
        w, beta = orthonormalize(w, basis)
        betas.append(beta)
        closed = beta <= tiny * alphas[-1].abs().clamp_min(1.0)
        if bool(closed.any()):
            fresh, fresh_norm = orthonormalize(torch.randn(v.shape, generator=generator, dtype=v.dtype).to(v.device), basis)
            if bool((fresh_norm[closed] <= tiny).any()):
                break  # the whole space is spanned
            betas[-1] = torch.where(closed, torch.zeros_like(beta), beta)
            w = torch.where(per_sample(closed, w), fresh, w)
        v = w
    m = len(alphas)
    tridiagonal = torch.diag_embed(torch.stack(alphas, dim=1))
    if m > 1:
        off = torch.stack(betas[:-1], dim=1)
        tridiagonal = tridiagonal + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
    values, vectors = torch.linalg.eigh(tridiagonal)
    residuals = (betas[-1][:, None] * vectors[:, -1, :]).abs()
    return values, residuals


def token_dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample inner product over tokens and elements: ``(..., N, D) -> (..., 1, 1)``."""
    return (a * b).sum(dim=(-1, -2), keepdim=True)


def conjugate_gradient(apply: Operator, b: Tensor, *, tol: float, max_iter: int) -> tuple[Tensor, int, Tensor]:
    """Solve ``A w = b`` per sample for a symmetric positive definite ``A`` given as ``apply(w)``.

    Shapes: ``b`` is ``(..., N, D)``; every sample (leading index) is its own system and stops on its own, once its
    relative residual is at most ``tol``. In finite precision an operator that is positive definite only up to
    rounding (a Hessian-vector product in float32) lets the residual fall to about the attainable accuracy and then
    grow again (measured at the digits size in float32: 3e-5 after 40 iterations, 0.12 after 200), so every sample
    returns the iterate of smallest residual it reached: the last one when it converged, never a worse one. The
    residual the recurrence carries drifts from the true one in finite precision, so the one returned is computed
    afresh, ``|b - A w| / |b|`` (one more ``apply``).
    Returns the solution, the iterations used and the relative residual of the returned iterate per sample ``(...)``.
    """
    w = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rr = token_dot(r, r)
    b_norm = rr.sqrt().clamp_min(torch.finfo(b.dtype).tiny)
    best_w, best_rr = w, rr
    running = torch.ones_like(rr, dtype=torch.bool)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        running = running & (rr.sqrt() > tol * b_norm)
        if not bool(running.any()):
            iterations -= 1
            break
        ap = apply(p)
        p_ap = token_dot(p, ap)
        alpha = torch.where(running & (p_ap != 0), rr / p_ap, torch.zeros_like(rr))
        w = w + alpha * p
        r = r - alpha * ap
        rr_new = token_dot(r, r)
        better = running & (rr_new < best_rr)
        best_w, best_rr = torch.where(better, w, best_w), torch.where(better, rr_new, best_rr)
        p = r + torch.where(running & (rr != 0), rr_new / rr, torch.zeros_like(rr)) * p
        rr = torch.where(running, rr_new, rr)
    if iterations:
        r = b - apply(best_w)
        best_rr = token_dot(r, r)
    return best_w, iterations, (best_rr.sqrt() / b_norm).reshape(b.shape[:-2])
