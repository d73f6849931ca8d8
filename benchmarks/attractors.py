"""How fast each method gets to a certified attractor (RMS |T dE/dg| < tol), and what a gradient there costs.

Candidates, float64, from the same random initial states:

- ``find_attractor``: the ET's flow to the hand-off, then trust-region Riemannian Newton; Lanczos certificate;
- Riemannian gradient descent alone (``find_attractor(..., method="gradient", flow=False)``);
- dopri5 on the ET flow, stopping on ``steady_state_measure="tangent_gradient"`` (capped in time and steps);
- the paper's Euler loop (``EulerET``, alpha = 0.1), capped in steps.

"evaluations" counts field evaluations of the whole batch (a Hessian-vector product counts as one, although it
costs about two); the capped methods report the RMS |T dE/dg| they reached (worst sample). The second table times
the implicit backward pass at the attractor against the adjoint's backward pass through the dopri5 solve, for the
same loss ``sum(w * g)``. The third measures the issue's "done when" model (D=12, H=2, Y=3, K=24, softmax, 6 tokens,
2 samples): ``find_attractor``'s evaluations against dopri5's to RMS |dg/dt| < 1e-6 at rtol 1e-9.

Run: ``.venv/bin/python benchmarks/attractors.py [--quick] [--size digits|28x28|both] [--threads 1]``. ``--quick``
lowers the caps (dopri5 1000 steps, Euler 500 steps, gradient descent 2000 iterations); ``--size 28x28`` runs the
28x28 size (N=50, D=128, H=4, Y=32, K=512) alone and skips the done-when model. Wall times are single runs (each
candidate once) on whatever the machine carries; read the ratios with that in mind.

The fourth table asks whether ``find_attractor`` returns the flow's own limit. Per Hopfield form and seed (float64,
D=12, H=2, Y=3, K=24, 6 tokens, one sample ``x0 = randn``; on odd seeds ``gamma = 1 + 0.3 u``, ``u ~ U(-1, 1)``, and
``delta = 0.1 randn``) the independent long flow of ``tests/reference_flow.py`` (scipy's DOP853 on the SPEC's
formulas, followed until RMS |T dE/dg| < 1e-11) gives the limit; each seed is counted as the flow's limit (distance
in ``g`` < 1e-6), reported unsettled, a certified OTHER minimum (must never happen), or otherwise (not converged, a
saddle, ...). Cost: ``find_attractor``'s evaluations against dopri5's (rtol 1e-9) to RMS |dg/dt| < 1e-6, on the
same seeds and on the README's quick-start model (D=32, H=4, Y=8, K=128, N=17, batch 8, seed 0, in float64).
``--table flow --seeds 3 --forms relu`` is a quick run of that table alone; ``--reference-cache DIR`` keeps the
reference limits (the slow part) in ``DIR`` for the next run.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.reference_flow

import _common  # noqa: E402

import et_ode  # noqa: E402
from et_ode.dynamics.manifold import radial_direction, tangent_projection  # noqa: E402
from et_ode.energy.neurons import inverse_softplus  # noqa: E402
from tests.reference_flow import SpecWeights, long_flow_limit  # noqa: E402

TOL = 1e-8


def rms_tangent(field: et_ode.ETField, x: torch.Tensor) -> float:
    """The worst sample's RMS |T dE/dg| at ``x``."""
    with torch.no_grad():
        g = field.model.neuron(x)
        s, _ = radial_direction(g, field.model.neuron.delta)
        return float(tangent_projection(field.dE_dg(g), s).square().mean(dim=(-1, -2)).sqrt().max())


def progress(row: list) -> None:
    """Each row as soon as it is measured (stderr), so that a run cut short still tells where it got."""
    print(" | ".join(map(str, row)), file=sys.stderr, flush=True)


def timed(function):
    started = time.perf_counter()
    out = function()
    return out, time.perf_counter() - started


def methods(size: _common.Size, *, max_steps: int, euler_steps: int, descent_iter: int, t1: float) -> tuple[list, list]:
    model = _common.make_model(size, hopfield="softmax", dtype=torch.float64)
    field = et_ode.ETField(model)
    x0 = _common.initial_state(size, dtype=torch.float64)
    rows = []

    field.reset_nfe()
    found, seconds = timed(lambda: et_ode.find_attractor(field, x0, tol=TOL))
    rows.append(
        [
            size.name,
            "find_attractor (flow + Newton)",
            found.evaluations,
            f"{seconds:.2f}",
            f"{float(found.gradient.max()):.1e}",
            f"{sum(k == 'stable' for k in found.kind)}/{size.batch} stable",
        ]
    )
    progress(rows[-1])

    field.reset_nfe()
    descent, seconds = timed(
        lambda: et_ode.find_attractor(field, x0, tol=TOL, method="gradient", flow=False, max_iter=descent_iter)
    )
    rows.append(
        [
            size.name,
            "Riemannian gradient descent",
            descent.evaluations,
            f"{seconds:.2f}",
            f"{float(descent.gradient.max()):.1e}",
            f"{int(descent.iterations.max())} iterations",
        ]
    )
    progress(rows[-1])

    field.reset_nfe()
    started = time.perf_counter()
    try:
        with torch.no_grad():  # (no graph: a direct gradient would keep every stage of every step)
            out = et_ode.solve(
                field,
                x0,
                (0.0, t1),
                solver=et_ode.Adaptive(rtol=1e-9, atol=1e-9),
                stop=et_ode.SteadyState(TOL, measure="tangent_gradient"),
                save="final",
                max_steps=max_steps,
            )
        reached, note, x_end = out.stats.t_final, str(out.status), out.x.detach()
    except et_ode.SolveError as error:
        reached, note, x_end = error.time, f"capped at {max_steps} steps", error.solution.x
    seconds = time.perf_counter() - started
    rows.append(
        [
            size.name,
            "dopri5 on the flow (rtol 1e-9)",
            field.nfe,
            f"{seconds:.2f}",
            f"{rms_tangent(field, x_end):.1e}",
            f"{note}, t = {reached:.3g}",
        ]
    )
    progress(rows[-1])

    field.reset_nfe()
    with torch.no_grad():
        out, seconds = timed(lambda: et_ode.solve(field, x0, solver=et_ode.EulerET(0.1, euler_steps), save="final"))
    rows.append(
        [
            size.name,
            f"paper's Euler loop (alpha 0.1, {euler_steps} steps)",
            field.nfe,
            f"{seconds:.2f}",
            f"{rms_tangent(field, out.x.detach()):.1e}",
            "capped",
        ]
    )
    progress(rows[-1])

    # the gradient of the same loss: implicit at the attractor, adjoint through a solve of the same length
    weights = torch.randn(x0.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    model.zero_grad()
    loss = (weights * found.g).sum()
    field.reset_nfe()
    _, implicit_seconds = timed(loss.backward)
    implicit_evaluations = field.nfe
    horizon = float(reached)
    adjoint = et_ode.solve(
        field,
        x0,
        (0.0, horizon),
        solver=et_ode.Adaptive(rtol=1e-9, atol=1e-9),
        gradient="adjoint",
        save="final",
        max_steps=max_steps,
    )
    loss = (weights * adjoint.g).sum()
    model.zero_grad()
    field.reset_nfe()
    _, adjoint_seconds = timed(loss.backward)
    gradient_rows = [
        [
            size.name,
            implicit_evaluations,
            f"{implicit_seconds:.3f}",
            field.nfe,
            f"{adjoint_seconds:.3f}",
            f"{horizon:.3g}",
            f"{adjoint_seconds / implicit_seconds:.1f}x",
        ]
    ]
    progress(gradient_rows[-1])
    return rows, gradient_rows


def done_when() -> list:
    model = _common.make_model(_common.Size("issue", 6, 12, 2, 3, 24, 2), hopfield="softmax", dtype=torch.float64)
    field = et_ode.ETField(model)
    x0 = torch.randn(2, 6, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    field.reset_nfe()
    out, dopri_seconds = timed(
        lambda: et_ode.solve(
            field,
            x0,
            (0.0, 1e8),
            solver=et_ode.Adaptive(rtol=1e-9, atol=1e-9),
            stop=et_ode.SteadyState(1e-6),
            save="final",
            max_steps=100_000,
        )
    )
    dopri_evaluations = field.nfe
    field.reset_nfe()
    found, seconds = timed(lambda: et_ode.find_attractor(field, x0))
    return [
        [
            found.evaluations,
            f"{seconds:.2f}",
            f"{float(found.gradient.max()):.1e}",
            ", ".join(found.kind),
            dopri_evaluations,
            f"{dopri_seconds:.2f}",
            f"{rms_tangent(field, out.x.detach()):.1e}",
            f"{found.evaluations / dopri_evaluations:.2f}",
        ]
    ]


# -- does find_attractor return the flow's own limit? -------------------------------------------------------------

FORMS = ("relu", "softmax", "softplus")
SAME = 1e-6  # distance in g below which find_attractor's point is the flow's limit


def seed_model(form: str, seed: int) -> et_ode.EnergyTransformer:
    """The issue's model (D=12, H=2, Y=3, K=24) of ``seed``, float64; ``gamma`` and ``delta`` perturbed on odd seeds."""
    torch.manual_seed(seed)
    model = et_ode.EnergyTransformer(12, 2, 3, 24, hopfield=form, dtype=torch.float64)
    if seed % 2:
        generator = torch.Generator().manual_seed(1_000_003 + seed)
        gamma = 1.0 + 0.3 * (2.0 * float(torch.rand((), generator=generator, dtype=torch.float64)) - 1.0)
        with torch.no_grad():
            model.neuron.gamma_raw.fill_(inverse_softplus(gamma))
            model.neuron.delta.copy_(0.1 * torch.randn(12, generator=generator, dtype=torch.float64))
    return model


def dopri5_evaluations(field: et_ode.ETField, x0: torch.Tensor) -> tuple[int, bool]:
    """dopri5's evaluations (rtol 1e-9) to RMS |dg/dt| < 1e-6, and whether it got there (within t = 1e8 and
    100000 steps)."""
    field.reset_nfe()
    try:
        with torch.no_grad():
            out = et_ode.solve(
                field,
                x0,
                (0.0, 1e8),
                solver=et_ode.Adaptive(rtol=1e-9, atol=1e-9),
                stop=et_ode.SteadyState(1e-6),
                save="final",
                max_steps=100_000,
            )
        reached = out.status == et_ode.Status.STEADY_STATE
    except et_ode.SolveError:
        reached = False
    return field.nfe, reached


def statuses(found: et_ode.Attractor) -> tuple[list[str], list[bool]]:
    """Per sample: ``found.status`` and ``found.certified`` where the Attractor has them; otherwise a status
    assembled from ``converged`` and ``kind`` (no ``"unsettled"``), certified = converged and stable."""
    converged = found.converged.reshape(-1).tolist()
    certified = getattr(found, "certified", None)
    if certified is None:
        certified_list = [c and k == "stable" for c, k in zip(converged, found.kind, strict=True)]
    else:
        certified_list = [bool(c) for c in torch.as_tensor(certified).reshape(-1).tolist()]
    status = getattr(found, "status", None)
    if status is None:
        status = tuple(
            "certified" if c else (k if k != "stable" else "not_converged") if conv else "not_converged"
            for c, k, conv in zip(certified_list, found.kind, converged, strict=True)
        )
    return list(status), certified_list


@dataclass(frozen=True)
class Reference:
    """What the table needs of the reference's limit: ``g`` ``(N, D)``, its energy, and whether it converged."""

    g: torch.Tensor
    energy: float
    converged: bool


def reference_limit(model: et_ode.EnergyTransformer, x0: torch.Tensor, cache: Path | None) -> Reference:
    """The long flow's limit from ``x0`` (:func:`tests.reference_flow.long_flow_limit`), read from ``cache`` (a
    folder, one file per model and start, named by a hash of their tensors) when it holds it, else computed (and
    stored there). The reference depends on the weights and the start only, so a cache is reused across changes of
    the library."""
    weights = SpecWeights.from_model(model)
    path = None
    if cache is not None:
        digest = hashlib.sha256(f"{weights.beta_hn} {weights.form} {weights.eps} {weights.self_attention}".encode())
        for tensor in (weights.WK, weights.WQ, weights.xi, weights.gamma, weights.delta, weights.beta, x0):
            digest.update(tensor.detach().to(torch.float64).contiguous().numpy().tobytes())
        path = cache / f"{digest.hexdigest()[:32]}.pt"
        if path.exists():
            stored = torch.load(path, weights_only=True)
            return Reference(stored["g"], float(stored["energy"]), bool(stored["converged"]))
    limit = long_flow_limit(weights, x0)
    reference = Reference(limit.g, limit.energy, limit.converged)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"g": reference.g, "energy": reference.energy, "converged": reference.converged}, path)
    return reference


def seed_record(form: str, seed: int, cache: Path | None = None) -> dict:
    """One seed: the reference's limit, find_attractor's point and status, and both methods' evaluations."""
    model = seed_model(form, seed)
    x0 = torch.randn(6, 12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    reference = reference_limit(model, x0, cache)
    field = et_ode.ETField(model)
    field.reset_nfe()
    found = et_ode.find_attractor(field, x0[None])
    status, certified = statuses(found)
    distance = float((found.g.detach()[0] - reference.g).norm())
    dopri, reached = dopri5_evaluations(field, x0[None])
    if distance < SAME:
        outcome = "flow's limit"
    elif status[0] == "unsettled":
        outcome = "unsettled"
    elif certified[0]:
        outcome = "certified other"
    else:
        outcome = status[0]
    record = {
        "form": form,
        "seed": seed,
        "outcome": outcome,
        "status": status[0],
        "distance": distance,
        "energy_gap": float(found.energy.reshape(-1)[0]) - reference.energy,
        "evaluations": found.evaluations,
        "dopri5": dopri,
        "dopri5_reached": reached,
        "reference_converged": reference.converged,
    }
    progress(
        [
            form,
            seed,
            outcome,
            status[0],
            f"{distance:.1e}",
            f"{record['energy_gap']:+.3g}",
            found.evaluations,
            dopri,
            reached,
            reference.converged,
        ]
    )
    return record


def limit_rows(records: list[dict]) -> list[list]:
    """One row per form: the outcomes' fractions and the evaluation costs (medians and the ratio of totals)."""
    rows = []
    for form in dict.fromkeys(r["form"] for r in records):
        mine = [r for r in records if r["form"] == form]
        n = len(mine)
        outcomes = Counter(r["outcome"] for r in mine)
        others = (
            ", ".join(f"{k} {v}" for k, v in outcomes.items() if k not in ("flow's limit", "unsettled", "certified other"))
            or "-"
        )
        found = [r["evaluations"] for r in mine]
        dopri = [r["dopri5"] for r in mine]
        matched = outcomes["flow's limit"]
        rows.append(
            [
                form,
                n,
                f"{matched / n:.2f}",
                f"{outcomes['unsettled'] / n:.2f}",
                f"{outcomes['certified other'] / n:.2f}",
                others,
                f"{sum(not r['reference_converged'] for r in mine)}",
                f"{max(r['distance'] for r in mine):.1e}",
                int(statistics.median(found)),
                int(statistics.median(dopri)),
                f"{sum(not r['dopri5_reached'] for r in mine)}",
                f"{sum(found) / sum(dopri):.3f}",
            ]
        )
    return rows


def readme_cost() -> list:
    """The README's quick-start model and batch (seed 0), in float64: find_attractor's evaluations against
    dopri5's to RMS |dg/dt| < 1e-6."""
    torch.manual_seed(0)
    model = et_ode.EnergyTransformer(dim=32, heads=4, head_dim=8, memories=128).double()
    x0 = torch.randn(8, 17, 32).double()
    field = et_ode.ETField(model, tau=1.0)
    field.reset_nfe()
    found, seconds = timed(lambda: et_ode.find_attractor(field, x0))
    status, _ = statuses(found)
    dopri, reached = dopri5_evaluations(field, x0)
    counts = ", ".join(f"{k} {v}" for k, v in Counter(status).items())
    return [
        [
            "README quick start (D=32, N=17, batch 8)",
            found.evaluations,
            f"{seconds:.2f}",
            counts,
            dopri,
            "yes" if reached else "no",
            f"{found.evaluations / dopri:.3f}",
        ]
    ]


def flow_limit_tables(seeds: int, forms: list[str], cache: Path | None = None) -> str:
    records = [seed_record(form, seed, cache) for form in forms for seed in range(seeds)]
    limits = _common.table(
        [
            "form",
            "seeds",
            "flow's limit",
            "unsettled",
            "certified other",
            "other outcomes",
            "reference unconverged",
            "max distance",
            "find_attractor evaluations (median)",
            "dopri5 evaluations (median)",
            "dopri5 capped",
            "find_attractor / dopri5 (totals)",
        ],
        limit_rows(records),
        f"Does find_attractor return the flow's own limit? float64, D=12, H=2, Y=3, K=24, 6 tokens, {seeds} seeds "
        f"(distance in g < {SAME:g} to an independent DOP853 flow followed to RMS |T dE/dg| < 1e-11); cost against "
        "dopri5 (rtol 1e-9) to RMS |dg/dt| < 1e-6",
    )
    cost = _common.table(
        ["model", "find_attractor evaluations", "s", "status", "dopri5 evaluations", "dopri5 reached 1e-6", "ratio"],
        readme_cost(),
        "The README's quick-start model, float64: find_attractor against dopri5 to RMS |dg/dt| < 1e-6",
    )
    return limits + "\n\n" + cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller caps (see the module docstring)")
    parser.add_argument("--size", choices=("digits", "28x28", "both"), default="both")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--table",
        choices=("all", "methods", "flow"),
        default="all",
        help="the method tables, the flow's-own-limit table, or all",
    )
    parser.add_argument("--seeds", type=int, default=50, help="seeds per Hopfield form of the flow's-limit table")
    parser.add_argument(
        "--forms", nargs="+", choices=FORMS, default=list(FORMS), help="Hopfield forms of the flow's-limit table"
    )
    parser.add_argument(
        "--reference-cache",
        type=Path,
        default=None,
        help="a folder keeping the reference flows' limits between runs (computed where missing)",
    )
    args = parser.parse_args()
    _common.set_threads(args.threads)
    if args.table == "flow":
        print(_common.environment())
        print(flow_limit_tables(args.seeds, args.forms, args.reference_cache))
        return
    sizes = ([_common.DIGITS.with_batch(16)] if args.size != "28x28" else []) + (
        [_common.MNIST.with_batch(16)] if args.size != "digits" else []
    )
    rows, gradient_rows = [], []
    for size in sizes:
        r, g = methods(
            size,
            max_steps=1000 if args.quick else 3000,
            euler_steps=500 if args.quick else 2000,
            descent_iter=2000 if args.quick else 20_000,
            t1=1e4,
        )
        rows += r
        gradient_rows += g
    print(_common.environment())
    print(
        _common.table(
            ["size", "method", "evaluations", "seconds", f"RMS |T dE/dg| reached (tol {TOL:g})", "note"],
            rows,
            "Reaching a certified attractor, float64, batch 16",
        )
    )
    print()
    print(
        _common.table(
            [
                "size",
                "implicit: HVPs",
                "implicit backward s",
                "adjoint: evaluations",
                "adjoint backward s",
                "solve length t",
                "adjoint / implicit",
            ],
            gradient_rows,
            "The gradient of sum(w * g): implicit at the attractor vs the adjoint through the flow",
        )
    )
    if args.size == "28x28":
        return
    print()
    print(
        _common.table(
            [
                "find_attractor evaluations",
                "s",
                "RMS |T dE/dg|",
                "kind",
                "dopri5 evaluations",
                "s",
                "dopri5's RMS |T dE/dg| at its stop",
                "ratio",
            ],
            done_when(),
            "Done-when model (D=12, H=2, Y=3, K=24, softmax, 6 tokens, 2 samples): find_attractor to "
            "1e-8 vs dopri5 (rtol 1e-9) to RMS |dg/dt| < 1e-6",
        )
    )
    if args.table == "all":
        print()
        print(flow_limit_tables(args.seeds, args.forms, args.reference_cache))


if __name__ == "__main__":
    main()
