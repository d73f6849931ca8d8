"""Symmetric eigensolvers for operators ``w -> A w`` that act per sample on ``(B, ...)`` tensors.

:func:`extreme_eigenvalues` finds the smallest and largest eigenvalue per sample without forming a matrix (Lanczos
with full reorthogonalisation, :func:`et_ode.linalg.krylov.lanczos`, or :func:`power_iteration`);
:func:`dense_eigenvalues` forms ``Q^T A Q`` on a basis (:func:`operator_matrix`) and returns the whole spectrum. An
optional projector restricts the operator to a subspace (e.g. the tangent space of the per-token spheres).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from et_ode.linalg.krylov import lanczos, per_sample, sample_dot

Operator = Callable[[Tensor], Tensor]


def power_iteration(
    apply: Operator, v0: Tensor, *, iterations: int, shift: Tensor | float = 0.0, project: Operator | None = None
) -> Tensor:
    """The eigenvalue of largest magnitude of ``A - shift I`` per sample, by power iteration (Rayleigh quotient).

    Args:
        apply: the operator ``A``, ``(B, ...) -> (B, ...)``.
        v0: the start vectors ``(B, ...)``.
        iterations: the number of iterations.
        shift: a scalar or ``(B,)``.
        project: the projector onto the space ``A`` acts on, or None.

    Returns:
        The estimate for ``A - shift I``, ``(B,)``.
    """
    project = project or (lambda v: v)
    shift = torch.as_tensor(shift, dtype=v0.dtype, device=v0.device).expand(v0.shape[0])
    v = project(v0)
    v = v / per_sample(sample_dot(v, v).sqrt(), v)
    value = torch.zeros_like(shift)
    for _ in range(iterations):
        w = project(apply(v) - per_sample(shift, v) * v)
        value = sample_dot(w, v)
        v = w / per_sample(sample_dot(w, w).sqrt().clamp_min(torch.finfo(v.dtype).tiny), w)
    return value


def extreme_eigenvalues(
    apply: Operator,
    like: Tensor,
    *,
    method: str = "lanczos",
    iterations: int = 60,
    project: Operator | None = None,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Smallest and largest eigenvalue per sample of a symmetric operator, matrix-free.

    Args:
        apply: ``w -> A w`` on vectors shaped like ``like`` (``(B, ...)``).
        like: a tensor giving shape, dtype and device.
        method: ``"lanczos"`` (``iterations`` Krylov vectors) or ``"power"`` (``iterations`` products for
            the dominant eigenvalue, then as many for the other end of the spectrum on ``A - lambda_dom I``).
        project: projector onto the subspace where ``A`` is considered (e.g. the tangent space).
        seed: seeds the random starting vector.

    Returns ``(smallest, largest, residual)``, each ``(B,)``; ``residual`` is the larger of the two
    Lanczos residual bounds (``nan`` for power iteration).
    """
    generator = torch.Generator().manual_seed(seed)
    v0 = torch.randn(like.shape, generator=generator, dtype=like.dtype).to(like.device)
    if method == "lanczos":
        size = like[0].numel()
        values, residuals = lanczos(apply, v0, iterations=min(iterations, size), project=project, generator=generator)
        return values[:, 0], values[:, -1], torch.maximum(residuals[:, 0], residuals[:, -1])
    if method == "power":
        dominant = power_iteration(apply, v0, iterations=iterations, project=project)
        other = power_iteration(apply, v0, iterations=iterations, shift=dominant, project=project) + dominant
        nan = torch.full_like(dominant, math.nan)
        return torch.minimum(dominant, other), torch.maximum(dominant, other), nan
    raise ValueError(f"method must be 'lanczos' or 'power', got {method!r}")


def operator_matrix(apply: Operator, basis: Tensor) -> Tensor:
    """The matrix ``Q^T A Q`` per sample for an orthonormal ``basis`` ``(B, n, ...)`` (``n`` vectors per sample)."""
    columns = [apply(basis[:, j]) for j in range(basis.shape[1])]
    image = torch.stack(columns, dim=1).flatten(2)  # (B, n, size): row j = A q_j
    return basis.flatten(2) @ image.transpose(1, 2)


def dense_eigenvalues(apply: Operator, like: Tensor, *, basis: Tensor | None = None) -> Tensor:
    """All eigenvalues of a symmetric operator restricted to ``span(basis)``. Costs ``n`` products.

    Args:
        apply: the operator, ``(B, ...) -> (B, ...)``.
        like: a tensor ``(B, ...)`` of the operator's shape, dtype and device.
        basis: an orthonormal basis ``(B, n, ...)``, or None (the standard basis of the shape of ``like[0]``).

    Returns:
        The eigenvalues, ascending, ``(B, n)``.
    """
    if basis is None:
        size = like[0].numel()
        eye = torch.eye(size, dtype=like.dtype, device=like.device).reshape(size, *like.shape[1:])
        basis = eye.expand(like.shape[0], *eye.shape)
    matrix = operator_matrix(apply, basis)
    return torch.linalg.eigvalsh((matrix + matrix.transpose(1, 2)) / 2)
