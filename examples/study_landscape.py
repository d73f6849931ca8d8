"""A worked landscape study: critical points of every index, saddle connections, basins, the asymptotic rate,
spectra and a pitchfork, on small float64 models (the pictures of the worked study in docs/guides/analysis.md).

    .venv/bin/python examples/study_landscape.py --out runs/landscape [--seed 3]

1. ``et_ode.analysis.analyze(..., landscape=True)`` on a small random softmax model (D = 6, N = 3, 12 memories):
   the report in ``--out/report`` (report.md with every table, and its pictures).
2. A one-token model with memories +-a u1 and +-c u3: the critical point at u3 continued in ``a``; the
   reflection g . u1 -> -g . u1 forces a pitchfork at a* = sqrt(c sinh(beta c r) / (beta r)), where two
   mirror-image saddles branch off. The located a* is printed beside the closed form.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from et_ode import EnergyTransformer, ETField
from et_ode.analysis import (
    analyze,
    continue_branch,
    newton_critical_point,
    plot_bifurcation_diagram,
    random_model,
    random_states,
)

U1 = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64) / math.sqrt(2)
U3 = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64) / 2
C, BETA = 0.5, 1.0


def symmetric(a: float) -> EnergyTransformer:
    """One token, softmax memories +-a u1 and +-c u3 (beta 1)."""
    zeros = torch.zeros(1, 1, 4, dtype=torch.float64)
    xi = torch.stack([a * U1, -a * U1, C * U3, -C * U3])
    return EnergyTransformer.from_tensors(
        zeros, zeros, xi, 1.0, torch.zeros(4, dtype=torch.float64), hopfield="softmax", beta_hn=BETA, eps=1e-12
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/landscape"))
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    print("== 1. analyze --landscape on a small random model ==")
    model = random_model(6, 2, 3, 12, hopfield="softmax", seed=args.seed)
    states = random_states(model, batch=2, tokens=3, seed=args.seed + 1)
    folder = analyze(model, states, out=args.out / "report", landscape=True, progress=False)
    text = (folder / "report.md").read_text()
    start = text.index("## The energy landscape")
    print(text[start:])

    print("\n== 2. a pitchfork forced by a reflection symmetry ==")
    r = 2.0 * math.sqrt(1 - 1e-12)
    a_star = math.sqrt(C * math.sinh(BETA * C * r) / (BETA * r))
    trunk = continue_branch(symmetric, U3[None] * 2.0, 1.0, mu_end=0.3)
    side_start = newton_critical_point(ETField(symmetric(a_star - 0.01)), (U3 + 0.3 * U1)[None] * 2.0)
    side = continue_branch(symmetric, side_start.x, a_star - 0.01, mu_end=0.3)
    print(trunk.table())
    print(f"closed form a* = {a_star:.10f}; located: " + ", ".join(f"{b.kind} at {b.mu:.10f}" for b in trunk.bifurcations))
    plot_bifurcation_diagram(
        [trunk, side],
        labels=["u3 (symmetric)", "tilted saddle"],
        parameter="memory scale a",
        path=args.out / "pitchfork.png",
    )
    print(f"\nreport and pictures in {args.out}")


if __name__ == "__main__":
    main()
