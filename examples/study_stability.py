"""Study the attractors of an Energy Transformer: where trajectories go, and how stable the end points are.

    .venv/bin/python examples/study_stability.py --out runs/stability [--seed 0] [--samples 4]

1. Solve a random model from a few random states and check that the energy is a Lyapunov function.
2. Descend from each final state to the nearby critical point on the spheres and classify it from the
   Riemannian Hessian, exactly (dense) and matrix-free (Lanczos), and compare the two.
3. A hand-made one-token model whose critical points are known: a minimum, a saddle and a maximum.
4. Finite-time Lyapunov exponents and a basin probe at the minimum and at the saddle.
Pictures go to ``--out``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from et_ode import EnergyTransformer, ETField, solve
from et_ode.analysis import (
    Benettin,
    analyze_convergence,
    basin_probe,
    check_lyapunov,
    find_fixed_point,
    fixed_point_stability,
    lyapunov_exponent,
    plot_convergence,
    plot_energy_slice,
    random_model,
)


def one_token_model() -> tuple[EnergyTransformer, dict[str, torch.Tensor]]:
    """Softmax memories +-u1 (strong) and +-u3 (weak) in the centered subspace of R^4: by symmetry every
    axis point is critical; +-u1 are minima, +-u3 saddles, +-u2 (no memory) maxima."""
    u1 = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64) / math.sqrt(2)
    u2 = torch.tensor([0.0, 0.0, 1.0, -1.0], dtype=torch.float64) / math.sqrt(2)
    u3 = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64) / 2
    zeros = torch.zeros(1, 1, 4, dtype=torch.float64)
    xi = torch.stack([u1, -u1, 0.5 * u3, -0.5 * u3])
    model = EnergyTransformer.from_tensors(
        zeros, zeros, xi, 1.0, torch.zeros(4, dtype=torch.float64), hopfield="softmax", beta_hn=1.0
    )
    return model, {"u1 (minimum)": 3 * u1[None, None], "u3 (saddle)": 3 * u3[None, None], "u2 (maximum)": 3 * u2[None, None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/stability"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    print("== 1. a random model: solve and check ==")
    model = random_model(12, 2, 6, 24, hopfield="softmax", seed=args.seed)
    field = ETField(model)
    x0 = torch.randn(args.samples, 6, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(args.seed))
    solution = solve(field, x0, torch.linspace(0, 40, 81))
    print(analyze_convergence(solution).table())
    print(check_lyapunov(solution).table())
    plot_convergence(solution, path=args.out / "convergence.png")

    print("\n== 2. the critical points reached, dense vs Lanczos ==")
    found = find_fixed_point(field, solution.x, tol=1e-9)
    dense = fixed_point_stability(field, found.x, method="dense")
    lanczos = fixed_point_stability(field, found.x, method="lanczos", iterations=40)
    print(dense.table())
    for d, s in zip(dense.samples, lanczos.samples, strict=True):
        print(
            f"sample {d.sample}: smallest eigenvalue dense {d.smallest:.8f}, Lanczos {s.smallest:.8f}; "
            f"largest dense {d.largest:.8f}, Lanczos {s.largest:.8f}"
        )
    plot_energy_slice(field, found.x, trajectories=solution, path=args.out / "energy_slice.png")

    print("\n== 3. one token with known critical points ==")
    toy, points = one_token_model()
    toy_field = ETField(toy)
    for name, x in points.items():
        sample = fixed_point_stability(toy_field, x).samples[0]
        print(f"{name:14s}: {sample.kind:16s} eigenvalues {sample.eigenvalues}")

    print("\n== 4. perturbations: Lyapunov exponents and basins ==")
    for name in ("u1 (minimum)", "u3 (saddle)"):
        exponent = lyapunov_exponent(toy_field, points[name], benettin=Benettin(t1=8.0, renormalizations=16), restart=True)
        probe = basin_probe(toy_field, points[name], radii=[0.01, 0.1, 0.5, 1.0], trials=8)
        print(
            f"{name:14s}: finite-time Lyapunov exponent {float(exponent.exponent[0]):+.4f} (intrinsic time); "
            f"returned fraction per radius {dict(zip(probe.radii, probe.returned[0].tolist(), strict=True))}; "
            f"basin radius {probe.radius[0]:g}"
        )
    print(f"\npictures in {args.out}")


if __name__ == "__main__":
    main()
