"""et-ode against the official JAX formulation at the three standard sizes, and the cost of the adjoint's backward.

Sizes (float32, CPU): 8x8 digits (N=17, D=64, H=4, Y=16, K=256, batch 64), 28x28 (N=50, D=128, H=4, Y=32, K=512,
batch 64) and ImageNet (N=197, D=768, H=12, Y=64, K=3072, batch 4). The JAX code is written from the SPEC's
formulas (``_common.jax_field``: ``jit(-grad(E)(LayerNorm(x)))``), as the official release computes it; every row
is timed interleaved with its JAX counterpart in one run, so the ratios hold on a machine shared with other jobs.

Per size, one table row each:

- ``field``: one evaluation of ``dx/dt`` (``ETField``, no gradients) against the jit-compiled JAX field;
- ``12-step solve``: the public ``et_ode.solve(field, x0, solver=EulerET(0.1, 12), save="final")`` against
  one jit-compiled ``lax.fori_loop`` of 12 Euler steps;
- ``solve overhead``: that solve against a bare Python loop of the same 12 field calls (``x = x + 0.1 * f(t, x)``);
- ``training step``: the 12-step solve with gradients (``gradient="direct"``), a squared error of the final ``g`` and
  ``backward()`` to every parameter, against ``jax.jit(jax.grad(loss))`` of the unrolled 12-step loop (the same
  parameters: WK, WQ, xi, delta, gamma).

Then (``--adjoint-sizes``) one training step with continuous-time gradients at the digits and 28x28 sizes: the
forward and backward evaluations and seconds of Euler-12 direct, Euler-12 adjoint and dopri5 with the adjoint at
several tolerances, with and without the seminorm (the backward's error control ignores the parameters' adjoint),
the same solves on torchdiffeq's loop and adjoint, and the implicit gradient at the attractor (dopri5 until RMS
``dg/dt`` < 1e-4, then conjugate gradients on the Riemannian Hessian: its backward evaluations are Hessian-vector
products).

    pip install jax                                       # in .venv; not a dependency of the package
    python benchmarks/versus_jax.py --reps 15             # every core (the machine's default); ~8 min on 2 cores
    python benchmarks/versus_jax.py --threads 1 --reps 15 --adjoint-sizes ""    # one core each, ~3 min
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python benchmarks/versus_jax.py --reps 15  # XLA's code limited to AVX2
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 XLA_FLAGS=--xla_cpu_max_isa=AVX2 \\
        python benchmarks/versus_jax.py       # torch's libraries on AVX2 (XLA's products keep AVX-512: not an AVX2 machine)

``--clock cpu`` times the process's CPU time (all threads) instead of the wall clock: on a loaded machine the wall
clock also counts the waits for a core, which grow with the length of the timed call.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    CLOCKS,
    DIGITS,
    IMAGENET,
    MNIST,
    Size,
    environment,
    initial_state,
    interleaved,
    jax_field,
    make_model,
    ms,
    set_threads,
    table,
)

import et_ode  # noqa: E402

ALPHA, STEPS = 0.1, 12
SIZES = {"digits": DIGITS, "mnist": MNIST, "imagenet4": IMAGENET}


def jax_functions(model: et_ode.EnergyTransformer) -> dict[str, Callable[..., object]]:
    """The jit-compiled JAX field, 12-step loop and training step (value and gradient of the unrolled loop's loss),
    from SPEC sections 1-4, with the model's parameters as a dict."""
    import jax
    import jax.numpy as jnp

    et = jax_field(model)
    params, layer_norm, field = et.params, et.layer_norm, et.field

    def euler(p, x):
        return jax.lax.fori_loop(0, STEPS, lambda i, y: y + ALPHA * field(p, y), x)

    def loss(p, x, target):
        for _ in range(STEPS):  # unrolled, as the training step differentiates it
            x = x + ALPHA * field(p, x)
        return jnp.mean((layer_norm(p, x) - target) ** 2)

    field_jit, euler_jit, grad_jit = jax.jit(field), jax.jit(euler), jax.jit(jax.value_and_grad(loss))
    return {
        "field": lambda x: field_jit(params, x),
        "euler": lambda x: euler_jit(params, x),
        "train": lambda x, target: grad_jit(params, x, target),
    }


def torch_training_step(
    field: et_ode.ETField, x0: torch.Tensor, target: torch.Tensor, **solve_options: object
) -> tuple[float, float, int, int]:
    """Forward and backward seconds (wall) of one training step, and its forward and backward evaluations."""
    field.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    solution = et_ode.solve(field, x0, save="final", **solve_options)
    loss = (solution.g - target).square().mean()
    forward = time.perf_counter() - start
    start = time.perf_counter()
    loss.backward()
    return forward, time.perf_counter() - start, solution.stats.nfe_forward, solution.stats.nfe_backward


def compare_size(size: Size, reps: int, statistic: str, clock: str) -> list[list[object]]:
    import jax
    import numpy as np

    model = make_model(size)
    x = initial_state(size)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    field = et_ode.ETField(model)
    jax_code = jax_functions(model)
    xj, target_j = x.numpy(), target.numpy()
    t0 = torch.zeros(())
    with torch.no_grad():  # the two codes compute the same field
        error = float((torch.from_numpy(np.array(jax_code["field"](xj))) - field(t0, x)).abs().max())
    heads = et_ode.kernels.gemm.choose_head_products(size.batch * size.h, size.n, size.y, x.dtype, x.device)
    print(f"  {size.name}: max |JAX field - et_ode field| = {error:.2e}; per-head products on {heads}", flush=True)

    def bare_loop() -> torch.Tensor:
        y = x
        for _ in range(STEPS):
            y = y + ALPHA * field(t0, y)
        return y

    def train_step() -> None:
        model.zero_grad(set_to_none=True)
        solution = et_ode.solve(field, x, solver=et_ode.EulerET(ALPHA, STEPS), save="final")
        (solution.g - target).square().mean().backward()

    with torch.no_grad():
        times = interleaved(
            {
                "field": lambda: field(t0, x),
                "jax field": lambda: jax.block_until_ready(jax_code["field"](xj)),
                "bare loop": bare_loop,
                "solve": lambda: et_ode.solve(field, x, solver=et_ode.EulerET(ALPHA, STEPS), save="final"),
                "jax loop": lambda: jax.block_until_ready(jax_code["euler"](xj)),
            },
            reps,
            statistic=statistic,
            clock=clock,
        )
    train_times = interleaved(
        {
            "train": train_step,
            "jax train": lambda: jax.block_until_ready(jax_code["train"](xj, target_j)),
        },
        max(3, reps // 3),
        statistic=statistic,
        clock=clock,
    )
    label = f"{size.name}, batch {size.batch}"
    return [
        [label, "field", ms(times["field"]), ms(times["jax field"]), times["jax field"] / times["field"]],
        [label, f"{STEPS}-step solve", ms(times["solve"]), ms(times["jax loop"]), times["jax loop"] / times["solve"]],
        [
            label,
            f"solve overhead over a bare loop of {STEPS} field calls",
            ms(times["solve"]),
            ms(times["bare loop"]),
            f"{100 * (times['solve'] / times['bare loop'] - 1):+.1f}%",
        ],
        [
            label,
            "training step (forward + backward)",
            ms(train_times["train"]),
            ms(train_times["jax train"]),
            train_times["jax train"] / train_times["train"],
        ],
    ]


_LOOSE, _TIGHT = et_ode.Adaptive(rtol=1e-3, atol=1e-4), et_ode.Adaptive(rtol=1e-5, atol=1e-6)
_SPAN = (0.0, ALPHA * STEPS)
_ATTRACTOR_HORIZON = 1e5  # far beyond the stop: every sample of these models settles by t ~ 2,000
ADJOINT_CONFIGS: dict[str, dict[str, object]] = {
    "Euler-12, direct": dict(solver=et_ode.EulerET(ALPHA, STEPS)),
    "Euler-12, adjoint": dict(solver=et_ode.EulerET(ALPHA, STEPS), gradient="adjoint"),
    "dopri5 rtol 1e-3, direct": dict(t=_SPAN, solver=_LOOSE),
    "dopri5 rtol 1e-3, adjoint": dict(t=_SPAN, solver=_LOOSE, gradient="adjoint"),
    "dopri5 rtol 1e-3, adjoint, seminorm": dict(t=_SPAN, solver=_LOOSE, gradient=et_ode.Adjoint(seminorm=True)),
    "dopri5 rtol 1e-5, adjoint": dict(t=_SPAN, solver=_TIGHT, gradient="adjoint"),
    "dopri5 rtol 1e-5, adjoint, seminorm": dict(t=_SPAN, solver=_TIGHT, gradient=et_ode.Adjoint(seminorm=True)),
    "dopri5 rtol 1e-5, adjoint rtol 1e-3, seminorm": dict(
        t=_SPAN, solver=_TIGHT, gradient=et_ode.Adjoint(rtol=1e-3, atol=1e-4, seminorm=True)
    ),
    # the same solves on torchdiffeq's loop and its adjoint (odeint_adjoint), beside et-ode's
    "dopri5 rtol 1e-3, torchdiffeq's loop and adjoint, seminorm": dict(
        t=_SPAN, solver=dataclasses.replace(_LOOSE, loop="torchdiffeq"), gradient=et_ode.Adjoint(seminorm=True)
    ),
    "dopri5 rtol 1e-5, torchdiffeq's loop and adjoint, seminorm": dict(
        t=_SPAN, solver=dataclasses.replace(_TIGHT, loop="torchdiffeq"), gradient=et_ode.Adjoint(seminorm=True)
    ),
    # not to t = 1.2: to the attractor (RMS dg/dt < 1e-4), the gradient by the implicit function theorem there; in
    # float32 conjugate gradients stall near a relative residual of 1e-6 (the Hessian-vector products' rounding), so
    # they stop at 1e-4 here (the default 1e-8 is for float64: in float32 it runs its 200 iterations and warns)
    "implicit at the attractor (dopri5 rtol 1e-3 to RMS dg/dt < 1e-4, CG to 1e-4)": dict(
        t=(0.0, _ATTRACTOR_HORIZON), solver=_LOOSE, stop=et_ode.SteadyState(1e-4), gradient=et_ode.Implicit(tol=1e-4)
    ),
}


def adjoint_costs(size: Size, reps: int, statistic: str) -> list[list[object]]:
    """One training step per configuration, configurations interleaved, ``reps`` rounds (wall seconds)."""
    model = make_model(size)
    x = initial_state(size)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    field = et_ode.ETField(model)
    results: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name in ADJOINT_CONFIGS}
    for options in ADJOINT_CONFIGS.values():  # warm-up (GEMM choice, caches)
        torch_training_step(field, x, target, **options)
    for _ in range(reps):
        for name, options in ADJOINT_CONFIGS.items():
            results[name].append(torch_training_step(field, x, target, **options))
    pick = {"min": min, "median": statistics.median}[statistic]
    base = pick(f + b for f, b, _, _ in results["Euler-12, direct"])
    rows = []
    for name, runs in results.items():
        forward, backward = pick(r[0] for r in runs), pick(r[1] for r in runs)
        step = pick(r[0] + r[1] for r in runs)
        rows.append(
            [
                f"{size.name}, batch {size.batch}",
                name,
                runs[0][2],
                runs[0][3],
                ms(forward),
                ms(backward),
                backward / forward,
                step / base,
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per candidate")
    parser.add_argument("--threads", type=int, default=None, help="pin torch and XLA to this many cores")
    parser.add_argument("--sizes", default="digits,mnist,imagenet4", help="subset of digits, mnist, imagenet4 ('' none)")
    parser.add_argument("--adjoint-sizes", default="digits,mnist", help="sizes of the adjoint table ('' for none)")
    parser.add_argument("--adjoint-reps", type=int, default=3, help="rounds of the adjoint table")
    parser.add_argument("--stat", choices=["min", "median"], default="min", help="statistic over repetitions")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall clock or process CPU time")
    args = parser.parse_args()
    set_threads(args.threads)
    print(environment())
    print(
        f"float32; {args.stat} of interleaved repetitions, {args.clock} clock; ratio = JAX time / et_ode time "
        "(> 1: et_ode faster)"
    )
    chosen = [SIZES[name] for name in args.sizes.split(",") if name]
    if chosen:
        try:
            import jax  # noqa: F401
        except ImportError:
            sys.exit("jax is not installed: pip install jax (into the same environment)")
        rows = []
        for size in chosen:
            rows.extend(compare_size(size, args.reps, args.stat, args.clock))
        print(
            table(
                ["size", "what", "et_ode ms", "JAX ms (overhead row: bare loop ms)", "ratio"],
                rows,
                "et_ode against the official JAX formulation",
            )
        )
    adjoint_sizes = [SIZES[name] for name in args.adjoint_sizes.split(",") if name]
    adjoint_rows = []
    for size in adjoint_sizes:
        print(f"  adjoint table: {size.name} ...", flush=True)
        adjoint_rows.extend(adjoint_costs(size, args.adjoint_reps, args.stat))
    if adjoint_rows:
        print(
            table(
                [
                    "size",
                    "training step",
                    "NFE forward",
                    "NFE backward",
                    "forward ms",
                    "backward ms",
                    "backward / forward",
                    "step / Euler-12 direct",
                ],
                adjoint_rows,
                f"One training step (t from 0 to {ALPHA * STEPS:g}, the implicit row to the attractor; squared error of "
                f"the final g, all parameters; "
                f"wall clock, {args.stat} of {args.adjoint_reps} interleaved rounds)",
            )
        )


if __name__ == "__main__":
    main()
