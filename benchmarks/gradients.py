"""Memory and time of one training step for the three ways to differentiate a solve.

At the 28x28 image size (N=50 tokens, D=128, H=4, Y=32, K=512; batch 8, float32, fused field), one training
step is: a forward solve of exactly ``steps`` explicit Euler steps of size 0.1 (torchdiffeq ``euler``), a loss
(squared error of the final ``g`` to a fixed target), and ``loss.backward()`` to every parameter, by

- ``direct``: backpropagation through the solver's operations (memory grows with the steps),
- ``adjoint``: torchdiffeq's adjoint (``gradient="adjoint"``: a backward solve with the same steps),
- ``implicit``: the forward without a graph, then the implicit backward at the final state
  (``et_ode.equilibrium.implicit.implicit_attractor``: conjugate gradients on the Riemannian Hessian; at 10 and 100 steps the
  state is not converged, so these gradients are not meaningful there: the row measures cost only).

Each configuration runs in a fresh subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every block of
64 KiB or more on its own and returns it on free, so the resident set follows the live tensors). After a warm-up
(one training step of one solver step: GEMM choice, kernel compilation, caches), a thread samples the resident set
(/proc/self/statm) every millisecond during the measured step; the peak is its maximum minus the level before the
step. Times are medians over the measured step and further ones in the same subprocess.

    python benchmarks/gradients.py                       # 10, 100, 1000 steps; about 3 minutes
    python benchmarks/gradients.py --steps 10,100,1000,3000 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MNIST, environment, initial_state, make_model, set_threads, table  # noqa: E402

import et_ode  # noqa: E402
from et_ode.equilibrium.implicit import implicit_attractor  # noqa: E402

STEP = 0.1
MODES = ("direct", "adjoint", "implicit")


class PeakResidentSet:
    """Samples the resident set size every ``interval`` seconds in a thread: ``with PeakResidentSet() as peak:``,
    then ``peak.growth_mib`` is the maximum minus the size on entry."""

    def __init__(self, interval: float = 1e-3):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.growth_mib = 0.0

    def _resident(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._resident())
            time.sleep(self.interval)

    def __enter__(self) -> PeakResidentSet:
        self._start = self._peak = self._resident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._resident())
        self.growth_mib = (self._peak - self._start) / 2**20


def training_step(
    mode: str, steps: int, field: et_ode.ETField, x0: torch.Tensor, target: torch.Tensor, implicit_iter: int
) -> tuple[float, float, int]:
    """Forward and backward seconds of one step, and the field evaluations of the backward pass."""
    field.model.zero_grad(set_to_none=True)
    field.reset_nfe()
    t = (0.0, steps * STEP)
    start = time.perf_counter()
    if mode == "implicit":
        with torch.no_grad():
            x_final = et_ode.solve(field, x0, t, solver=et_ode.Fixed("euler", STEP), save="final").x
        samples = x_final.shape[0]
        g_final = implicit_attractor(
            field,
            x_final,
            in_x=torch.zeros(samples, dtype=torch.bool),
            certified=torch.ones(samples, dtype=torch.bool),
            max_iter=implicit_iter,
        )
    else:
        g_final = et_ode.solve(field, x0, t, solver=et_ode.Fixed("euler", STEP), gradient=mode, save="final").g
    loss = (g_final - target).square().mean()
    forward = time.perf_counter() - start
    nfe_forward = field.nfe
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # CG not converged at unconverged states (cost only)
        loss.backward()
    return forward, time.perf_counter() - start, field.nfe - nfe_forward


def worker(config: dict[str, object]) -> dict[str, object]:
    set_threads(config["threads"])  # type: ignore[arg-type]
    size = MNIST.with_batch(int(config["batch"]))  # type: ignore[arg-type]
    model = make_model(size)
    field = et_ode.ETField(model)
    x0 = initial_state(size)
    target = torch.randn(size.batch, size.n, size.d, generator=torch.Generator().manual_seed(2))
    mode, steps, iters = str(config["mode"]), int(config["steps"]), int(config["implicit_iter"])  # type: ignore[arg-type]
    training_step(mode, 1, field, x0, target, iters)  # warm-up: GEMM choice, kernels, caches
    with PeakResidentSet() as peak:
        forward, backward, nfe_backward = training_step(mode, steps, field, x0, target, iters)
    forwards, backwards = [forward], [backward]
    for _ in range(int(config["reps"]) - 1):  # type: ignore[arg-type]
        forward, backward, _ = training_step(mode, steps, field, x0, target, iters)
        forwards.append(forward)
        backwards.append(backward)
    return {
        "peak_mib": peak.growth_mib,
        "forward_s": statistics.median(forwards),
        "backward_s": statistics.median(backwards),
        "nfe_backward": nfe_backward,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="10,100,1000", help="comma-separated solver step counts")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3, help="training steps timed per configuration (median)")
    parser.add_argument("--implicit-iter", type=int, default=100, help="max conjugate-gradient iterations")
    parser.add_argument("--threads", type=int, default=None, help="pin the process to this many cores (default: all)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    set_threads(args.threads)
    print(environment())
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    rows = []
    results: dict[tuple[str, int], dict[str, float]] = {}
    for steps in [int(s) for s in args.steps.split(",")]:
        for mode in MODES:
            print(f"  {mode}, {steps} steps ...", flush=True)
            config = {
                "mode": mode,
                "steps": steps,
                "batch": args.batch,
                "reps": args.reps if steps < 1000 else 1,
                "implicit_iter": args.implicit_iter,
                "threads": args.threads,
            }
            done = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(config)],
                capture_output=True,
                text=True,
                check=False,
                env=env,
            )
            if done.returncode != 0:
                rows.append([mode, steps, "failed", "", "", "", done.stderr.strip().splitlines()[-1][:80]])
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[(mode, steps)] = result
            rows.append(
                [mode, steps, result["peak_mib"], result["forward_s"], result["backward_s"], result["nfe_backward"], ""]
            )
    print(
        table(
            ["gradient", "solver steps", "peak MiB", "forward s", "backward s", "backward NFE", "note"],
            rows,
            f"One training step: {MNIST.name} (N={MNIST.n}, D={MNIST.d}), batch {args.batch}, Euler step {STEP}, float32",
        )
    )
    counts = sorted({steps for _, steps in results})
    if len(counts) >= 2:
        lo, hi = counts[0], counts[-1]
        summary = []
        for mode in MODES:
            if (mode, lo) in results and (mode, hi) in results:
                low, high = results[(mode, lo)]["peak_mib"], results[(mode, hi)]["peak_mib"]
                summary.append([mode, f"{lo} -> {hi}", low, high, high / low if low > 0 else float("nan")])
        print(table(["gradient", "steps", "peak MiB (few)", "peak MiB (many)", "ratio"], summary, "Peak memory growth"))
        if ("adjoint", hi) in results and ("implicit", hi) in results:
            ratio = results[("adjoint", hi)]["backward_s"] / results[("implicit", hi)]["backward_s"]
            print(f"\nadjoint backward / implicit backward at {hi} steps: {ratio:.3g}x")


if __name__ == "__main__":
    main()
