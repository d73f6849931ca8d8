"""Training on several processes: ``torchrun`` detection, process-group set-up, metric reduction, DDP wrapping.

:func:`et_ode.training.train.fit` needs nothing from here in one process. Under ``torchrun`` (or any launcher that
sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) open a :func:`session` first (gloo on
CPU, NCCL on CUDA at ``cuda:LOCAL_RANK``); ``fit`` then shards every epoch, wraps the model in
``DistributedDataParallel`` (:func:`wrap`), averages the metrics over the ranks (:func:`reduce_mean`) and lets rank 0
alone write files and show progress. Gradients are averaged over the ranks, so a step on ``W`` processes equals a
step of one process on the whole global batch with a mean loss, and a checkpoint resumes on any number of processes.
A rank that raises exits; the others are stopped by ``torchrun``, or fail once the peer's sockets close (gloo) or
after ``timeout`` (NCCL's watchdog): no run waits forever. The distributed-training guide shows the commands.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from et_ode.backend.devices import rank, resolve_device, world_size

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class DistributedEnv:
    """This process's place in a distributed run, as ``torchrun`` describes it in environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def detect(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The torchrun environment of this process, or None when neither ``RANK`` nor ``WORLD_SIZE`` is set.

    Raises:
        ValueError: some of the variables are set but not all, or their values are inconsistent.
    """
    environ = os.environ if environ is None else environ
    present = [name for name in ENV_VARS if name in environ]
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return None
    missing = [name for name in ENV_VARS if name not in environ]
    if missing:
        raise ValueError(
            f"incomplete distributed environment: {', '.join(present)} set but {', '.join(missing)} "
            f"missing; launch with torchrun (it sets {', '.join(ENV_VARS)})"
        )
    try:
        env = DistributedEnv(
            int(environ["RANK"]),
            int(environ["WORLD_SIZE"]),
            int(environ["LOCAL_RANK"]),
            environ["MASTER_ADDR"],
            int(environ["MASTER_PORT"]),
        )
    except ValueError:
        values = {name: environ[name] for name in ENV_VARS}
        raise ValueError(f"RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers, got {values}") from None
    if env.world_size < 1 or not 0 <= env.rank < env.world_size or env.local_rank < 0:
        raise ValueError(
            f"need WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0, got "
            f"RANK={env.rank}, WORLD_SIZE={env.world_size}, LOCAL_RANK={env.local_rank}"
        )
    if not 0 < env.master_port < 65536:
        raise ValueError(f"MASTER_PORT must be a TCP port in 1..65535, got {env.master_port}")
    return env


Backend = Literal["auto", "gloo", "nccl"]


def _backend_and_device(env: DistributedEnv, device: str | torch.device, backend: Backend) -> tuple[str, torch.device]:
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        if resolved.index is None:
            count = torch.cuda.device_count()
            if env.local_rank >= count:
                raise ValueError(
                    f"LOCAL_RANK={env.local_rank} has no GPU: this machine has {count}; start at most "
                    f"{count} processes per node (torchrun --nproc_per_node={count})"
                )
            resolved = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(resolved)
    if backend == "auto":
        backend = "nccl" if resolved.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and resolved.type != "cuda":
        raise ValueError(f"backend='nccl' needs CUDA devices, but device={str(device)!r} resolved to {resolved}")
    return backend, resolved


def init(
    env: DistributedEnv | None = None,
    *,
    device: str | torch.device = "auto",
    backend: Backend = "auto",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> torch.device:
    """Join the process group described by ``env`` (default: :func:`detect`); return this rank's device.

    ``backend="auto"`` picks NCCL for CUDA and gloo for CPU; ``device="cuda"`` (or ``"auto"`` with a GPU) becomes
    ``cuda:LOCAL_RANK``. ``timeout`` bounds the rendezvous and every collective (a peer that never answers makes
    the call raise instead of waiting forever).
    """
    env = env or detect()
    if env is None:
        raise ValueError(
            f"no distributed environment: {', '.join(ENV_VARS)} are not set; start the program with "
            f"torchrun --nproc_per_node=N ... (or set the variables yourself)"
        )
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call shutdown() first")
    chosen, resolved = _backend_and_device(env, device, backend)
    dist.init_process_group(
        chosen,
        init_method=f"tcp://{_host(env.master_addr)}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=resolved if resolved.type == "cuda" else None,
    )
    return resolved


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def shutdown() -> None:
    """Leave the process group (no-op when none is open)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def session(
    enabled: bool | None = None,
    *,
    device: str | torch.device = "auto",
    backend: Backend = "auto",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> Iterator[torch.device]:
    """A process group for the ``with`` block; yields this rank's device.

    Args:
        enabled: True: require a torchrun environment (ValueError naming the variables if absent); None: join one
            when :func:`detect` finds it, else run as a single process; False: single process.
        device, backend, timeout: as for :func:`init`; without a group the device is just resolved.
    """
    env = detect() if enabled is not False else None
    if enabled and env is None:
        raise ValueError(
            f"distributed training was requested but {', '.join(ENV_VARS)} are not set: start it "
            f"with torchrun --nproc_per_node=N (one machine) or --nnodes=M (several)"
        )
    if env is None:
        yield resolve_device(device)
        return
    resolved = init(env, device=device, backend=backend, timeout=timeout)
    try:
        yield resolved
        dist.barrier()  # every rank is done: tear the group down together (a one-sided gloo teardown can abort)
    finally:
        shutdown()


def is_main() -> bool:
    """True on rank 0: the process that writes files and shows progress."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if world_size() > 1:
        dist.barrier()


def local_device(device: torch.device) -> torch.device:
    """``device`` with the current CUDA index filled in (``cuda`` -> ``cuda:i``); other devices unchanged."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def wrap(model: nn.Module, device: torch.device, *, find_unused_parameters: bool = True) -> nn.Module:
    """``DistributedDataParallel(model)`` when several processes run, else ``model`` itself.

    ``find_unused_parameters=True`` (the default) suits every gradient mode: with ``gradient=Implicit()`` the start
    ``x0`` gets no gradient (the fixed point does not depend on it), so parameters that only make ``x0`` (an
    encoder, positions) are unused and DDP must know it. With the other modes it costs one walk over the autograd
    graph per step, small next to an ODE solve, and PyTorch prints a one-time warning on each rank when it finds no
    unused parameter.
    """
    if world_size() == 1:
        return model
    device = local_device(device)
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None, find_unused_parameters=find_unused_parameters
    )


def reduce_mean(metrics: Mapping[str, float], weight: float = 1.0) -> dict[str, float]:
    """Weighted mean over the ranks of each rank's ``metrics`` (returned on every rank; identity in one process).

    ``weight``: this rank's share, e.g. its number of examples. A metric missing on some ranks is averaged over
    the ranks that have it. Ranks with weight 0 contribute nothing.
    """
    if weight < 0:
        raise ValueError(f"weight must be >= 0, got {weight!r}")
    local = {key: float(value) for key, value in metrics.items()}
    if world_size() == 1:
        return local
    gathered: list[tuple[dict[str, float], float] | None] = [None] * world_size()
    dist.all_gather_object(gathered, (local, float(weight)))
    totals: dict[str, list[float]] = {}
    for entry in gathered:
        assert entry is not None  # all_gather_object filled every slot
        values, share = entry
        for key, value in values.items():
            total = totals.setdefault(key, [0.0, 0.0])
            total[0] += share * value
            total[1] += share
    return {key: (total / share if share > 0 else float("nan")) for key, (total, share) in totals.items()}


T = TypeVar("T")


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` (any picklable object; keep tensors on the CPU) on every rank; ``obj`` in one process.

    Only ``src`` needs the value (e.g. the checkpoint file exists on rank 0's machine alone); the others pass None.
    """
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shard(size: int, rank_: int | None = None, world: int | None = None) -> range:
    """Indices ``[start, stop)`` of this rank's contiguous part of ``range(size)``: sizes differ by at most one."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    if not 0 <= rank_ < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank_}, world={world}")
    return range(size * rank_ // world, size * (rank_ + 1) // world)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` at the time of the call (for MASTER_PORT on one machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
