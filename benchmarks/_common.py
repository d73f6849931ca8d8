"""Shared helpers of the benchmark scripts: models of the standard sizes, interleaved timing, tables.

Timing is interleaved: every repetition runs each candidate once untimed (to take over the cores and
caches from the previous candidate) and once timed; tables report the minimum (default) or the median over
repetitions. On a machine shared with other jobs, other load only ever adds time, so the minimum estimates
the uncontended time of deterministic arithmetic best; medians show what a typical call met.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

import et_ode
import et_ode.backend.runtime


@dataclass(frozen=True)
class Size:
    """A problem size: ``batch`` samples of ``n`` tokens of dimension ``d``; ``h`` heads of ``y``; ``k`` memories."""

    name: str
    n: int
    d: int
    h: int
    y: int
    k: int
    batch: int

    def flops(self) -> float:
        """Floating-point operations of one ``dE/dg`` evaluation (SPEC section 7), whole batch."""
        per_sample = 8 * self.n * self.d * self.h * self.y + 6 * self.n**2 * self.h * self.y + 4 * self.n * self.d * self.k
        return float(self.batch * per_sample)

    def with_batch(self, batch: int) -> Size:
        return Size(self.name, self.n, self.d, self.h, self.y, self.k, batch)


DIGITS = Size("8x8 digits, 2x2 patches", 17, 64, 4, 16, 256, 64)
MNIST = Size("28x28, 4x4 patches", 50, 128, 4, 32, 512, 64)
IMAGENET = Size("ImageNet", 197, 768, 12, 64, 3072, 4)


def make_model(
    size: Size, *, hopfield: str = "relu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> et_ode.EnergyTransformer:
    """A model of ``size`` with the library's default initialization and a random ``delta``."""
    torch.manual_seed(seed)
    model = et_ode.EnergyTransformer(size.d, size.h, size.y, size.k, hopfield=hopfield)
    with torch.no_grad():
        model.neuron.delta.normal_(0.0, 0.1)
    return model.to(dtype)


def initial_state(size: Size, *, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    """A random state ``(batch, n, d)``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size.batch, size.n, size.d, generator=generator).to(dtype)


class JaxET(NamedTuple):
    """A model in JAX (see :func:`jax_field`): its parameters and pure functions of them."""

    params: dict[str, Any]
    layer_norm: Callable[[dict[str, Any], Any], Any]  # g(params, x)
    field: Callable[[dict[str, Any], Any], Any]  # dx/dt(params, x) = -dE/dg(g(x)), x of shape (..., N, D)
    rms_dg_dt: Callable[[dict[str, Any], Any], Any]  # RMS of dg/dt = J_g(x) dx/dt per sample, (..., N, D) -> (...)


def jax_field(model: et_ode.EnergyTransformer) -> JaxET:
    """``model``'s field written in JAX from the SPEC's formulas (sections 1-4: ``-grad(E)(LayerNorm(x))``), as the
    official release computes it, with its parameters (WK, WQ, xi, delta, gamma) as JAX arrays. Covers the
    benchmarks' default model (no self-attention, relu memories, positive gamma; ValueError otherwise)."""
    import jax
    import jax.numpy as jnp

    params = {
        "wk": model.attention.WK,
        "wq": model.attention.WQ,
        "xi": model.hopfield.xi,
        "delta": model.neuron.delta,
        "gamma_raw": model.neuron.gamma_raw,
    }
    params = {name: jnp.asarray(value.detach().numpy()) for name, value in params.items()}
    beta, eps = float(model.attention.beta[0]), model.neuron.eps
    if model.attention.self_attention or model.hopfield.form != "relu" or not model.neuron.positive_gamma:
        raise ValueError("the JAX code covers the default model: no self-attention, relu memories, positive gamma")

    def layer_norm(p: dict[str, Any], x: Any) -> Any:
        xt = x - x.mean(axis=-1, keepdims=True)
        gamma = jax.nn.softplus(p["gamma_raw"])
        return gamma * xt / jnp.sqrt((xt**2).mean(axis=-1, keepdims=True) + eps) + p["delta"]

    def energy(p: dict[str, Any], g: Any) -> Any:  # g: (..., N, D)
        k = jnp.einsum("hyd,...nd->...hny", p["wk"], g)
        q = jnp.einsum("hyd,...nd->...hny", p["wq"], g)
        logits = beta * jnp.einsum("...hky,...hqy->...hkq", k, q)
        logits = jnp.where(jnp.eye(g.shape[-2], dtype=bool), -jnp.inf, logits)
        e_att = -jnp.sum(jax.nn.logsumexp(logits, axis=-2)) / beta
        return e_att - 0.5 * jnp.sum(jax.nn.relu(g @ p["xi"].T) ** 2)

    def field(p: dict[str, Any], x: Any) -> Any:
        return -jax.grad(energy, argnums=1)(p, layer_norm(p, x))

    def rms_dg_dt(p: dict[str, Any], x: Any) -> Any:
        _, dg_dt = jax.jvp(lambda y: layer_norm(p, y), (x,), (field(p, x),))
        return jnp.sqrt(jnp.mean(dg_dt**2, axis=(-1, -2)))

    return JaxET(params, layer_norm, field, rms_dg_dt)


STATISTICS = {"min": min, "median": statistics.median}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(
    candidates: dict[str, Callable[[], object]], reps: int, warmup: int = 2, statistic: str = "min", clock: str = "wall"
) -> dict[str, float]:
    """Seconds per call of each candidate (``statistic`` over interleaved repetitions: "min" or "median").

    ``clock="cpu"`` times the CPU time of the whole process (every thread, XLA's included) instead of the wall
    clock: on a machine shared with other jobs the wall clock also counts the time the process waits for a core.
    """
    times = interleaved_times(candidates, reps, warmup, clock)
    return {name: STATISTICS[statistic](values) for name, values in times.items()}


def interleaved_times(
    candidates: dict[str, Callable[[], object]], reps: int, warmup: int = 2, clock: str = "wall"
) -> dict[str, list[float]]:
    """Every candidate's seconds in each of ``reps`` rounds; a round runs the candidates one after another, each
    once untimed (the hand-over from the previous one) and once timed."""
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(warmup):
        for run in candidates.values():
            run()
    for _ in range(reps):
        for name, run in candidates.items():
            run()  # untimed: hand-over from the previous candidate
            start = now()
            run()
            times[name].append(now() - start)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of one candidate's time over another's in the same round: the two ran seconds apart,
    so a drift of the machine's speed between rounds (other jobs, the clock frequency) cancels in each ratio."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def gemm_candidates(m: int, d: int, r: int, dtype: torch.dtype = torch.float32) -> dict[str, Callable[[], object]]:
    """The float32 matrix products torch offers for ``(m, d) @ (d, r)``: MKL's and oneDNN's (packed weight)."""
    x, w = torch.randn(m, d, dtype=dtype), torch.randn(r, d, dtype=dtype)
    candidates: dict[str, Callable[[], object]] = {"GEMM torch.matmul": lambda: x @ w.T}
    if et_ode.kernels.gemm.supports_onednn(dtype, x.device):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        candidates["GEMM oneDNN packed"] = lambda: et_ode.kernels.gemm.onednn_linear(x, packed)
    return candidates


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [f"\n{title}"] if title else []
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value)


def ms(seconds: float) -> float:
    return seconds * 1e3


def environment() -> str:
    """One line on the CPU (its vector extensions), the software, the threads and the machine's load."""
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (
        f"{et_ode.backend.runtime.cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads on "
        f"{len(_cores())} cores, oneDNN {'available' if et_ode.kernels.gemm.onednn_available() else 'unavailable'}{load}"
    )


def set_threads(threads: int | None) -> None:
    """Run torch and (if imported later) XLA on ``threads`` CPU cores; ``None`` keeps the defaults.

    The process is pinned to the first ``threads`` of its cores (``os.sched_setaffinity``) and torch uses that
    many threads, so both libraries get the same cores: XLA's CPU runtime sizes its own thread pool and ignores
    the thread flags of older releases (measured: jax 0.10.2 with ``--xla_cpu_multi_thread_eigen=false`` still
    ran a GEMM on 2 cores). Call before jax is imported. One core gives steadier figures on a machine shared
    with other jobs, where threads of an OpenMP team wait for each other whenever one of them is descheduled.
    """
    if threads is None:
        return
    if "jax" in sys.modules:
        raise RuntimeError("set_threads must run before jax is imported")
    cores = _cores()
    if threads > len(cores):
        raise ValueError(f"--threads {threads}: this process may run on {len(cores)} cores only")
    if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere only torch's thread count is set
        os.sched_setaffinity(0, cores[:threads])
    torch.set_num_threads(threads)


def _cores() -> list[int]:
    """The cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
