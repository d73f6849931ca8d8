"""Training throughput (samples per second) on 1 and 2 CPU processes with DistributedDataParallel (gloo).

The problem is the demo's: masked completion of scikit-learn's 8x8 digits (2x2 patches, N=16 tokens, D=32,
H=4, Y=8, K=128, half the patches scored), float32, the paper's scheme (``EulerET``: 12 Euler steps of 0.1,
so every step does the same work), global batch 64 split over the processes. Each configuration is one
``torchrun`` launch of this file (``--worker``) running :func:`et_ode.training.train.fit` for 2 epochs of ``--steps``
batches; the rate is measured over the second epoch (the first pays for start-up). Configurations:

- 1 process x 1 thread (the reference), 1 process x 2 threads (intra-op parallelism), 2 processes x 1 thread
  (data parallelism: two half batches, gradients averaged by gloo all-reduce).

The table gives the machine's core count and load average: on a machine shared with other jobs the figures are
noisy and the speed-up is bounded by the cores the others leave free. The scaling on GPUs (NCCL) needs GPUs.

    python benchmarks/ddp.py                      # direct and adjoint gradients; about 2 minutes on 2 cores
    python benchmarks/ddp.py --grads direct --steps 20 --batch 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from et_ode import (  # noqa: E402
    EulerET,
    Integration,
    distributed,  # noqa: E402
)
from et_ode.data.images import load_digits  # noqa: E402
from et_ode.models.image import CompletionTask, ImageET  # noqa: E402
from et_ode.training.train import TrainConfig, fit  # noqa: E402

CONFIGS = ((1, 1), (1, 2), (2, 1))  # (processes, threads per process)


def worker(args: argparse.Namespace) -> None:
    """One rank: train for 2 epochs of ``args.steps`` batches; rank 0 writes the second epoch's rate."""
    torch.set_num_threads(args.threads)
    with distributed.session(None, device="cpu"):
        images = load_digits("train").images
        torch.manual_seed(0)
        integration = Integration(solver=EulerET(0.1, 12), gradient=args.grad)
        model = ImageET((1, 8, 8), 2, dim=32, heads=4, head_dim=8, dynamics=integration)
        config = TrainConfig(
            epochs=2, batch_size=args.batch, max_train_batches=args.steps, warmup=0, device="cpu", progress=False
        )
        history = fit(model, CompletionTask(0.5), images, config=config)
        seconds = history.records[1]["time"] - history.records[0]["time"]
        if distributed.is_main():
            Path(args.out).write_text(
                json.dumps(
                    {
                        "samples_per_second": args.steps * args.batch / seconds,
                        "seconds": seconds,
                        "world_size": distributed.world_size(),
                    }
                )
            )


def launch(processes: int, threads: int, grad: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rate.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={distributed.free_port()}",
            __file__,
            "--worker",
            "--threads",
            str(threads),
            "--grad",
            grad,
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
            "--out",
            str(out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
        if run.returncode != 0:
            raise RuntimeError(
                f"{processes} process(es) x {threads} thread(s), grad={grad} failed:\n"
                f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grads", default="direct,adjoint", help="comma-separated gradient modes")
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the processes)")
    parser.add_argument("--steps", type=int, default=10, help="batches per epoch (the second epoch is timed)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--grad", default="direct", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load = os.getloadavg()[0]
    rows = []
    for grad in args.grads.split(","):
        reference = None
        for processes, threads in CONFIGS:
            rate = launch(processes, threads, grad, args)["samples_per_second"]
            reference = reference or rate
            rows.append([grad, processes, threads, rate, rate / reference])
            print(f"  {grad}: {processes} process(es) x {threads} thread(s): {rate:.1f} samples/s", flush=True)
    title = (
        f"Training samples per second, 8x8 digits, global batch {args.batch}, 12 Euler steps (EulerET); "
        f"{os.cpu_count()} CPU cores, load average {load:.1f} at the start (other jobs share the cores); "
        f"torch {torch.__version__}, gloo"
    )
    print(table(["grad", "processes", "threads each", "samples/s", "vs 1x1"], rows, title))


if __name__ == "__main__":
    main()
