"""et-ode's own adaptive loop (per-sample and shared step control) against torchdiffeq, on the same ET weights.

For each size and batch: dopri5 from 0 to ``--t1`` at ``--rtol``/``--atol`` (float32, no gradients), timed
interleaved (see ``_common.interleaved``), printing wall time, field evaluations (NFE), sample-evaluations (the
batch size of every evaluation added up: per-sample control evaluates only the samples still running), accepted
steps, and the largest difference of the final state from torchdiffeq's relative to its largest entry. The rows:

- ``bare loop``: the field evaluated at the very states torchdiffeq evaluates it at (recorded from one of its
  runs), in a plain Python loop: the floor any solver's machinery adds to (the field's cost depends on the state:
  evaluating it at ``x0`` over and over runs up to 1.3x faster than along a trajectory);
- ``torchdiffeq``: ``torchdiffeq.odeint`` on the ET field itself (no et-ode recorder);
- ``et-ode shared``: ``solve`` with ``Adaptive(loop="et_ode")`` (one step size for the batch);
- ``et-ode per-sample``: ``solve`` with ``Adaptive(step_control="per_sample")``;
- ``et-ode per-sample tsit5``: the same with Tsitouras' 5(4) pair (``Adaptive("tsit5", ...)``);
- ``torchode`` (only where it is installed: ``pip install -e .[peers]``; never by ``make test``): its Dopri5 with
  an integral controller, per sample.

Then a mixed batch (``--mixed``, default on): half the samples already near their attractor (the end of a solve to
t=50 from random states), half random, where per-sample control spends evaluations on the hard half only; its
sample-evaluations against the shared mode's are the measure of compaction.

    python benchmarks/adaptive.py                       # digits and 28x28, batch 1 and 64, one thread
    python benchmarks/adaptive.py --size digits --batch 64 --threads 2 --reps 9
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torchdiffeq import odeint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DIGITS, MNIST, environment, initial_state, interleaved, make_model, ms, set_threads, table  # noqa: E402

import et_ode  # noqa: E402

SIZES = {"digits": DIGITS, "mnist": MNIST}


def candidates(
    field: et_ode.ETField, x0: torch.Tensor, args: argparse.Namespace
) -> tuple[dict[str, Callable[[], object]], dict[str, tuple[int, int, int, torch.Tensor]]]:
    """The timed calls, and each one's (NFE, sample-evaluations, accepted steps, final state) from one run."""
    t = torch.tensor([0.0, args.t1])
    batch = x0.shape[0]
    counts: dict[str, tuple[int, int, int, torch.Tensor]] = {}
    runs: dict[str, Callable[[], object]] = {}

    def torchdiffeq_run() -> torch.Tensor:
        return odeint(field, x0, t.to(x0.dtype), method="dopri5", rtol=args.rtol, atol=args.atol)[-1]

    inputs: list[torch.Tensor] = []

    def recording(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        inputs.append(x.clone())
        return field(t, x)

    with torch.no_grad():
        reference = odeint(recording, x0, t.to(x0.dtype), method="dopri5", rtol=args.rtol, atol=args.atol)[-1]
    evaluations = len(inputs)
    counts["torchdiffeq"] = (evaluations, evaluations * batch, -1, reference)

    def bare() -> None:
        for x in inputs:
            field(None, x)

    runs["bare loop"] = bare
    runs["torchdiffeq"] = torchdiffeq_run
    counts["bare loop"] = (evaluations, evaluations * batch, -1, reference)
    for name, solver in (
        ("et-ode shared", et_ode.Adaptive("dopri5", args.rtol, args.atol, loop="et_ode")),
        ("et-ode per-sample", et_ode.Adaptive("dopri5", args.rtol, args.atol, step_control="per_sample")),
        ("et-ode per-sample tsit5", et_ode.Adaptive("tsit5", args.rtol, args.atol, step_control="per_sample")),
    ):

        def run(solver: et_ode.Adaptive = solver) -> et_ode.Solution:
            return et_ode.solve(field, x0, (0.0, args.t1), solver=solver, save="final")

        with torch.no_grad():
            solution = run()
        stats = solution.stats
        counts[name] = (stats.nfe_forward, stats.sample_evaluations, stats.accepted_steps, solution.x)
        runs[name] = run
    if importlib.util.find_spec("torchode") is not None:
        runs["torchode"], counts["torchode"] = _torchode(field, x0, args)
    return runs, counts


def _torchode(
    field: et_ode.ETField, x0: torch.Tensor, args: argparse.Namespace
) -> tuple[Callable[[], object], tuple[int, int, int, torch.Tensor]]:
    """torchode's Dopri5 with its integral controller on the flattened batch ``(B, N * D)``, per sample."""
    import torchode  # type: ignore[import-not-found]

    shape = x0.shape
    term = torchode.ODETerm(lambda t, y: field(None, y.view(shape)).reshape(shape[0], -1))
    solver = torchode.AutoDiffAdjoint(
        torchode.Dopri5(term=term), torchode.IntegralController(atol=args.atol, rtol=args.rtol, term=term)
    )
    t_eval = torch.tensor([0.0, args.t1], dtype=x0.dtype).repeat(shape[0], 1)

    def run() -> object:
        return solver.solve(torchode.InitialValueProblem(y0=x0.reshape(shape[0], -1), t_eval=t_eval))

    with torch.no_grad():
        before = field.nfe
        solution = run()
        evaluations = field.nfe - before
    final = solution.ys[:, -1].reshape(shape)  # type: ignore[attr-defined]
    accepted = int(solution.stats["n_accepted"].sum())  # type: ignore[attr-defined]
    return run, (evaluations, -1, accepted, final)


def measure(size_name: str, batch: int, args: argparse.Namespace) -> list[list[object]]:
    size = SIZES[size_name].with_batch(batch)
    field = et_ode.ETField(make_model(size))
    x0 = initial_state(size)
    runs, counts = candidates(field, x0, args)
    with torch.no_grad():
        seconds = interleaved(runs, reps=args.reps, statistic=args.statistic, clock=args.clock)
    reference = counts["torchdiffeq"][3]
    scale = reference.abs().max().item()
    rows = []
    for name, elapsed in seconds.items():
        nfe, sample_evaluations, accepted, final = counts[name]
        rows.append(
            [
                f"{size_name} N={size.n} D={size.d}",
                batch,
                name,
                ms(elapsed),
                f"{elapsed / seconds['torchdiffeq']:.2f}",
                nfe,
                sample_evaluations if sample_evaluations >= 0 else "-",
                accepted if accepted >= 0 else "-",
                f"{(final - reference).abs().max().item() / scale:.1e}",
            ]
        )
    return rows


def mixed(size_name: str, batch: int, args: argparse.Namespace) -> list[list[object]]:
    """Half easy, half hard: the shared and per-sample modes' time, evaluations and sample-evaluations."""
    size = SIZES[size_name].with_batch(batch)
    field = et_ode.ETField(make_model(size))
    hard = initial_state(size)
    with torch.no_grad():
        easy = et_ode.solve(
            field, initial_state(size, seed=2), (0.0, 50.0), solver=et_ode.Adaptive(rtol=1e-5), save="final"
        ).x
    x0 = torch.cat([easy[: batch // 2], hard[batch // 2 :]])
    rows = []
    runs: dict[str, Callable[[], object]] = {}
    for name, solver in (
        ("et-ode shared", et_ode.Adaptive("dopri5", args.rtol, args.atol, loop="et_ode")),
        ("et-ode per-sample", et_ode.Adaptive("dopri5", args.rtol, args.atol, step_control="per_sample")),
    ):

        def run(solver: et_ode.Adaptive = solver) -> et_ode.Solution:
            return et_ode.solve(field, x0, (0.0, args.t1), solver=solver, save="final")

        runs[name] = run
    with torch.no_grad():
        solutions = {name: run() for name, run in runs.items()}
        seconds = interleaved(runs, reps=args.reps, statistic=args.statistic, clock=args.clock)
    for name, solution in solutions.items():
        stats = solution.stats  # type: ignore[attr-defined]
        rows.append(
            [
                f"{size_name} mixed",
                batch,
                name,
                ms(seconds[name]),
                stats.nfe_forward,
                stats.sample_evaluations,
                stats.accepted_steps,
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=[*SIZES, "all"], default="all")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--t1", type=float, default=5.0)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--statistic", choices=["min", "median"], default="min")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (steadier where other jobs share the cores)",
    )
    parser.add_argument("--threads", type=int, default=1, help="pin the process to this many cores")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed easy/hard batch")
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment())
    rows = []
    for size_name in SIZES if args.size == "all" else [args.size]:
        for batch in args.batch:
            rows.extend(measure(size_name, batch, args))
    print(
        table(
            [
                "size",
                "batch",
                "solver",
                f"ms ({args.statistic}, {args.clock})",
                "x torchdiffeq",
                "NFE",
                "sample-evals",
                "accepted",
                "final vs torchdiffeq",
            ],
            rows,
            title=f"dopri5, rtol={args.rtol:g}, atol={args.atol:g}, t in [0, {args.t1:g}], float32, no gradients",
        )
    )
    if not args.no_mixed:
        rows = [
            row
            for size_name in (SIZES if args.size == "all" else [args.size])
            for row in mixed(size_name, max(args.batch), args)
        ]
        print(
            table(
                [
                    "batch",
                    "size",
                    "solver",
                    f"ms ({args.statistic}, {args.clock})",
                    "NFE",
                    "sample-evals",
                    "accepted (samples' steps added up)",
                ],
                [[r[1], r[0], *r[2:]] for r in rows],
                title="a batch of half easy (near the attractor) and half hard (random) samples",
            )
        )


if __name__ == "__main__":
    main()
