"""Cost of reaching the attractor: each solver to RMS |dg/dt| < 1e-4, from the same initial states.

For every torchdiffeq method and the paper's scheme (``EulerET``: explicit Euler with alpha = 0.1, run until
the same criterion), reports the field evaluations (NFE; includes the stopping test's evaluations), accepted steps,
stopping time and wall time of ``et_ode.solve(..., stop=SteadyState(tol))``, with the fused field (the default).
Then, at the 28x28 size with batch 64, a dopri5 solve to the same criterion: the fraction of its wall time spent
inside the field, a torch.profiler table of where the time goes, and (where ``jax`` is installed) its wall time
against a jit-compiled JAX Euler loop (the paper's scheme, alpha = 0.1, written in ``benchmarks/field.py`` from
the SPEC) that stops at the same criterion, max over the batch of RMS ``dg/dt`` (exact, by a JVP of the LayerNorm).

    python benchmarks/solvers.py                  # default (8x8 digits size, batch 16; dopri5 profile), ~3 min
    python benchmarks/solvers.py --all-methods    # every torchdiffeq method (the fixed-step ones take minutes)
    python benchmarks/solvers.py --size mnist     # the method table at the 28x28 size too
    python benchmarks/solvers.py --no-jax         # skip the JAX comparison (it runs tens of thousands of steps)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DIGITS, MNIST, Size, environment, initial_state, make_model, set_threads, table  # noqa: E402
from field import ALPHA, jax_field, jax_layer_norm  # noqa: E402

import et_ode  # noqa: E402

ADAPTIVE = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")
DEFAULT_METHODS = ("dopri5", "dopri8", "bosh3", "fehlberg2")
SLOW_METHODS = ("adaptive_heun", "euler", "midpoint", "rk4", "explicit_adams", "implicit_adams")


class TimedField(et_ode.ETField):
    """An ETField that adds up the wall time spent in its evaluations."""

    seconds = 0.0

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = super().forward(t, x)
        self.seconds += time.perf_counter() - start
        return out


def run_method(
    model: et_ode.EnergyTransformer,
    x0: torch.Tensor,
    method: str,
    tol: float,
    t1: float,
    step: float,
    rtol: float,
    atol: float,
    max_steps: int,
) -> list[object]:
    field = et_ode.ETField(model)
    kwargs: dict[str, object] = dict(stop=et_ode.SteadyState(tol), save="final", max_steps=max_steps)
    if method == "et":
        kwargs.update(solver=et_ode.EulerET(ALPHA, int(t1 / ALPHA)))
        label = f"et (paper: Euler, alpha={ALPHA})"
    elif method in ADAPTIVE:
        kwargs.update(t=(0.0, t1), solver=et_ode.Adaptive(method, rtol, atol))
        label = f"{method} (rtol={rtol:g}, atol={atol:g})"
    else:
        kwargs.update(t=(0.0, t1), solver=et_ode.Fixed(method, step))
        label = f"{method} (step={step:g})"
    start = time.perf_counter()
    try:
        with torch.no_grad():
            solution = et_ode.solve(field, x0, **kwargs)
    except et_ode.SolveError as error:
        return [label, "failed", "", "", "", time.perf_counter() - start, str(error)[:60]]
    stats = solution.stats
    return [
        label,
        stats.status.value,
        stats.nfe_forward,
        stats.accepted_steps,
        stats.t_final,
        stats.wall_time,
        f"{float(solution.residual.max()):.2e}",
    ]


def method_table(size: Size, methods: list[str], args: argparse.Namespace) -> str:
    model = make_model(size, hopfield=args.hopfield)
    x0 = initial_state(size)
    with torch.no_grad():  # warm-up (GEMM back-end choice, allocator), so that the first method's time compares
        et_ode.solve(et_ode.ETField(model), x0, t=(0.0, 1.0), solver=et_ode.Adaptive(), save="final")
    rows = []
    for method in methods:
        print(f"  {method} ...", flush=True)
        rows.append(run_method(model, x0, method, args.tol, args.t1, args.step, args.rtol, args.atol, args.max_steps))
    return table(
        ["method", "status", "NFE", "steps", "t stop", "wall s", "max RMS dg/dt / error"],
        rows,
        f"To RMS |dg/dt| < {args.tol:g}: {size.name} (N={size.n}, D={size.d}, H={size.h}, Y={size.y}, "
        f"K={size.k}), batch {size.batch}, float32, hopfield={args.hopfield}",
    )


def _steady_state_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """``solve`` options of an adaptive solve to the command line's steady-state criterion."""
    return dict(
        t=(0.0, args.t1),
        solver=et_ode.Adaptive("dopri5", args.rtol, args.atol),
        stop=et_ode.SteadyState(args.tol),
        save="final",
        max_steps=args.max_steps,
    )


def profile_dopri5(size: Size, args: argparse.Namespace) -> str:
    """Fraction of a dopri5 solve's wall time spent in the field, and the profiler's op table."""
    model = make_model(size, hopfield=args.hopfield)
    x0 = initial_state(size)
    field = TimedField(model)
    with torch.no_grad():  # warm-up (GEMM back-end choice, allocator)
        field(torch.zeros(()), x0)
    field.seconds = 0.0
    kwargs = _steady_state_kwargs(args)
    with torch.no_grad():
        start = time.perf_counter()
        solution = et_ode.solve(field, x0, **kwargs)
        wall = time.perf_counter() - start
    in_field = field.seconds
    nfe = solution.stats.nfe_forward
    summary = table(
        ["quantity", "value"],
        [
            ["status", solution.stats.status.value],
            ["NFE (incl. stopping test)", nfe],
            ["accepted steps", solution.stats.accepted_steps],
            ["t stop", solution.stats.t_final],
            ["wall time of solve() [s]", wall],
            ["time inside the field [s]", in_field],
            ["fraction of wall time in the field", in_field / wall],
            ["ms per field evaluation", 1e3 * in_field / nfe],
        ],
        f"dopri5 to RMS |dg/dt| < {args.tol:g}: {size.name}, batch {size.batch} (fused field, float32)",
    )
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        et_ode.solve(et_ode.ETField(model), x0, **kwargs)
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return summary + "\n\ntorch.profiler, the same solve (self CPU time per op):\n" + ops


def jax_euler_to_steady_state(
    model: et_ode.EnergyTransformer, x0: torch.Tensor, tol: float, max_steps: int
) -> tuple[int, float, float] | None:
    """Euler steps ``x += ALPHA dx/dt`` in one jit-compiled ``lax.while_loop`` until the max over samples of RMS
    ``dg/dt`` is below ``tol``: (steps, wall seconds without compilation, final max RMS); None without jax."""
    field = jax_field(model)
    if field is None:
        return None
    import jax
    import jax.numpy as jnp

    layer_norm = jax_layer_norm(model)

    def measure(x, v):  # max over samples of RMS dg/dt, dg/dt = d LayerNorm(x) [v]
        dg = jax.jvp(layer_norm, (x,), (v,))[1]
        return jnp.sqrt((dg**2).mean(axis=(-1, -2))).max()

    def body(state):
        x, v, steps, _ = state
        x = x + ALPHA * v
        v = field(x)
        return x, v, steps + 1, measure(x, v)

    @jax.jit
    def run(x, limit):
        v = field(x)
        state = (x, v, jnp.int32(0), measure(x, v))
        return jax.lax.while_loop(lambda s: (s[3] >= tol) & (s[2] < limit), body, state)

    xj = x0.numpy()
    jax.block_until_ready(run(xj, 1))  # compile (the step limit is traced: no recompilation below)
    start = time.perf_counter()
    _, _, steps, rms = jax.block_until_ready(run(xj, max_steps))
    return int(steps), time.perf_counter() - start, float(rms)


def versus_jax(size: Size, args: argparse.Namespace) -> str:
    """Wall time to RMS dg/dt < tol: et_ode's dopri5 solve against the JAX Euler loop, same model and states."""
    model = make_model(size, hopfield="relu")
    x0 = initial_state(size)
    field = et_ode.ETField(model)
    kwargs = _steady_state_kwargs(args)
    with torch.no_grad():
        et_ode.solve(field, x0, **{**kwargs, "t": (0.0, 1.0)})  # warm-up
        start = time.perf_counter()
        solution = et_ode.solve(field, x0, **kwargs)
        ours = time.perf_counter() - start
    jax_result = jax_euler_to_steady_state(model, x0, args.tol, args.jax_max_steps)
    rows = [
        [
            "et_ode.solving.solve dopri5 (fused)",
            solution.stats.nfe_forward,
            solution.stats.t_final,
            f"{float(solution.residual.max()):.2e}",
            ours,
            1.0,
        ]
    ]
    if jax_result is not None:
        steps, seconds, rms = jax_result
        reached = "" if rms < args.tol else f" (stopped at the limit {args.jax_max_steps}: a lower bound)"
        rows.append(
            [
                f"JAX Euler, alpha={ALPHA}, lax.while_loop{reached}",
                steps,
                steps * ALPHA,
                f"{rms:.2e}",
                seconds,
                seconds / ours,
            ]
        )
    return table(
        ["solver", "NFE / steps", "t stop", "max RMS dg/dt", "wall s", "JAX time / this"],
        rows,
        f"To max RMS |dg/dt| < {args.tol:g}: {size.name}, batch {size.batch}, hopfield=relu, float32",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["digits", "mnist"], default="digits", help="size of the method table")
    parser.add_argument("--batch", type=int, default=16, help="batch of the method table")
    parser.add_argument("--tol", type=float, default=1e-4, help="steady-state criterion on RMS |dg/dt|")
    parser.add_argument("--t1", type=float, default=5000.0, help="give up at this time")
    parser.add_argument("--step", type=float, default=0.2, help="step of the fixed-step torchdiffeq methods")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--hopfield", default="relu", choices=["relu", "softplus", "softmax"])
    parser.add_argument(
        "--all-methods",
        action="store_true",
        help="add adaptive_heun, euler, midpoint, rk4, explicit_adams, implicit_adams (slow)",
    )
    parser.add_argument("--profile-batch", type=int, default=64, help="batch of the 28x28 dopri5 profile (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="pin the process to this many cores (default: all)")
    parser.add_argument("--no-jax", action="store_true", help="skip the comparison with the JAX Euler loop")
    parser.add_argument("--jax-max-steps", type=int, default=200_000, help="step limit of the JAX Euler loop")
    parser.add_argument("--only-jax", action="store_true", help="run only the 28x28 comparison with JAX")
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment())
    methods = [*DEFAULT_METHODS, *(SLOW_METHODS if args.all_methods else ()), "et"]
    size = (DIGITS if args.size == "digits" else MNIST).with_batch(args.batch)
    if not args.only_jax:
        print(f"method table: {size.name}, batch {size.batch}", flush=True)
        print(method_table(size, methods, args))
        if args.profile_batch > 0:
            print(f"profiling dopri5: {MNIST.name}, batch {args.profile_batch}", flush=True)
            print(profile_dopri5(MNIST.with_batch(args.profile_batch), args))
    if args.profile_batch > 0 and not args.no_jax:
        print(f"dopri5 against the JAX Euler loop: {MNIST.name}, batch {args.profile_batch}", flush=True)
        print(versus_jax(MNIST.with_batch(args.profile_batch), args))


if __name__ == "__main__":
    main()
