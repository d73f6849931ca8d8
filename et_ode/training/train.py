"""One training loop for every task: AdamW, warm-up then cosine, clipping, checkpoints, exact resume.

The loop knows nothing of images or graphs: a :class:`Task` supplies the loss and the evaluation, and :func:`fit`
trains any ``nn.Module`` on it with the settings of a :class:`TrainConfig`, returning the :class:`History` of its
epochs. A run writes data-only checkpoints (:func:`save_checkpoint`, :mod:`et_ode.training.statefile`) and
``metrics.jsonl`` to its folder, resumes mid-epoch bit for bit, times every step and counts its field evaluations
(:func:`training_cost`), plans its schedule for a time budget, and runs unchanged on several processes
(:mod:`et_ode.training.distributed`); :func:`fit` states each in full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from et_ode.backend import devices
from et_ode.backend.devices import move_to, resolve_device, seed_everything
from et_ode.backend.validation import check_positive
from et_ode.training import distributed, runs
from et_ode.training.statefile import FileFormatError, describe, load_state, save_state, torch_file_format

CHECKPOINT_NAME = "checkpoint.safetensors"
CHECKPOINT_FORMAT = "et-ode/training-checkpoint/2"
CALIBRATION_STEPS = 10  # steps timed before a run with max_time plans its schedule
LEGACY_CHECKPOINT_NAME = "checkpoint.pt"  # a pickle checkpoint: refused unread, with how to convert it
METRICS_NAME = "metrics.jsonl"
# Fields that change the sequence of parameter updates: a resumed run must keep them.
_TRAJECTORY_FIELDS = (
    "batch_size",
    "lr",
    "weight_decay",
    "betas",
    "warmup",
    "min_lr_ratio",
    "grad_clip",
    "seed",
    "max_train_batches",
)


class MapData(Protocol):
    """A map-style data set: a ``Dataset``, a list of examples, or a tensor indexed along its first dimension."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class Task(Protocol):
    """What ``fit`` needs from a task.

    ``loss(model, batch)`` returns the scalar loss to minimise and metrics to show and log (e.g.
    ``{"mse": ..., "nfe": ..., "energy": ...}``); ``evaluate(model, batches)`` returns the metrics on a held-out split
    and is called under ``torch.no_grad()`` with ``model.eval()``. A task may also define ``after_backward()``: the
    metrics known only once the loss's backward pass has run (e.g. ``{"nfe_backward": ...}``).
    """

    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, float]]: ...

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]: ...


@dataclass
class TrainConfig:
    """Settings of one training run.

    Args:
        epochs: passes over the training set.
        batch_size: training batch size (the global batch under DDP: ``batch_size / world_size`` per rank).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's moment coefficients.
        warmup: linear warm-up length: a fraction of all steps if < 1, else a number of steps.
        min_lr_ratio: the cosine decays from ``lr`` to ``lr * min_lr_ratio``.
        grad_clip: clip the global gradient norm to this value (None or 0: no clipping).
        seed: seeds parameters' initialisation by the caller's choice, data order, and the global RNGs.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:i"``.
        out_dir: folder for the checkpoint and the metrics (None: write nothing).
        resume: False, True (``out_dir/checkpoint.safetensors`` if it exists) or a checkpoint path.
        overwrite: start afresh in an ``out_dir`` that holds a checkpoint or metrics, deleting them (without
            it, or ``resume``, such a folder is refused).
        eval_every: evaluate on ``val_data`` every this many epochs (and after the last).
        checkpoint_every: also checkpoint every this many steps within an epoch (0: only at epoch ends).
        eval_batch_size: batch size of the evaluation (default ``batch_size``).
        max_train_batches: cap on batches per epoch (quick runs); None for the whole set.
        num_workers: DataLoader workers.
        progress: show tqdm bars.
        max_time: wall-clock budget of the run in seconds (None: no budget); the schedule is planned to fit it
            (see the module docstring).
    """

    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    warmup: float = 0.05
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0
    seed: int = 0
    device: str = "auto"
    out_dir: str | None = None
    resume: bool | str = False
    overwrite: bool = False
    eval_every: int = 1
    checkpoint_every: int = 0
    eval_batch_size: int | None = None
    max_train_batches: int | None = None
    num_workers: int = 0
    progress: bool = True
    max_time: float | None = None

    def __post_init__(self) -> None:
        positive_ints = {"epochs": self.epochs, "batch_size": self.batch_size, "eval_every": self.eval_every}
        for name, value in positive_ints.items():
            check_positive(f"TrainConfig.{name}", value, integer=True)
        check_positive("TrainConfig.lr", self.lr)
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.warmup < 0:
            raise ValueError(f"TrainConfig.warmup must be >= 0 (a fraction < 1 or a number of steps), got {self.warmup!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ValueError(f"TrainConfig.grad_clip must be None or >= 0, got {self.grad_clip!r}")
        if not (isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0):
            raise ValueError(f"TrainConfig.checkpoint_every must be an integer >= 0, got {self.checkpoint_every!r}")
        check_positive("TrainConfig.max_train_batches", self.max_train_batches, integer=True, optional=True)
        check_positive("TrainConfig.max_time", self.max_time, optional=True)  # seconds
        beta1, beta2 = self.betas
        self.betas = (float(beta1), float(beta2))
        resolve_device(self.device)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class History:
    """Per-epoch records of a run (also appended to ``metrics.jsonl``)."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def last(self, key: str) -> Any:
        """The most recent value of ``key`` (e.g. ``"val_mse"``); KeyError if never logged."""
        for record in reversed(self.records):
            if key in record:
                return record[key]
        raise KeyError(f"{key!r} was never logged; keys: {sorted({k for r in self.records for k in r})}")


def training_cost(history: History) -> dict[str, float]:
    """What the training steps of ``history`` cost: ``steps``, ``seconds_per_step`` and, where logged, the field
    evaluations per step ``nfe_forward_per_step`` and ``nfe_backward_per_step`` (means over all steps)."""
    records = [r for r in history.records if r.get("kind") == "epoch" and r.get("batches")]
    steps = sum(r["batches"] for r in records)
    cost: dict[str, float] = {"steps": steps}
    for key, name in (
        ("train_step_seconds", "seconds_per_step"),
        ("train_nfe", "nfe_forward_per_step"),
        ("train_nfe_backward", "nfe_backward_per_step"),
    ):
        if steps and all(key in r for r in records):
            cost[name] = sum(r[key] * r["batches"] for r in records) / steps
    return cost


# ----------------------------------------------------------------------------------------------- utilities
def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` (tensors, NumPy arrays, numbers, strings, and lists/tuples/dicts of them) as safetensors +
    JSON (:mod:`et_ode.training.statefile`), atomically: a crash mid-write leaves the previous checkpoint intact.

    Raises:
        TypeError: ``state`` holds an object that is not data, naming where.
        et_ode.training.runs.RunWriteError: a full or read-only disk, naming ``path`` (the previous checkpoint is intact).
    """
    save_state(path, state, CHECKPOINT_FORMAT)


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", required: Iterable[str] = ("model",)
) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`. Data only: nothing in the file can run code.

    Raises:
        FileNotFoundError: no file at ``path``.
        et_ode.training.statefile.FileFormatError (a ValueError): the file is empty, truncated or corrupt, too large, a
            pickle (refused, never unpickled), not a checkpoint, or lacks one of ``required`` keys (named).
        ValueError: an et-ode model file (the message says how to load it).
    """
    path = Path(path)
    try:
        state = load_state(path, CHECKPOINT_FORMAT, map_location, what="checkpoint")
    except ValueError:
        if (
            path.is_file()
            and describe(path).startswith("a pickle")
            and (torch_file_format(path) or "").startswith("et-ode/energy-transformer")
        ):
            raise ValueError(
                f"{path} is an et-ode model file (et_ode.training.io.save_model: an EnergyTransformer and its "
                f"settings), not a training checkpoint: read it with et_ode.training.io.load_model(path). A "
                f"checkpoint is the {CHECKPOINT_NAME} that training writes in its out_dir"
            ) from None
        raise
    missing = [key for key in required if key not in state]
    if missing:
        raise FileFormatError(
            path, missing[0], f"checkpoint {path} lacks the entries {missing}; it has {sorted(state)}", named=True
        )
    return state


# ----------------------------------------------------------------------------------------------- schedule
def _warmup_steps(config: TrainConfig, total_steps: int) -> int:
    return int(round(config.warmup * total_steps)) if config.warmup < 1 else int(config.warmup)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warm-up to 1, then cosine to ``min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class _EpochSampler(Sampler[int]):
    """A permutation fixed by ``(seed, epoch)``, this rank's shard of it, from batch ``start_batch`` on."""

    def __init__(self, size: int, seed: int, rank: int = 0, world: int = 1):
        self.size, self.seed, self.rank, self.world = size, seed, rank, world
        self.epoch = 0
        self.start = 0

    def indices(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        if self.world > 1:
            per_rank = math.ceil(self.size / self.world)
            order = (order + order[: per_rank * self.world - self.size])[self.rank :: self.world]
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start :])

    def __len__(self) -> int:
        return len(self.indices()) - self.start


def _format(metrics: dict[str, float]) -> dict[str, str]:
    return {k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------- the loop
def fit(
    model: nn.Module,
    task: Task,
    train_data: MapData,
    val_data: MapData | Iterable[Any] | None = None,
    config: TrainConfig | None = None,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    meta: dict[str, Any] | None = None,
    callback: Callable[[dict[str, Any]], None] | None = None,
) -> History:
    """Train ``model`` on ``task`` with AdamW and a warm-up + cosine schedule; return the :class:`History`.

    Batches of ``train_data`` (and of a ``val_data`` data set) are made by a ``DataLoader`` with ``collate_fn`` and
    moved to the device by :func:`et_ode.backend.devices.move_to`.

    Files: with ``config.out_dir``, ``checkpoint.safetensors`` (model, optimizer, scheduler, RNG states, epoch, step
    within the epoch, config, history, ``meta``: data only, loading it never runs code) and ``metrics.jsonl`` (one
    JSON object per epoch and per checkpoint-interval line). The folder is locked while ``fit`` runs
    (:func:`et_ode.training.runs.lock`); one that holds a checkpoint or metrics is refused unless ``resume`` or
    ``overwrite`` is set. A resume continues mid-epoch exactly: each epoch's order is a fixed function of
    ``(seed, epoch)`` and the RNG states are restored, so a resumed run ends with the parameters of an uninterrupted
    one (bit for bit on CPU).

    Cost: every step is timed (``train_step_seconds``: the loss, its backward pass and the update, data loading
    excluded) and, when the task reports them, its field evaluations (``train_nfe``: the forward solve;
    ``train_nfe_backward``: the adjoint's or implicit gradient's, from ``task.after_backward()``).

    Time budget: ``config.max_time`` (seconds) bounds the loop's wall clock (training and evaluation, summed over
    resumes). The schedule is planned for the steps that fit, never more than ``epochs`` allow: after
    :data:`CALIBRATION_STEPS` steps from the time they took, and again at the end of every epoch. The run ends when
    the planned steps are done or the clock reaches ``max_time``, with a final evaluation and a checkpoint; the last
    record says ``"stopped": "max_time"`` (or ``"planned_steps"``). Such a run depends on the machine's speed; its
    plan is saved, and a resume continues it.

    Several processes: when ``torch.distributed`` is initialised, ``batch_size`` is the global batch, split evenly
    (rank ``r`` takes every ``W``-th example of the epoch's permutation, so global batch ``k`` holds the same examples
    on any number of processes); ``task.loss`` receives the ``DistributedDataParallel`` wrapper (``model(...)`` for
    the forward pass, ``model.module`` for attributes); metrics are averaged over the ranks, each rank evaluates its
    part of ``val_data`` (a ``Dataset``), and rank 0 alone reads the checkpoint to resume, writes files and shows
    progress. A checkpoint resumes on any number of processes that divides ``batch_size``.

    Args:
        model: any ``nn.Module``; moved to ``config.device``. Initialise it (seeded) before calling.
        task: supplies ``loss(model, batch)`` and ``evaluate(model, batches)``.
        train_data: a map-style ``Dataset`` of examples, batched with ``collate_fn``.
        val_data: a ``Dataset`` (batched like ``train_data``) or an iterable of batches; None: no evaluation.
        config: :class:`TrainConfig`.
        collate_fn: the DataLoader's ``collate_fn`` (default: PyTorch's).
        meta: anything JSON/pickle-able stored in the checkpoint under ``"meta"`` (e.g. how to rebuild the model).
        callback: called with each epoch record after it is logged.

    Raises:
        TypeError: ``model``, ``task`` or ``train_data`` of the wrong kind.
        ValueError: empty ``train_data``; a batch size the processes do not divide; a checkpoint to resume that
            is damaged, a pickle (refused unread), or of another model or other training settings (named).
        et_ode.training.runs.RunFolderError: ``out_dir`` is a file, is in use by another live process (named), or already
            holds a run while neither ``resume`` nor ``overwrite`` is set.
        FloatingPointError: the loss became non-finite (the message gives the epoch, step and learning rate).
    """
    config = config or TrainConfig()
    _check_inputs(model, task, train_data)
    device = distributed.local_device(resolve_device(config.device))
    _check_processes(config)
    out_dir = Path(config.out_dir) if config.out_dir else None
    is_main = devices.rank() == 0
    with runs.lock(out_dir) if out_dir is not None and is_main else contextlib.nullcontext():
        if out_dir is not None and is_main:
            _check_fresh(config, out_dir)
        seed_everything(config.seed)
        loop = _Loop(model, task, train_data, val_data, config, device, out_dir, collate_fn, meta or {}, callback)
        loop.restore()
        return loop.run()


def _check_inputs(model: nn.Module, task: Task, train_data: MapData) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for method in ("loss", "evaluate"):
        if not callable(getattr(task, method, None)):
            raise TypeError(f"task must have a callable {method}(model, ...) method; got {type(task).__name__}")
    if not hasattr(train_data, "__getitem__") or not hasattr(train_data, "__len__"):
        raise TypeError(
            f"train_data must be a map-style Dataset (with __len__ and __getitem__), got {type(train_data).__name__}"
        )
    if len(train_data) == 0:
        raise ValueError("train_data is empty")


def _check_processes(config: TrainConfig) -> None:
    """The processes of this run can share its batches: ``batch_size`` divides among them, and a process that
    ``torchrun`` started is part of an initialised process group."""
    world = devices.world_size()
    if config.batch_size % world:
        raise ValueError(
            f"TrainConfig.batch_size={config.batch_size} is the global batch and must be divisible by "
            f"the number of processes, {world}"
        )
    environment = distributed.detect()
    if world == 1 and environment is not None and environment.world_size > 1:
        raise ValueError(
            f"this process is rank {environment.rank} of {environment.world_size} (torchrun "
            f"environment) but torch.distributed is not initialised: call fit inside "
            f"`with et_ode.training.distributed.session():` so that the ranks train together"
        )


@dataclass
class _Position:
    """Where a run stands: what a checkpoint saves besides the model, optimizer, scheduler and RNG states."""

    epoch: int = 0
    batch: int = 0  # batches done in this epoch
    step: int = 0
    running: dict[str, float] = field(default_factory=dict)  # this epoch's training metrics, summed
    count: int = 0  # the steps summed in ``running``
    elapsed: float = 0.0  # seconds of the loop before this process (a resumed run continues the clock)


@dataclass
class _Calibration:
    """This process's step times, from which a run with ``max_time`` plans its schedule."""

    done: bool
    seconds: float = 0.0  # of the steps after the first (which pays one-off costs: allocation, lazy set-up)
    steps: int = 0


def _validation(
    val_data: MapData | Iterable[Any] | None, config: TrainConfig, collate_fn: Callable[[list[Any]], Any] | None
) -> tuple[Iterable[Any] | None, int | None]:
    """The batches this rank evaluates, and how many examples they hold (None: every rank sees all batches)."""
    if not isinstance(val_data, Dataset):  # ready batches (a list or any other iterable)
        return cast("Iterable[Any] | None", val_data), None
    own = distributed.shard(len(cast(MapData, val_data)))
    part = val_data if devices.world_size() == 1 else torch.utils.data.Subset(val_data, own)
    batches = DataLoader(
        part,
        batch_size=config.eval_batch_size or config.batch_size,
        shuffle=False,
        collate_fn=collate_fn,
        num_workers=config.num_workers,
    )
    return batches, len(cast(MapData, part))


class _Loop:
    """One run of :func:`fit`: the objects it trains with, where it stands (:class:`_Position`), and its parts:
    restore, train an epoch, evaluate, save."""

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        train_data: MapData,
        val_data: MapData | Iterable[Any] | None,
        config: TrainConfig,
        device: torch.device,
        out_dir: Path | None,
        collate_fn: Callable[[list[Any]], Any] | None,
        meta: dict[str, Any],
        callback: Callable[[dict[str, Any]], None] | None,
    ):
        self.model, self.task, self.config, self.device, self.out_dir = model, task, config, device, out_dir
        self.meta, self.callback = meta, callback
        self.world = devices.world_size()
        self.is_main = devices.rank() == 0
        self.local_batch = config.batch_size // self.world
        model.to(device)
        self.net = distributed.wrap(model, device)
        self.sampler = _EpochSampler(len(train_data), config.seed, devices.rank(), self.world)
        self.loader = DataLoader(
            cast(Dataset, train_data),
            batch_size=self.local_batch,
            sampler=self.sampler,
            collate_fn=collate_fn,
            num_workers=config.num_workers,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(config.seed),
        )  # keeps the global RNG untouched
        batches = math.ceil(len(self.sampler.indices()) / self.local_batch)
        self.batches_per_epoch = batches if config.max_train_batches is None else min(batches, config.max_train_batches)
        self.total_steps = self.batches_per_epoch * config.epochs
        self.plan = {"steps": self.total_steps, "warmup": _warmup_steps(config, self.total_steps)}  # max_time re-plans
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, self.plan["steps"], self.plan["warmup"], config.min_lr_ratio)
        )
        self.val_batches, self.val_share = _validation(val_data, config, collate_fn)
        self.history = History()
        self.position = _Position()
        self.calibration = _Calibration(done=config.max_time is None)
        self.started = time.perf_counter()

    # -- restore and save
    def restore(self) -> None:
        """Continue the checkpoint that ``config.resume`` names, if any (rank 0 reads it, every rank loads it)."""
        path = _resume_path(self.config, self.out_dir) if self.is_main else None
        state = None
        if path is not None:
            state = load_checkpoint(
                path, map_location="cpu", required=("model", "optimizer", "scheduler", "rng", "epoch", "batch", "config")
            )
            _check_resumable(state["config"], self.config, path)
        state = distributed.broadcast_object(state)
        if state is None:
            return
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as error:
            raise ValueError(
                f"cannot resume from {path or 'the checkpoint'}: it holds a different model "
                f"or optimizer ({str(error).splitlines()[0][:300]}); resume with the run's model "
                f"settings or start a new out_dir"
            ) from None
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        self.position = _Position(
            epoch=state["epoch"],
            batch=state["batch"],
            step=state["step"],
            running=dict(state.get("running", {})),
            count=int(state.get("count", 0)),
            elapsed=float(state.get("elapsed", 0.0)),
        )
        self.history.records = list(state.get("history", []))
        if self.config.max_time is not None and "planned_steps" in state:
            _replan(self.plan, self.config, int(state["planned_steps"]), self.total_steps)
            self.calibration.done = True

    def save(self) -> None:
        """Write the checkpoint (rank 0, when the run has an ``out_dir``)."""
        if self.out_dir is None or not self.is_main:
            return
        position = self.position
        save_checkpoint(
            self.out_dir / CHECKPOINT_NAME,
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": _rng_state(),
                "epoch": position.epoch,
                "batch": position.batch,
                "step": position.step,
                "running": position.running,
                "count": position.count,
                "elapsed": self.clock(),
                "config": self.config.to_dict(),
                "world_size": self.world,
                "history": self.history.records,
                "meta": self.meta,
                **({"planned_steps": self.plan["steps"]} if self.config.max_time is not None else {}),
            },
        )

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the metrics file (rank 0, when the run has an ``out_dir``)."""
        if self.out_dir is None or not self.is_main:
            return
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / METRICS_NAME, "a") as file:
                file.write(json.dumps(record) + "\n")
        except OSError as error:  # a full or read-only disk: named, the lock released by the caller's claim
            raise runs.RunWriteError(self.out_dir / METRICS_NAME, error) from None

    # -- the clock and the time budget
    def clock(self) -> float:
        """Seconds of this run so far, over resumes."""
        return self.position.elapsed + time.perf_counter() - self.started

    def stop_reason(self) -> str | None:
        """``"max_time"`` or ``"planned_steps"`` when a run with a budget must stop here (rank 0 decides), else None."""
        if self.config.max_time is None:
            return None
        step = self.position.step
        reason = (
            "max_time"
            if self.clock() >= self.config.max_time
            else ("planned_steps" if self.plan["steps"] <= step < self.total_steps else None)
        )
        return distributed.broadcast_object(reason)

    def replan(self, seconds_per_step: float) -> None:
        """Plan the schedule for the steps that fit in the rest of the budget (rank 0's guess)."""
        budget = self.config.max_time
        if budget is None:
            return
        steps = self.position.step + int((budget - self.clock()) / max(seconds_per_step, 1e-9))
        _replan(self.plan, self.config, int(distributed.broadcast_object(steps)), self.total_steps)

    def calibrate(self, seconds: float) -> None:
        """Count a step of ``seconds``; after :data:`CALIBRATION_STEPS` of them, plan the schedule once."""
        calibration = self.calibration
        calibration.steps += 1
        if calibration.steps > 1:
            calibration.seconds += seconds
        if not calibration.done and calibration.steps > CALIBRATION_STEPS:
            calibration.done = True
            self.replan(calibration.seconds / (calibration.steps - 1))

    # -- training
    def run(self) -> History:
        """Train epoch after epoch until the last one or the budget ends the run."""
        self.started = time.perf_counter()
        stopped = self.stop_reason()
        while self.position.epoch < self.config.epochs and stopped is None:
            stopped = self.train_epoch()
            self.end_epoch(stopped)
        self.model.eval()
        return self.history

    def train_epoch(self) -> str | None:
        """Train from the position to the end of the epoch; the reason the budget stopped it early, if it did."""
        position, config = self.position, self.config
        self.sampler.epoch, self.sampler.start = position.epoch, position.batch * self.local_batch
        self.net.train()
        bar = tqdm(
            total=self.batches_per_epoch,
            initial=position.batch,
            desc=f"epoch {position.epoch + 1}/{config.epochs}",
            disable=not (config.progress and self.is_main),
            leave=False,
            dynamic_ncols=True,
        )
        stopped = None
        for batch in self.loader:
            if position.batch >= self.batches_per_epoch:
                break
            metrics = self.train_step(move_to(batch, self.device))
            bar.set_postfix(_format(metrics), refresh=False)
            bar.update(1)
            self.calibrate(metrics["step_seconds"])
            stopped = self.stop_reason()
            if stopped is not None:
                break
            if config.checkpoint_every and position.step % config.checkpoint_every == 0:
                if position.batch < self.batches_per_epoch:
                    self.save()
                    self.log_step()
        bar.close()
        return stopped

    def train_step(self, batch: Any) -> dict[str, float]:
        """One update on ``batch``; its metrics (the loss, the task's, ``step_seconds``), added to the running sums."""
        position = self.position
        started = time.perf_counter()
        loss, metrics = self.task.loss(self.net, batch)
        if not bool(torch.isfinite(loss)):
            raise FloatingPointError(
                f"the training loss became {float(loss.detach())} at epoch {position.epoch + 1}, "
                f"step {position.step}; lower lr (now {self.scheduler.get_last_lr()[0]:.3g}) or the solver "
                f"tolerances"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip:
            metrics = {
                **metrics,
                "grad_norm": float(nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)),
            }
        after_backward = getattr(self.task, "after_backward", None)
        if callable(after_backward):
            metrics = {**metrics, **after_backward()}
        self.optimizer.step()
        self.scheduler.step()
        seconds = time.perf_counter() - started
        position.step += 1
        position.batch += 1
        metrics = {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}, "step_seconds": seconds}
        for key, value in metrics.items():
            position.running[key] = position.running.get(key, 0.0) + value
        position.count += 1
        return metrics

    def train_means(self) -> dict[str, float]:
        """The mean training metrics of the epoch so far, averaged over the ranks: ``{"train_<metric>": mean}``."""
        position = self.position
        means = distributed.reduce_mean({k: v / max(position.count, 1) for k, v in position.running.items()})
        return {f"train_{k}": v for k, v in means.items()}

    def log_step(self) -> None:
        """Log the training metrics within an epoch (at a checkpoint)."""
        position = self.position
        means = self.train_means()
        lr = self.scheduler.get_last_lr()[0]
        self.log(
            {"kind": "step", "epoch": position.epoch + 1, "step": position.step, "lr": lr, "time": self.clock(), **means}
        )

    def evaluate(self) -> dict[str, float]:
        """The task's metrics on the validation batches (averaged over the ranks, weighted by their examples)."""
        self.model.eval()
        with torch.no_grad():
            batches = (move_to(b, self.device) for b in cast("Iterable[Any]", self.val_batches))
            evaluated = self.task.evaluate(self.model, batches) if self.val_share != 0 else {}
        if self.val_share is not None:
            evaluated = distributed.reduce_mean(evaluated, weight=self.val_share)
        return {f"val_{k}": float(v) for k, v in evaluated.items()}

    def end_epoch(self, stopped: str | None) -> None:
        """Record the epoch (evaluated when due), move to the next one, re-plan a budget, save."""
        position, config = self.position, self.config
        record: dict[str, Any] = {
            "kind": "epoch",
            "epoch": position.epoch + 1,
            "step": position.step,
            "batches": position.count,
            "lr": self.scheduler.get_last_lr()[0],
            **self.train_means(),
        }
        last_epoch = position.epoch + 1 == config.epochs or stopped is not None
        if self.val_batches is not None and ((position.epoch + 1) % config.eval_every == 0 or last_epoch):
            record.update(self.evaluate())
        record["time"] = self.clock()
        if stopped is not None:
            record["stopped"] = stopped
        self.history.records.append(record)
        self.log(record)
        if self.callback is not None and self.is_main:
            self.callback(record)
        if config.progress and self.is_main:
            tqdm.write(" ".join(f"{k}={v}" for k, v in _format(record).items() if k != "kind"))
        if position.batch >= self.batches_per_epoch:
            position.epoch, position.batch = position.epoch + 1, 0
        position.running, position.count = {}, 0
        if config.max_time is not None and stopped is None and position.step:
            self.replan(self.clock() / position.step)  # seconds per step so far, evaluations included
        self.save()


def _replan(plan: dict[str, int], config: TrainConfig, steps: int, total_steps: int) -> None:
    """Plan the schedule for ``steps`` (at most ``total_steps``, at least 1) with the warm-up of that length."""
    plan["steps"] = max(1, min(total_steps, steps))
    plan["warmup"] = _warmup_steps(config, plan["steps"])


def _check_fresh(config: TrainConfig, out_dir: Path) -> None:
    """A run that does not resume must not mix with another's checkpoint and metrics in ``out_dir``."""
    if config.resume is not False and config.resume is not None:
        return
    found = [name for name in (CHECKPOINT_NAME, METRICS_NAME) if (out_dir / name).exists()]
    if not found:
        return
    if not config.overwrite:
        raise runs.RunFolderError(
            f"{out_dir} already holds a run ({', '.join(found)}): resume it (resume=True), "
            f"replace it (overwrite=True) or choose another out_dir"
        )
    for name in found:
        (out_dir / name).unlink()


def _resume_path(config: TrainConfig, out_dir: Path | None) -> Path | None:
    if config.resume is False or config.resume is None:
        return None
    if config.resume is True:
        if out_dir is None:
            raise ValueError(f"TrainConfig.resume=True needs out_dir (it reads out_dir/{CHECKPOINT_NAME})")
        path = out_dir / CHECKPOINT_NAME
        if not path.is_file() and (out_dir / LEGACY_CHECKPOINT_NAME).is_file():
            raise ValueError(
                f"cannot resume {out_dir}: it holds {LEGACY_CHECKPOINT_NAME}, a pickle checkpoint of an "
                f"older et-ode, which is never loaded (it could run code). If you trust it, convert it "
                f"once: save_checkpoint(out_dir / {CHECKPOINT_NAME!r}, torch.load(out_dir / "
                f"{LEGACY_CHECKPOINT_NAME!r}, weights_only=False)); or start a new out_dir"
            )
        return path if path.is_file() else None  # nothing to resume yet: start fresh
    path = Path(config.resume)
    if not path.is_file():
        raise FileNotFoundError(f"TrainConfig.resume: no checkpoint at {path.resolve()}")
    return path


def _check_resumable(saved: dict[str, Any], config: TrainConfig, path: Path) -> None:
    differ = {
        name: (saved.get(name), getattr(config, name))
        for name in _TRAJECTORY_FIELDS
        if _normal(saved.get(name)) != _normal(getattr(config, name))
    }
    if differ:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in differ.items())
        raise ValueError(
            f"cannot resume from {path}: the training settings differ ({detail}); "
            f"use the same settings or start a new out_dir"
        )
    if saved.get("epochs") != config.epochs:
        warnings.warn(
            f"resuming {path} with epochs={config.epochs} (checkpoint: {saved.get('epochs')}); "
            f"the cosine schedule is stretched to the new length",
            stacklevel=3,
        )


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value
