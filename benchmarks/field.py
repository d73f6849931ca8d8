"""Speed of one evaluation of the ET vector field, its vector-Jacobian product, and 12 Euler steps.

For three sizes (8x8 digits N=17 D=64; 28x28 N=50 D=128; ImageNet N=197 D=768 H=12 Y=64 K=3072),
times per evaluation of ``dx/dt`` in float32 on CPU by:

- ``reference``: the model's closed form (``ETField(backend="reference")``),
- ``fused``: :mod:`et_ode.kernels.fused` with its automatic GEMM back end (``backend="fused"``, the default path),
- ``fused/matmul``: the fused path forced onto ``torch.matmul``,
- ``autograd``: differentiating the energy (``grad="autograd"``),
- ``jax``: a jit-compiled energy-and-gradient written here from SPEC sections 1-4 (only if jax is installed),

with GFLOP/s by SPEC section 7's count and that as a fraction of the fastest float32 matrix product
torch offers at the size of the field's projection (timed in the same interleaved run). Then the VJP of the
field (w.r.t. the state and all parameters) against one evaluation, and 12 Euler steps (alpha = 0.1) at
ImageNet size with batch 4 and 1.

    python benchmarks/field.py                # default, about 2-3 minutes on 2 cores
    python benchmarks/field.py --reps 30      # steadier medians
    python benchmarks/field.py --threads 1    # torch and XLA pinned to one core: steadier on a shared machine
    python benchmarks/field.py --against ../other-checkout   # this tree's field beside another's, interleaved
    OMP_WAIT_POLICY=PASSIVE python benchmarks/field.py   # several threads on a shared machine (see below)

On a machine shared with other jobs, torch's OpenMP threads spin at every barrier and lose their time slices to
the other jobs; ``OMP_WAIT_POLICY=PASSIVE`` (read when torch loads) makes them sleep instead, which measured
several times faster there. XLA's thread pool does not spin this way.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DIGITS,
    IMAGENET,
    MNIST,
    Size,
    environment,
    gemm_candidates,
    initial_state,
    interleaved,
    make_model,
    ms,
    set_threads,
    table,
)

import et_ode  # noqa: E402
from et_ode.kernels.fused import FusedGrad  # noqa: E402

ALPHA = 0.1
STATISTIC = "min"  # set by --stat


def jax_layer_norm(model: et_ode.EnergyTransformer) -> Callable[[object], object]:
    """``x -> g = LayerNorm(x)`` of the model's neuron in jax.numpy (SPEC section 1); needs jax."""
    import jax.numpy as jnp

    delta = jnp.asarray(model.neuron.delta.detach().numpy())
    gamma, eps = float(model.neuron.gamma.detach()), model.neuron.eps

    def layer_norm(x):
        xt = x - x.mean(axis=-1, keepdims=True)
        return gamma * xt / jnp.sqrt((xt**2).mean(axis=-1, keepdims=True) + eps) + delta

    return layer_norm


def jax_field(model: et_ode.EnergyTransformer) -> Callable[[object], object] | None:
    """``x -> -dE/dg(LayerNorm(x))`` compiled by XLA, from SPEC sections 1-4; None without jax."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    wk, wq = (jnp.asarray(w.detach().numpy()) for w in (model.attention.WK, model.attention.WQ))
    xi = jnp.asarray(model.hopfield.xi.detach().numpy())
    layer_norm = jax_layer_norm(model)
    beta = float(model.attention.beta[0])
    self_attention = model.attention.self_attention

    def energy(g):  # g: (batch, N, D)
        k = jnp.einsum("hyd,bnd->bhny", wk, g)
        q = jnp.einsum("hyd,bnd->bhny", wq, g)
        logits = beta * jnp.einsum("bhky,bhqy->bhkq", k, q)  # [key B, query C]
        if not self_attention:
            n = g.shape[-2]
            logits = jnp.where(jnp.eye(n, dtype=bool), -jnp.inf, logits)
        e_att = -jnp.sum(jax.nn.logsumexp(logits, axis=-2)) / beta
        e_hn = -0.5 * jnp.sum(jax.nn.relu(g @ xi.T) ** 2)
        return e_att + e_hn

    grad_energy = jax.grad(energy)

    def field(x):
        return -grad_energy(layer_norm(x))

    return jax.jit(field)


def jax_euler(field: Callable[[object], object], steps: int) -> Callable[[object], object]:
    import jax

    return jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda i, y: y + ALPHA * field(y), x))


def bench_size(size: Size, reps: int, with_jax: bool, compile_reference: bool) -> list[list[object]]:
    model = make_model(size)
    x = initial_state(size)
    fields = {
        "reference": et_ode.ETField(model, backend="reference"),
        "fused": et_ode.ETField(model, backend="fused"),
        "autograd": et_ode.ETField(model, derivative="autograd"),
    }
    matmul_only = FusedGrad(model, gemm="matmul")
    t0 = torch.zeros(())
    candidates: dict[str, Callable[[], object]] = {name: (lambda f=f: f(t0, x)) for name, f in fields.items()}
    candidates["fused/matmul"] = lambda: -matmul_only(model.neuron(x))
    if compile_reference:
        compiled = torch.compile(fields["reference"].velocity, dynamic=False)
        candidates["torch.compile(reference)"] = lambda: compiled(x)
    jfield = jax_field(model) if with_jax else None
    if jfield is not None:
        xj = x.numpy()
        candidates["jax"] = lambda: jfield(xj).block_until_ready()
        with torch.no_grad():
            error = float((torch.from_numpy(np.array(jfield(xj))) - fields["reference"](t0, x)).abs().max())
        print(f"  jax vs reference max |difference|: {error:.2e}")
    r = 2 * size.h * size.y + size.k
    candidates.update(gemm_candidates(size.batch * size.n, size.d, r))
    with torch.no_grad():
        times = interleaved(candidates, reps, statistic=STATISTIC)
    gemm_rate = max(2 * size.batch * size.n * size.d * r / t for name, t in times.items() if name.startswith("GEMM"))
    flops = size.flops()
    rows = []
    for name, seconds in times.items():
        if name.startswith("GEMM"):
            rate = 2 * size.batch * size.n * size.d * r / seconds
            rows.append(
                [
                    size.name,
                    size.batch,
                    name + f" ({size.batch * size.n}x{size.d} @ {size.d}x{r})",
                    ms(seconds),
                    "",
                    rate / 1e9,
                    rate / gemm_rate,
                ]
            )
        else:
            rows.append(
                [
                    size.name,
                    size.batch,
                    name,
                    ms(seconds),
                    times["reference"] / seconds,
                    flops / seconds / 1e9,
                    flops / seconds / gemm_rate,
                ]
            )
    return rows


def bench_vjp(size: Size, reps: int) -> list[list[object]]:
    """VJP of the field w.r.t. the state and every parameter, against one evaluation (no grad)."""
    model = make_model(size)
    x = initial_state(size)
    params = tuple(model.parameters())
    rows = []
    for backend in ("fused", "reference"):
        times = _vjp_times(et_ode.ETField(model, backend=backend), x, params, reps)
        rows.append(
            [
                size.name,
                size.batch,
                backend,
                ms(times["eval"]),
                ms(times["fwd+bwd"]),
                times["fwd+bwd"] / times["eval"],
                times["bwd"] / times["eval"],
                times["bwd_x"] / times["eval"],
            ]
        )
    return rows


def _vjp_times(field: et_ode.ETField, x: torch.Tensor, params: tuple[torch.Tensor, ...], reps: int) -> dict[str, float]:
    t0 = torch.zeros(())
    xg = x.clone().requires_grad_(True)
    u = torch.randn_like(x)
    with torch.enable_grad():
        recorded = field(t0, xg)

    def evaluate() -> object:
        with torch.no_grad():
            return field(t0, x)

    def forward_backward() -> object:
        with torch.enable_grad():
            return torch.autograd.grad(field(t0, xg), (xg, *params), u)

    def backward() -> object:
        return torch.autograd.grad(recorded, (xg, *params), u, retain_graph=True)

    def backward_state() -> object:
        return torch.autograd.grad(recorded, (xg,), u, retain_graph=True)

    return interleaved(
        {"eval": evaluate, "fwd+bwd": forward_backward, "bwd": backward, "bwd_x": backward_state}, reps, statistic=STATISTIC
    )


def bench_euler(size: Size, reps: int, with_jax: bool, steps: int = 12) -> list[list[object]]:
    model = make_model(size)
    x = initial_state(size)
    t0 = torch.zeros(())
    candidates: dict[str, Callable[[], object]] = {}
    for backend in ("reference", "fused"):
        field = et_ode.ETField(model, backend=backend)

        def euler(field=field) -> object:
            y = x
            for _ in range(steps):
                y = y + ALPHA * field(t0, y)
            return y

        candidates[backend] = euler
    fused_field = et_ode.ETField(model)
    candidates["fused via et_ode.solve(EulerET)"] = lambda: et_ode.solve(
        fused_field, x, solver=et_ode.EulerET(ALPHA, steps), save="final"
    )
    jfield = jax_field(model) if with_jax else None
    if jfield is not None:
        run = jax_euler(jfield, steps)
        xj = x.numpy()
        candidates["jax (lax.fori_loop)"] = lambda: run(xj).block_until_ready()
    r = 2 * size.h * size.y + size.k
    gemms = gemm_candidates(size.batch * size.n, size.d, r)
    candidates.update(gemms)
    with torch.no_grad():
        times = interleaved(candidates, reps, statistic=STATISTIC)
    gemm_rate = max(2 * size.batch * size.n * size.d * r / times[name] for name in gemms)
    flops = steps * size.flops()
    rows = []
    for name, seconds in times.items():
        if name.startswith("GEMM"):
            continue
        jax_ratio = times.get("jax (lax.fori_loop)", math.nan) / seconds
        rows.append(
            [
                size.batch,
                name,
                ms(seconds),
                times["reference"] / seconds,
                jax_ratio,
                flops / seconds / 1e9,
                flops / seconds / gemm_rate,
            ]
        )
    return rows


SIZES = {"digits": DIGITS, "mnist": MNIST, "imagenet4": IMAGENET, "imagenet1": IMAGENET.with_batch(1)}
AGAINST_CALLS = ("dx/dt", "VJP")


def serve(sizes: list[str]) -> None:
    """The worker of ``--against``: the default field of every size in ``sizes`` (this process's ``et_ode``), timed on
    request. Reads ``size call`` lines (indices into ``sizes`` and :data:`AGAINST_CALLS`) and answers each with the
    seconds of one timed call, after one untimed call (the hand-over from the other worker)."""
    fields, states, params = [], [], []
    for name in sizes:
        model = make_model(SIZES[name])
        fields.append(et_ode.ETField(model))
        states.append(initial_state(SIZES[name]))
        params.append(tuple(model.parameters()))

    def call(index: int, what: str) -> object:
        if what == "dx/dt":
            with torch.no_grad():
                return fields[index](None, states[index])
        x = states[index].clone().requires_grad_(True)
        out = fields[index](None, x)
        return torch.autograd.grad(out, (x, *params[index]), torch.ones_like(out))

    print("ready", flush=True)
    for line in sys.stdin:
        index, what = int(line.split()[0]), AGAINST_CALLS[int(line.split()[1])]
        call(index, what)
        start = time.perf_counter()
        call(index, what)
        print(time.perf_counter() - start, flush=True)


def against(other: Path, sizes: list[str], reps: int, threads: int | None) -> None:
    """This tree's default field beside the one of the checkout at ``other``, at each size, in one interleaved run:
    two worker processes (:func:`serve`, one ``et_ode`` each), asked in turn, the minimum over ``reps`` kept."""
    here = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", ",".join(sizes)]
    command += ["--threads", str(threads)] if threads is not None else []
    workers = {}
    for label, root in (("this tree", here), (str(other), other.resolve())):
        env = {**os.environ, "PYTHONPATH": str(root), "ET_ODE_THREAD_CHECK": "0"}
        workers[label] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert workers[label].stdout is not None and workers[label].stdout.readline().strip() == "ready"
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(reps):
        for index in range(len(sizes)):
            for call in range(len(AGAINST_CALLS)):
                for label, worker in workers.items():
                    assert worker.stdin is not None and worker.stdout is not None
                    worker.stdin.write(f"{index} {call}\n")
                    worker.stdin.flush()
                    times.setdefault((label, index, call), []).append(float(worker.stdout.readline()))
    for worker in workers.values():
        assert worker.stdin is not None
        worker.stdin.close()
        worker.wait()
    labels = list(workers)
    rows = []
    for index, name in enumerate(sizes):
        for call, what in enumerate(AGAINST_CALLS):
            mine, theirs = (min(times[(label, index, call)]) for label in labels)
            rows.append([SIZES[name].name, SIZES[name].batch, what, ms(mine), ms(theirs), theirs / mine])
    print(
        table(
            ["size", "batch", "call", f"ms ({labels[0]})", f"ms ({labels[1]})", "other / this"],
            rows,
            f"The default field, this tree against {labels[1]} (float32, min of {reps} interleaved repetitions)",
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per candidate (median reported)")
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX column even if jax is installed")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pin torch and XLA to this many cores (default: all, each library's own threads)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="add a torch.compile'd reference field (compiling takes minutes)"
    )
    parser.add_argument(
        "--sizes",
        default="digits,mnist,imagenet4,imagenet1",
        help="comma-separated subset of digits, mnist, imagenet4, imagenet1",
    )
    parser.add_argument("--stat", choices=["min", "median"], default="min", help="statistic over repetitions")
    parser.add_argument(
        "--against",
        type=Path,
        metavar="PATH",
        help="only time this tree's default field (dx/dt and its VJP) beside the one of the checkout at PATH",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the worker of --against
    args = parser.parse_args()
    set_threads(args.threads)
    if args.serve:
        serve(args.serve.split(","))
        return
    if args.against is not None:
        against(args.against, args.sizes.split(","), args.reps, args.threads)
        return
    global STATISTIC
    STATISTIC = args.stat
    try:
        import jax  # noqa: F401

        with_jax = not args.no_jax
    except ImportError:
        with_jax = False
    print(f"{environment()}; jax column: {'yes' if with_jax else 'no (jax not installed or --no-jax)'}")
    print(
        f"float32, CPU; times are the {args.stat} of interleaved repetitions; 'x ref' = reference time / this time; "
        "'of GEMM' = achieved GFLOP/s / fastest float32 GEMM's GFLOP/s at the projection's size, same run"
    )

    rows = []
    chosen = [SIZES[name] for name in args.sizes.split(",")]
    for size in chosen:
        print(f"timing the field: {size.name}, batch {size.batch} ...", flush=True)
        rows.extend(bench_size(size, args.reps, with_jax, args.compile))
    print(
        table(
            ["size", "batch", "mode", "ms / eval", "x ref", "GFLOP/s", "of GEMM"],
            rows,
            "One field evaluation dx/dt (float32)",
        )
    )

    vjp_rows = []
    for size in [size for size in chosen if size.batch != 1]:
        print(f"timing the VJP: {size.name} ...", flush=True)
        vjp_rows.extend(bench_vjp(size, max(5, args.reps // 2)))
    print(
        table(
            ["size", "batch", "backend", "ms / eval", "ms fwd+bwd", "fwd+bwd / eval", "bwd / eval", "bwd (x only) / eval"],
            vjp_rows,
            "VJP of the field w.r.t. x and all parameters (bwd = backward of a recorded evaluation)",
        )
    )

    euler_rows = []
    for batch in [size.batch for size in chosen if size.n == IMAGENET.n]:
        print(f"timing 12 Euler steps: ImageNet size, batch {batch} ...", flush=True)
        euler_rows.extend(bench_euler(IMAGENET.with_batch(batch), max(5, args.reps // 2), with_jax))
    print(
        table(
            ["batch", "mode", "ms / 12 steps", "x ref", "x jax", "GFLOP/s", "of GEMM"],
            euler_rows,
            "12 Euler steps (alpha = 0.1) at ImageNet size (N=197, D=768, H=12, Y=64, K=3072), float32",
        )
    )


if __name__ == "__main__":
    main()
