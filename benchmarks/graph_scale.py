"""Time and peak memory of one ET field evaluation on a graph: dense (N x N) mask against the edge list.

Random directed graphs with N nodes and average in-degree 10 (E = 10 N edges, uniform endpoints). Each
configuration runs in a fresh subprocess, so its peak memory is its own: ``peak`` is the process's maximum
resident set (``resource.getrusage(...).ru_maxrss``; on CUDA ``torch.cuda.max_memory_allocated``), ``eval`` the
growth of that peak during the evaluations (what the field evaluation itself needs beyond the model, inputs and
mask). Time is the median of ``--repeats`` evaluations after one warm-up, under ``torch.no_grad()``.
Dense runs (a boolean ``(N, N)`` mask, through the field's default backend: the fused dense path of
``et_ode.kernels.fused``) are skipped where the estimated N^2 buffers exceed ``--max-dense-gib``; sparse runs pass a
:class:`~et_ode.energy.masks.GraphMask` (the edge-list form).

    python benchmarks/graph_scale.py                      # N = 1e3 .. 1e5, D=64, H=4, Y=16, K=256, 1 thread
    python benchmarks/graph_scale.py --nodes 1000 10000 --device cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def worker(args: argparse.Namespace) -> dict:
    import torch

    from et_ode import EnergyTransformer, ETField
    from et_ode.energy.masks import GraphMask

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    n = args.n
    model = EnergyTransformer(args.dim, args.heads, args.head_dim, args.memories).to(device)
    edge_index = torch.randint(0, n, (2, args.degree * n), device=device)
    mask = GraphMask(edge_index, n)
    if args.mode == "dense":
        mask = mask.to_dense()
    field = ETField(model, mask=mask)
    x = torch.randn(n, args.dim, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.max_memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    with torch.no_grad():
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            field(torch.zeros(()), x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "n": n,
        "edges": mask.num_edges if args.mode == "sparse" else int(mask.sum()),
        "mode": args.mode,
        "time": statistics.median(times[1:]),
        "peak": peak,
        "eval": peak - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1_000, 3_000, 10_000, 30_000, 100_000])
    parser.add_argument("--degree", type=int, default=10)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--memories", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--max-dense-gib",
        type=float,
        default=6.0,
        help="skip dense runs whose N^2 buffers (about N^2 (12 H + 3) bytes) would exceed this (GiB)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("dense", "sparse"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    common = [
        "--degree",
        str(args.degree),
        "--dim",
        str(args.dim),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--memories",
        str(args.memories),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
    ]
    print(
        f"one field evaluation, D={args.dim} H={args.heads} Y={args.head_dim} K={args.memories}, average degree "
        f"{args.degree}, {args.threads} thread(s), {args.device}; memory in MiB"
    )
    print(f"{'N':>8} {'E':>9} | {'dense s':>9} {'peak':>8} {'eval':>8} | {'sparse s':>9} {'peak':>8} {'eval':>8}")
    for n in args.nodes:
        row = {}
        for mode in ("dense", "sparse"):
            dense_bytes = n * n * (3 * args.heads * 4 + 3)  # logits, weights, a temporary (float32) and bool masks
            if mode == "dense" and dense_bytes > args.max_dense_gib * 2**30:
                row[mode] = None
                continue
            done = subprocess.run(
                [sys.executable, __file__, "--worker", "--n", str(n), "--mode", mode, *common],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                row[mode] = None
                print(f"  ({mode} N={n} failed: {done.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
                continue
            row[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        edges = (row["sparse"] or {}).get("edges", 0)
        cells = []
        for mode in ("dense", "sparse"):
            r = row[mode]
            cells.append(
                f"{'--':>9} {'--':>8} {'--':>8}"
                if r is None
                else f"{r['time']:9.4f} {r['peak'] / 2**20:8.0f} {r['eval'] / 2**20:8.0f}"
            )
        print(f"{n:8d} {edges:9d} | {cells[0]} | {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
