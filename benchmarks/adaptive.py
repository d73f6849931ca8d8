"""et-ode's adaptive loop against torchdiffeq, torchode and diffrax, on the same ET weights.

For each size: dopri5 from 0 to t1 at ``--rtol``/``--atol`` (float32, no gradients), every candidate timed
interleaved (see ``_common.interleaved``), printing wall time, field evaluations (NFE), sample-evaluations (the
batch size of every evaluation added up: per-sample control evaluates only the samples still running), accepted
steps, and the largest difference of the final state from torchdiffeq's relative to its largest entry. The rows:

- ``bare loop``: the field evaluated at the very states torchdiffeq evaluates it at (recorded from one of its
  runs), in a plain Python loop: the floor any solver's machinery adds to;
- ``torchdiffeq``: ``torchdiffeq.odeint`` on the ET field itself (no et-ode recorder);
- ``et-ode shared``: ``solve`` with the default ``Adaptive("dopri5", ...)``: et-ode's loop, one step size for the
  batch; for this ET (no mask, on the CPU, no gradients) the default ``compile="auto"`` runs the whole solve in et-ode's
  native loop (C, built once per machine, before the timing, as diffrax's ``jax.jit``);
- ``et-ode per-sample``: ``Adaptive(step_control="per_sample")``, each sample its own steps in the same loop;
  ``et-ode per-sample tsit5``: with Tsitouras' pair;
- ``..., step by step``: the same with ``compile=False``, each step's stages dispatched from Python;
- with ``--inductor``: ``Adaptive(compile=True)`` with the native loop off (``..., torch.compile``: every step inside
  one ``while_loop`` compiled by ``torch.compile``, before the timing; a sample that has reached t1 keeps its state
  while the others step on, as under diffrax's ``vmap``); with ``--watched``: the shared solve with a progress bar
  (``solve(progress=True)``: the same calls, the bar moving between them) and, with ``compile=True``, with a progress
  callback (the callback called for each step after each call);
- ``torchode`` (where installed): its Dopri5 with an integral controller on our field, per sample;
- ``diffrax batched`` and ``diffrax per-sample`` (where jax and diffrax are installed): ``jax.jit`` of
  ``diffeqsolve`` with Dopri5 and a PID controller of the I-controller's coefficients on the same weights written in
  JAX (``_common.jax_field``), the batch as one state, or ``vmap`` over the samples (each its own steps).

The ``x own bare`` column divides an et-ode row's time by a bare loop over the states that row itself evaluated the
field at (recorded from one of its runs): what its machinery adds; a row whose steps run no Python to record (the
native loop's, a compiled one's) is divided by its step-by-step row's bare loop (the same method and tolerances:
compare their NFE). ``x diffrax``
divides it by its diffrax peer's (batched for the shared rows, vmapped for the per-sample rows). Every ratio is the
median over rounds of the two times within one round (``_common.paired_ratio``), which a drift of the machine's speed
between rounds leaves alone.
Then (``--stop``) each sample integrated to rest, RMS dg/dt below ``--stop-tol`` (t1 = 100): et-ode shared
(``SteadyState(tol)``, one stop for the batch), per sample (``SteadyState(tol, per_sample=True)``), torchdiffeq's
event path with per-sample stops, and diffrax with an event on the same measure (batched: the batch's largest;
vmapped: each sample's). Then (``--mixed``) a batch of half easy (the end of a solve to t=50) and half hard samples,
where per-sample control spends evaluations on the hard half only.

The peers install apart from the package (never by ``make test``): ``pip install -e .[peers]`` or, in a separate
environment, ``pip install torchdiffeq torchode jax diffrax`` beside et-ode.

    python benchmarks/adaptive.py --threads 1                  # digits, 28x28 (batch 64), ImageNet (batch 4)
    python benchmarks/adaptive.py --threads 2 --size mnist imagenet --reps 5
    python benchmarks/adaptive.py --batch 1                    # one sample per solve: the loop's fixed costs
    python benchmarks/adaptive.py --batch 1 --inductor         # and the rows of torch.compile, the native loop off
    python benchmarks/adaptive.py --batch 1 --watched --size digits mnist   # and with progress shown
    python benchmarks/adaptive.py --device cuda --size digits mnist     # on a GPU, with the captured step's row
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchdiffeq import odeint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DIGITS,
    IMAGENET,
    MNIST,
    STATISTICS,
    Size,
    environment,
    initial_state,
    interleaved,
    interleaved_times,
    jax_field,
    make_model,
    ms,
    paired_ratio,
    set_threads,
    table,
)

import et_ode  # noqa: E402
from et_ode.cli.options import count_in  # noqa: E402
from et_ode.kernels.native import NativeSolve  # noqa: E402

CASES = {"digits": (DIGITS, 5.0), "mnist": (MNIST, 5.0), "imagenet": (IMAGENET, 1.0)}  # size (its batch), t1
STOP_T1 = 100.0


NOWHERE = open(os.devnull, "w")  # where a timed solve's progress bar is drawn


@dataclass
class Run:
    """One candidate: the timed call, its NFE, sample-evaluations and accepted steps (-1: not reported), its final
    state, and the inputs of its field evaluations (et-ode rows: for the own bare loop)."""

    call: Callable[[], object]
    nfe: int
    sample_evaluations: int
    accepted: int
    final: torch.Tensor
    inputs: list[torch.Tensor] | None = None


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _recorded(field: et_ode.ETField, inputs: list[torch.Tensor]) -> et_ode.ETField:
    """A copy of ``field`` whose evaluations also keep a copy of their input in ``inputs``."""
    recording = field.with_mask(field.mask)

    def forward(t: torch.Tensor | None, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        inputs.append(x.clone())
        return et_ode.ETField.forward(recording, t, x, out=out)

    recording.forward = forward  # type: ignore[method-assign]
    return recording


def et_ode_run(
    field: et_ode.ETField,
    x0: torch.Tensor,
    t1: float,
    solver: et_ode.Adaptive,
    stop: Any = None,
    bar: bool = False,
    native_off: bool = False,
) -> Run:
    """``solve`` with ``solver`` (and ``stop``; ``bar``: with its progress bar, drawn to nowhere; ``native_off``: a
    compiled solve handed to ``torch.compile`` even where the native loop runs the field), once recorded where its
    steps run from Python (``compile=False`` without ``cuda_graph``: the native loop's, a captured or compiled step run
    none, so the others have no own bare loop)."""

    def call(target: et_ode.ETField = field) -> et_ode.Solution:
        with contextlib.redirect_stderr(NOWHERE) if bar else contextlib.nullcontext(), _native(not native_off):
            return et_ode.solve(target, x0, (0.0, t1), solver=solver, stop=stop, save="final", progress=bar)

    inputs: list[torch.Tensor] | None = None if solver.cuda_graph or solver.compile is not False else []
    with torch.no_grad():
        solution = call(field if inputs is None else _recorded(field, inputs))
    stats = solution.stats
    return Run(call, stats.nfe_forward, stats.sample_evaluations, stats.accepted_steps, solution.x, inputs)


@contextlib.contextmanager
def _native(on: bool) -> Iterator[None]:
    """Inside the block, ``compile=True`` runs on the native loop where it can (``on``) or on ``torch.compile``."""
    if on:
        yield
        return
    create = NativeSolve.create
    NativeSolve.create = lambda *arguments, **settings: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        NativeSolve.create = create  # type: ignore[method-assign]


def torchdiffeq_runs(field: et_ode.ETField, x0: torch.Tensor, t1: float, args: argparse.Namespace) -> dict[str, Run]:
    """``torchdiffeq.odeint`` on the field, and the bare loop over the states it evaluates the field at."""
    t = torch.tensor([0.0, t1], device=x0.device)
    inputs: list[torch.Tensor] = []
    with torch.no_grad():
        final = odeint(_recorded(field, inputs), x0, t, method="dopri5", rtol=args.rtol, atol=args.atol)[-1]
    batch = x0.shape[0]

    def bare() -> None:
        for x in inputs:
            field(None, x)

    def call() -> torch.Tensor:
        return odeint(field, x0, t, method="dopri5", rtol=args.rtol, atol=args.atol)[-1]

    count = len(inputs)
    return {
        "bare loop": Run(bare, count, count * batch, -1, final),
        "torchdiffeq": Run(call, count, count * batch, -1, final),
    }


def torchode_run(field: et_ode.ETField, x0: torch.Tensor, t1: float, args: argparse.Namespace) -> Run:
    """torchode's Dopri5 with its integral controller on the flattened batch ``(B, N * D)``, per sample."""
    import torchode  # type: ignore[import-not-found]

    shape = x0.shape
    term = torchode.ODETerm(lambda t, y: field(None, y.view(shape)).reshape(shape[0], -1))
    solver = torchode.AutoDiffAdjoint(
        torchode.Dopri5(term=term), torchode.IntegralController(atol=args.atol, rtol=args.rtol, term=term)
    )
    t_eval = torch.tensor([0.0, t1], dtype=x0.dtype, device=x0.device).repeat(shape[0], 1)

    def call() -> Any:
        return solver.solve(torchode.InitialValueProblem(y0=x0.reshape(shape[0], -1), t_eval=t_eval))

    with torch.no_grad():
        before = field.nfe
        solution = call()
        evaluations = field.nfe - before
    return Run(call, evaluations, -1, int(solution.stats["n_accepted"].sum()), solution.ys[:, -1].reshape(shape))


def diffrax_runs(
    model: et_ode.EnergyTransformer, x0: torch.Tensor, t1: float, args: argparse.Namespace, stop_tol: float | None = None
) -> dict[str, Run]:
    """diffrax's Dopri5 with a PID controller (the I-controller's coefficients, torchdiffeq's factor limits) under
    ``jax.jit``: the batch as one state, and ``vmap`` over the samples; with ``stop_tol``, an event ends each solve
    where RMS dg/dt falls below it (the batch's largest, or the sample's own)."""
    import diffrax  # type: ignore[import-not-found]
    import jax
    import jax.numpy as jnp

    et = jax_field(model)
    term = diffrax.ODETerm(lambda t, y, p: et.field(p, y))
    controller = diffrax.PIDController(rtol=args.rtol, atol=args.atol, pcoeff=0.0, icoeff=1.0, dcoeff=0.0, factormax=10.0)

    def solve(y0: Any) -> Any:
        event = None
        if stop_tol is not None:
            event = diffrax.Event(lambda t, y, p, **kwargs: jnp.max(et.rms_dg_dt(p, y)) < stop_tol)
        solution = diffrax.diffeqsolve(
            term,
            diffrax.Dopri5(),
            0.0,
            t1,
            None,
            y0,
            args=et.params,
            stepsize_controller=controller,
            saveat=diffrax.SaveAt(t1=True),
            event=event,
            max_steps=100_000,
        )
        return solution.ys[-1], solution.stats["num_steps"], solution.stats["num_accepted_steps"]

    runs = {}
    y0 = jnp.asarray(x0.numpy())
    for name, compiled in (("diffrax batched", jax.jit(solve)), ("diffrax per-sample", jax.jit(jax.vmap(solve)))):
        final, steps, accepted = jax.block_until_ready(compiled(y0))  # compiles
        # first-same-as-last: six evaluations a step, two to start; vmap evaluates every sample at every step
        nfe = int(jnp.max(steps)) * 6 + 2
        samples = nfe * x0.shape[0]
        runs[name] = Run(
            lambda c=compiled: jax.block_until_ready(c(y0)),
            nfe,
            samples,
            int(jnp.sum(accepted)),
            torch.from_numpy(jax.device_get(final).copy()),
        )
    return runs


def bare(field: et_ode.ETField, inputs: list[torch.Tensor]) -> Callable[[], None]:
    def call() -> None:
        for x in inputs:
            field(None, x)

    return call


def _case(name: str, args: argparse.Namespace) -> tuple[Size, float]:
    """The size ``name`` (with ``--batch`` samples where given) and its end time."""
    size, t1 = CASES[name]
    return (size if args.batch is None else size.with_batch(args.batch)), t1


def measure(name: str, args: argparse.Namespace) -> list[list[object]]:
    size, t1 = _case(name, args)
    model = make_model(size).to(args.device)
    field = et_ode.ETField(model)
    x0 = initial_state(size).to(args.device)
    runs = torchdiffeq_runs(field, x0, t1, args)
    shared = functools.partial(et_ode.Adaptive, "dopri5", args.rtol, args.atol)
    per_sample = functools.partial(shared, step_control="per_sample")
    solvers = {
        "et-ode shared": shared(),
        "et-ode per-sample": per_sample(),
        "et-ode per-sample tsit5": et_ode.Adaptive("tsit5", args.rtol, args.atol, step_control="per_sample"),
        "et-ode shared, step by step": shared(compile=False),
        "et-ode per-sample, step by step": per_sample(compile=False),
    }
    if x0.is_cuda:
        solvers["et-ode shared, CUDA graph"] = shared(cuda_graph=True)
    for label, solver in solvers.items():
        runs[label] = et_ode_run(field, x0, t1, solver)
    if args.inductor:  # compile=True handed to torch.compile, the native loop off
        runs["et-ode shared, torch.compile"] = et_ode_run(field, x0, t1, shared(compile=True), native_off=True)
        runs["et-ode per-sample, torch.compile"] = et_ode_run(field, x0, t1, per_sample(compile=True), native_off=True)
    if args.watched:  # progress shown: a bar, and a callback (compile=True: else the steps run one by one)
        runs["et-ode shared, bar"] = et_ode_run(field, x0, t1, solvers["et-ode shared"], bar=True)
        runs["et-ode shared, callback"] = et_ode_run(field, x0, t1, shared(compile=True, progress=_ignored))
    if has("torchode"):
        runs["torchode per-sample"] = torchode_run(field, x0, t1, args)
    if has("diffrax") and has("jax") and not x0.is_cuda:  # (JAX on the CPU beside a CUDA solve: not a peer)
        runs.update(diffrax_runs(model, x0, t1, args))
    calls = {label: _synchronised(run.call, x0) for label, run in runs.items()}
    for label, run in list(runs.items()):
        if run.inputs is not None:
            calls[f"{label} (own bare loop)"] = _synchronised(bare(field, run.inputs), x0)
    with torch.no_grad():
        times = interleaved_times(calls, reps=args.reps, clock=args.clock)
    return _rows(f"{name} N={size.n} D={size.d}, t1={t1:g}", size, runs, times, STATISTICS[args.statistic])


def _ignored(*_: object) -> None:
    """A progress callback that takes what it is given and does nothing with it."""


def _synchronised(call: Callable[[], object], like: torch.Tensor) -> Callable[[], object]:
    """``call`` waiting for the device's queued work at its end (on CUDA, where kernels run asynchronously)."""
    if not like.is_cuda:
        return call

    def synchronised() -> object:
        result = call()
        torch.cuda.synchronize(like.device)
        return result

    return synchronised


#: the diffrax row (the same method, dopri5) each et-ode row is compared with: the batch as one state, or vmapped
DIFFRAX_PEERS = {
    **dict.fromkeys(
        ["et-ode shared", *(f"et-ode shared, {how}" for how in ("step by step", "torch.compile", "bar", "callback"))],
        "diffrax batched",
    ),
    **dict.fromkeys(
        ["et-ode per-sample", *(f"et-ode per-sample, {how}" for how in ("step by step", "torch.compile"))],
        "diffrax per-sample",
    ),
}
#: the row whose bare loop a row without its own (its steps run no Python) is divided by: its steps one by one
BARE_STAND_INS = {
    **dict.fromkeys(
        ["et-ode shared", *(f"et-ode shared, {how}" for how in ("torch.compile", "bar", "callback"))],
        "et-ode shared, step by step",
    ),
    **dict.fromkeys(["et-ode per-sample", "et-ode per-sample, torch.compile"], "et-ode per-sample, step by step"),
}


def _rows(
    case: str, size: Size, runs: dict[str, Run], times: dict[str, list[float]], statistic: Callable[[list[float]], float]
) -> list[list[object]]:
    """A row per candidate: its time (``statistic`` of its rounds) and its ratios to torchdiffeq, to its own bare
    loop and to its diffrax peer, each the median of the ratios within a round (:func:`paired_ratio`)."""
    reference = runs["torchdiffeq"].final
    scale = reference.abs().max().item()
    rows = []
    for label, run in runs.items():
        own = times.get(f"{BARE_STAND_INS.get(label, label)} (own bare loop)")
        peer = times.get(DIFFRAX_PEERS.get(label, ""))
        rows.append(
            [
                case,
                size.batch,
                label,
                ms(statistic(times[label])),
                f"{paired_ratio(times['torchdiffeq'], times[label]):.2f}",
                f"{paired_ratio(times[label], own):.3f}" if own else "-",
                f"{paired_ratio(times[label], peer):.3f}" if peer else "-",
                run.nfe,
                run.sample_evaluations if run.sample_evaluations >= 0 else "-",
                run.accepted if run.accepted >= 0 else "-",
                f"{(run.final - reference).abs().max().item() / scale:.1e}",
            ]
        )
    return rows


def to_rest(name: str, args: argparse.Namespace) -> list[list[object]]:
    """Every sample integrated until RMS dg/dt < ``--stop-tol``: time, evaluations, the latest stop."""
    size, _ = _case(name, args)
    model = make_model(size)
    field = et_ode.ETField(model)
    x0 = initial_state(size)
    tol = args.stop_tol
    runs = {
        "et-ode shared": et_ode_run(
            field, x0, STOP_T1, et_ode.Adaptive("dopri5", args.rtol, args.atol), et_ode.SteadyState(tol)
        ),
        "et-ode per-sample": et_ode_run(
            field,
            x0,
            STOP_T1,
            et_ode.Adaptive("dopri5", args.rtol, args.atol, step_control="per_sample"),
            et_ode.SteadyState(tol, per_sample=True),
        ),
        "torchdiffeq events, per-sample stops": et_ode_run(
            field,
            x0,
            STOP_T1,
            et_ode.Adaptive("dopri5", args.rtol, args.atol, loop="torchdiffeq"),
            et_ode.SteadyState(tol, per_sample=True),
        ),
    }
    if has("diffrax") and has("jax"):
        runs.update(diffrax_runs(model, x0, STOP_T1, args, stop_tol=tol))
    with torch.no_grad():
        seconds = interleaved(
            {label: run.call for label, run in runs.items()}, args.reps, statistic=args.statistic, clock=args.clock
        )
        measures = {label: field.rms_dg_dt(run.final).max().item() for label, run in runs.items()}
    return [
        [
            f"{name} N={size.n} D={size.d}",
            size.batch,
            label,
            ms(seconds[label]),
            run.nfe,
            run.sample_evaluations if run.sample_evaluations >= 0 else "-",
            f"{measures[label]:.2e}",
        ]
        for label, run in runs.items()
    ]


def mixed(name: str, args: argparse.Namespace) -> list[list[object]]:
    """Half easy, half hard: the shared and per-sample modes' time, evaluations and sample-evaluations."""
    size, t1 = CASES[name]
    field = et_ode.ETField(make_model(size))
    hard = initial_state(size)
    with torch.no_grad():
        easy = et_ode.solve(
            field, initial_state(size, seed=2), (0.0, 50.0), solver=et_ode.Adaptive(rtol=1e-5), save="final"
        ).x
    half = size.batch // 2
    x0 = torch.cat([easy[:half], hard[half:]])
    runs = {
        "et-ode shared": et_ode_run(field, x0, t1, et_ode.Adaptive("dopri5", args.rtol, args.atol)),
        "et-ode per-sample": et_ode_run(
            field, x0, t1, et_ode.Adaptive("dopri5", args.rtol, args.atol, step_control="per_sample")
        ),
    }
    with torch.no_grad():
        seconds = interleaved(
            {label: run.call for label, run in runs.items()}, args.reps, statistic=args.statistic, clock=args.clock
        )
    return [
        [f"{name} mixed", size.batch, label, ms(seconds[label]), run.nfe, run.sample_evaluations, run.accepted]
        for label, run in runs.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(CASES), nargs="+", default=list(CASES))
    parser.add_argument(
        "--batch", type=count_in(1), default=None, help="samples per solve (default: the size's own, 64; ImageNet 4)"
    )
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--statistic", choices=["min", "median"], default="median")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (steadier where other jobs share the cores)",
    )
    parser.add_argument("--threads", type=int, default=1, help="pin the process (torch and XLA) to this many cores")
    parser.add_argument(
        "--inductor", action="store_true", help="also the rows of Adaptive(compile=True) on torch.compile, native off"
    )
    parser.add_argument(
        "--watched", action="store_true", help="also the shared solve with a progress bar, and with a callback"
    )
    parser.add_argument("--stop", action="store_true", help="also the rows to a steady state")
    parser.add_argument("--stop-tol", type=float, default=1e-3, help="the steady state: RMS dg/dt below this")
    parser.add_argument("--mixed", action="store_true", help="also the batch of half easy and half hard samples")
    parser.add_argument(
        "--device", default="cpu", help="the main table's device; cuda adds a row for Adaptive(cuda_graph=True)"
    )
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment())
    headers = [
        "size",
        "batch",
        "solver",
        f"ms ({args.statistic}, {args.clock})",
        "speed-up vs torchdiffeq",
        "x own bare",
        "x diffrax",
    ]
    for name in args.size:  # one table per size, printed as soon as it is measured
        print(
            table(
                [*headers, "NFE", "sample-evals", "accepted", "final vs torchdiffeq"],
                measure(name, args),
                title=f"dopri5, rtol={args.rtol:g}, atol={args.atol:g}, float32, no gradients, {args.threads} "
                f"thread(s), load average {os.getloadavg()[0]:.1f} after the size",
            ),
            flush=True,
        )
    if args.stop:
        rows = [row for name in args.size for row in to_rest(name, args)]
        print(
            table(
                [
                    "size",
                    "batch",
                    "solver",
                    f"ms ({args.statistic}, {args.clock})",
                    "NFE",
                    "sample-evals",
                    "largest RMS dg/dt",
                ],
                rows,
                title=f"to rest: RMS dg/dt < {args.stop_tol:g} (t1 = {STOP_T1:g}), dopri5, rtol={args.rtol:g}",
            )
        )
    if args.mixed:
        rows = [row for name in args.size for row in mixed(name, args)]
        print(
            table(
                ["size", "batch", "solver", f"ms ({args.statistic}, {args.clock})", "NFE", "sample-evals", "accepted"],
                rows,
                title="a batch of half easy (near the attractor) and half hard (random) samples",
            )
        )


if __name__ == "__main__":
    main()
