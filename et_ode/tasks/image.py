"""The image-completion task: train an :class:`~et_ode.models.image.ImageET`, score it beside the baselines,
complete images over time, and the demo. Plain Python functions; ``et-ode train image``, ``et-ode complete`` and
``et-ode demo`` (:mod:`et_ode.cli.image`) only translate options into these calls.

    train_image(config: ImageRunConfig, out_dir=None) -> dict   # trains, evaluates against baselines, writes out_dir
    complete(checkpoint, out_dir, *, image=None, index=None, frames=9, t1=None, solver=None, ratio=None, seed=0,
             device="cpu") -> dict                      # film.pt, energy.csv, film_strip.png, energy.png
    demo(out_dir="runs/demo", *, quick=False) -> dict    # digits, bosh3 + adjoint, report.md with pictures
    compare_solvers(checkpoint, {name: Integration}, *, test_limit=None, batch_size=500) -> dict
    load_trained(checkpoint, device="cpu") -> (ImageET, ImageRunConfig)
    energy_descent(model, images, hidden, integration, points=25) -> dict   # counts energy rises per test image

Files written by ``train_image`` in ``out_dir``: ``config.json`` (the set-up, written once the folder is accepted:
see :func:`et_ode.training.runs.claim`), ``checkpoint.safetensors`` (resumable, data only, see :mod:`et_ode.training.train`),
``metrics.jsonl``, ``results.json`` (test MSE of the model and the baselines, NFE, energy checks),
``et_block.pt`` (the trained block, :func:`et_ode.training.io.save_model`), ``tokens.pt`` (encoded test token states,
a tensor ``(batch, N, D)``, for ``et-ode analyze``), ``tokens_meta.json``.

Data (:func:`et_ode.data.load_split`): the training, validation and test splits of ``config.data``; PNG folders and
the ``photos`` data set are split by source image, and ``config.test_path`` gives a separate folder of test images.
After each epoch the model is scored on the validation split when there is one (``validation_fraction > 0``, or
the photos' fixed split; ``val_size`` images spread evenly over it), else on the first ``val_size`` test images
(for watching the run only: choose settings on a validation split). The final scores are on the whole test
split, beside the per-position mean, the nearest training image and, when scikit-image is installed, biharmonic
inpainting. ``results.json`` also holds the cost of training (``train_cost``: steps, seconds per step, field
evaluations per step forward and backward).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from et_ode.backend import runtime
from et_ode.backend.devices import resolve_device
from et_ode.data.images import SOURCES, ImageSet, data_fingerprint, load_split, read_png
from et_ode.integrators.solvers import Adaptive, EulerET, Solver, as_solver
from et_ode.models.image import (
    DEFAULT_INTEGRATION,
    CompletionTask,
    ImageET,
    evaluate_completion,
    fixed_mask_set,
    patchify,
    random_masks,
    unpatchify,
)
from et_ode.solving.gradients import Adjoint, Direct
from et_ode.solving.integration import Integration
from et_ode.tasks.baselines import Biharmonic, MeanImage, NearestNeighbour
from et_ode.training import distributed, runs
from et_ode.training.statefile import FileFormatError
from et_ode.training.train import CHECKPOINT_NAME, TrainConfig, fit, load_checkpoint, training_cost


@dataclass
class ImageRunConfig:
    """Everything that defines an image-completion run (``train_image``)."""

    data: str = "digits"
    data_path: str | None = None
    test_path: str | None = None  # a folder of PNG test images (split by source; tiled like the data)
    tile: int | None = None  # png and photos: tiles of this side (photos: 16 when None)
    stride: int | None = None  # png and photos: tiles this far apart (default: tile)
    channels: int | None = None  # png and photos: 1 (grey) or 3 (RGB)
    validation_fraction: float = 0.0  # held out of the training split for validation (by source for png)
    train_limit: int | None = None
    test_limit: int | None = None
    val_size: int | None = 1000  # images evaluated each epoch (the full test split at the end)
    patch: int = 2
    dim: int = 32
    heads: int = 4
    head_dim: int = 8
    memories: int | None = None
    hopfield: str = "relu"
    cls_token: bool = False
    fill: str | None = None  # None: hidden patches start as MASK; "biharmonic": from the biharmonic fill (ImageET)
    tau: float = 1.0
    ratio: float = 0.5
    visible_fraction: float = 0.0
    integration: Integration = DEFAULT_INTEGRATION
    train: TrainConfig = field(default_factory=TrainConfig)
    mask_seed: int = 1234
    baselines: bool = True
    energy_check: bool = True
    tokens: int = 16
    threads: int | None = None
    init: str | None = None  # a train_image checkpoint whose weights start this run (same architecture)

    def __post_init__(self) -> None:
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise ValueError(f"threads must be None or a positive integer (--threads), got {self.threads!r}")
        if not (isinstance(self.tau, (int, float)) and 0 < self.tau < math.inf):
            raise ValueError(f"tau must be positive and finite (--tau), got {self.tau!r}")
        if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio < 1):
            raise ValueError(
                f"mask ratio must be in (0, 1) (--mask-ratio: the fraction of patches scored), got {self.ratio!r}"
            )
        if self.data not in SOURCES:
            raise ValueError(f"data must be one of {SOURCES} (--data), got {self.data!r}")
        if self.channels not in (None, 1, 3):
            raise ValueError(f"channels must be 1 or 3 (--channels), got {self.channels!r}")
        for name, value in (
            ("tile", self.tile),
            ("stride", self.stride),
            ("train_limit", self.train_limit),
            ("test_limit", self.test_limit),
            ("memories", self.memories),
        ):
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be a positive integer (--{name.replace('_', '-')}), got {value!r}")
        if self.val_size is not None and not (isinstance(self.val_size, int) and self.val_size >= 0):
            raise ValueError(f"val_size must be a non-negative integer (--val-size), got {self.val_size!r}")
        if self.data == "photos":  # its defaults, recorded in config.json: 16x16 grey tiles
            self.tile = 16 if self.tile is None else self.tile
            self.channels = 1 if self.channels is None else self.channels
        if not (isinstance(self.validation_fraction, (int, float)) and 0 <= self.validation_fraction < 1):
            raise ValueError(
                f"validation_fraction must be in [0, 1) (--validation-fraction), got {self.validation_fraction!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "integration": self.integration.to_dict()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ImageRunConfig:
        values = dict(values)
        integration = Integration.from_dict(values.pop("integration"))
        train = TrainConfig(**values.pop("train"))
        return cls(integration=integration, train=train, **values)


# Settings of an image run that a resume may change: how it executes, not what it computes.
RESUMABLE_CHANGES = (
    "threads",
    "baselines",
    "energy_check",
    "tokens",
    "train.device",
    "train.progress",
    "train.num_workers",
    "train.out_dir",
    "train.resume",
    "train.overwrite",
    "train.epochs",
    "train.checkpoint_every",
    "train.eval_every",
    "train.eval_batch_size",
    "train.max_time",
)


def load_run_split(config: ImageRunConfig, split: str, limit: int | None = None) -> ImageSet:
    """The ``split`` (``"train"``, ``"validation"``, ``"test"``) of the run's data, its first ``limit`` images."""
    data = load_split(
        config.data,
        config.data_path,
        split,
        test_path=config.test_path,
        tile=config.tile,
        stride=config.stride,
        channels=config.channels,
        validation_fraction=config.validation_fraction,
    )
    return data.subset(slice(0, limit)) if limit else data


def has_validation(config: ImageRunConfig) -> bool:
    """Does the run's data have a validation split (``validation_fraction > 0``, or the photos' fixed one)?"""
    return config.validation_fraction > 0 or config.data == "photos"


def biharmonic_available() -> bool:
    """Is scikit-image (the biharmonic baseline) installed?"""
    import importlib.util

    return importlib.util.find_spec("skimage") is not None


def build_model(config: ImageRunConfig, image_shape: Sequence[int]) -> ImageET:
    """The :class:`ImageET` of ``config`` for images of ``image_shape``, initialised from ``config.train.seed``."""
    torch.manual_seed(config.train.seed)
    return ImageET(
        tuple(image_shape),
        config.patch,
        config.dim,
        config.heads,
        config.head_dim,
        config.memories,
        cls_token=config.cls_token,
        hopfield=config.hopfield,
        tau=config.tau,
        integration=config.integration,
        fill=config.fill,
    )


def initialise_from(model: ImageET, checkpoint: str | Path) -> None:
    """Copy the weights of a ``train_image`` checkpoint into ``model`` (a warm start, e.g. the direct phase before
    training at the attractor: :class:`~et_ode.AttractorReadout` gives the encoder, positions and MASK token no
    gradient, so they keep these weights). ValueError naming ``init`` when the architectures differ."""
    trained, _ = load_trained(checkpoint)
    if trained.config() | {"integration": None} != model.config() | {"integration": None}:
        mine, theirs = model.config(), trained.config()
        differ = sorted(k for k in mine if k != "integration" and mine.get(k) != theirs.get(k))
        raise ValueError(f"init: the model in {checkpoint} differs from this run's in {differ}")
    model.load_state_dict(trained.state_dict())


def energy_descent(
    model: ImageET,
    images: torch.Tensor,
    hidden: torch.Tensor,
    integration: Integration,
    points: int = 25,
    batch_size: int = 500,
    rtol: float = 1e-9,
) -> dict[str, Any]:
    """Does the energy decrease along every inference trajectory? Saves ``points`` times from 0 to the horizon
    (:class:`~et_ode.EulerET`: every step), integrated without a stop.

    An *exception* is an image whose energy rises between two saved times by more than ``rtol * |E|``
    (float32 round-off). Returns counts and the largest relative change between saved times (negative when
    every step lowered the energy).
    """
    model.eval()
    exceptions, largest, total = 0, -math.inf, 0
    times = None if isinstance(integration.solver, EulerET) else torch.linspace(0.0, integration.t1, points)
    without_stop = integration.replace(gradient=Direct(), stop=None, attractor=None)
    with torch.no_grad():
        for start in range(0, images.shape[0], batch_size):
            x0 = model.tokens(images[start : start + batch_size], hidden[start : start + batch_size])
            sol = without_stop.solve(model.field(), x0, times, save="all" if times is not None else "steps")
            energies = sol.energies.double()  # (T, B)
            rise = (energies[1:] - energies[:-1]) / energies[:-1].abs().clamp_min(1e-12)
            worst = rise.max(dim=0).values
            exceptions += int((worst > rtol).sum())
            largest = max(largest, float(worst.max()))
            total += x0.shape[0]
    return {
        "images": total,
        "exceptions": exceptions,
        "largest_relative_change": largest,
        "saved_times": points,
        "method": integration.solver.name,
        "tolerance": rtol,
    }


def evaluate_model(
    model: torch.nn.Module,
    test: torch.utils.data.TensorDataset,
    batch_size: int = 500,
    integration: Integration | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Masked-patch MSE (and NFE, energy, time) of ``model`` on a fixed-mask test set."""
    device = device or torch.device("cpu")
    loader = torch.utils.data.DataLoader(test, batch_size=batch_size)
    model.eval()
    started = time.perf_counter()
    with torch.no_grad():
        metrics = evaluate_completion(model, ([t.to(device) for t in b] for b in loader), integration=integration)
    metrics["seconds"] = time.perf_counter() - started
    return metrics


def train_image(config: ImageRunConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Train an :class:`ImageET` on masked completion and write the results folder (see the module docstring).

    ``out_dir`` overrides ``config.train.out_dir``. Resumable: ``config.train.resume=True`` continues from
    ``out_dir/checkpoint.safetensors``. Returns the results dictionary also written to ``results.json``. Inside a
    process group (:func:`et_ode.training.distributed.session`) every rank trains; rank 0 alone then evaluates, writes the
    results and returns them, the other ranks return an empty dict.

    The folder is taken with :func:`et_ode.training.runs.claim` before anything is written: a folder holding files needs
    ``config.train.resume`` (with the same set-up, except :data:`RESUMABLE_CHANGES`) or ``config.train.overwrite``.

    Raises:
        et_ode.training.runs.RunFolderError: ``out_dir`` is a file, holds another run, is in use, or a resume changes the
            set-up (a table of the differences); nothing in it has changed then.
    """
    if out_dir is not None:
        config.train.out_dir = str(out_dir)
    out = Path(config.train.out_dir) if config.train.out_dir else None
    if out is None or not distributed.is_main():
        return _train_image(config, out)
    with runs.claim(
        out,
        config.to_dict(),
        resume=bool(config.train.resume),
        overwrite=config.train.overwrite,
        may_change=RESUMABLE_CHANGES,
        data=data_fingerprint(config.data, config.data_path, config.test_path),
    ):
        return _train_image(config, out)


def _train_image(config: ImageRunConfig, out: Path | None) -> dict[str, Any]:
    if config.threads:
        torch.set_num_threads(config.threads)
    train_set = load_run_split(config, "train", config.train_limit)
    test_set = load_run_split(config, "test", config.test_limit)
    model = build_model(config, train_set.shape)
    if config.init is not None:
        initialise_from(model, config.init)
    task = CompletionTask(config.ratio, config.visible_fraction)
    test = fixed_mask_set(test_set.images, model.num_patches, config.ratio, config.visible_fraction, seed=config.mask_seed)
    val: torch.utils.data.Dataset
    if has_validation(config):  # val_size images spread evenly over the split, so that every source is watched
        validation = load_run_split(config, "validation")
        if config.val_size and config.val_size < len(validation):
            validation = validation.subset(torch.linspace(0, len(validation) - 1, config.val_size).long())
        val = fixed_mask_set(
            validation.images, model.num_patches, config.ratio, config.visible_fraction, seed=config.mask_seed
        )
    else:
        val = (
            test
            if not config.val_size or config.val_size >= len(test)
            else torch.utils.data.Subset(test, range(config.val_size))
        )
    history = fit(model, task, train_set.images, val, config.train, meta={"run": config.to_dict(), "model": model.config()})
    if not distributed.is_main():
        return {}
    device = next(model.parameters()).device
    results: dict[str, Any] = {
        "data": config.data,
        "train_images": len(train_set),
        "test_images": len(test),
        "image_shape": list(train_set.shape),
        "patches": model.num_patches,
        "ratio": config.ratio,
        "visible_fraction": config.visible_fraction,
        "integration": config.integration.to_dict(),
        "epochs": config.train.epochs,
        "validated_on": "validation" if has_validation(config) else "test",
        "train_seconds": history.last("time"),
        "train_cost": training_cost(history),
    }
    if "stopped" in history.records[-1]:
        results["stopped"] = history.records[-1]["stopped"]
    results["model"] = evaluate_model(model, test, device=device)
    if config.baselines:
        results["mean_baseline"] = evaluate_model(MeanImage(train_set.images, config.patch).to(device), test, device=device)
        results["nearest_neighbour"] = evaluate_model(
            NearestNeighbour(train_set.images, config.patch).to(device), test, batch_size=250, device=device
        )
        results["improvement_over_mean"] = 1 - results["model"]["mse"] / results["mean_baseline"]["mse"]
        if biharmonic_available():
            results["biharmonic"] = evaluate_model(Biharmonic(model.image_shape, config.patch), test)
    if config.energy_check:
        images, hidden, _ = test.tensors
        results["energy_descent"] = energy_descent(model, images.to(device), hidden.to(device), config.integration)
    if out is not None:
        save_artifacts(model, test, out, config)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def save_artifacts(model: ImageET, test: torch.utils.data.TensorDataset, out: Path, config: ImageRunConfig) -> None:
    """``et_block.pt`` (the ET block with ``tau`` and the integration in its meta) and ``tokens.pt`` (encoded test
    tokens)."""
    from et_ode.training.io import save_model

    save_model(
        model.block,
        out / "et_block.pt",
        tau=model.tau,
        integration=model.integration.to_dict(),
        source="image",
        data=config.data,
        patch=config.patch,
    )
    images, hidden, _ = test.tensors
    count = min(config.tokens, images.shape[0])
    device = next(model.parameters()).device
    with torch.no_grad():
        tokens = model.tokens(images[:count].to(device), hidden[:count].to(device)).cpu()
    torch.save(tokens, out / "tokens.pt")
    (out / "tokens_meta.json").write_text(
        json.dumps(
            {
                "shape": list(tokens.shape),
                "what": "initial ET states x0 (batch, N, D) of masked test images",
                "test_indices": list(range(count)),
                "hidden": hidden[:count].tolist(),
                "model": "et_block.pt",
            }
        )
    )


def load_trained(checkpoint: str | Path, device: str = "cpu") -> tuple[ImageET, ImageRunConfig]:
    """The :class:`ImageET` and run configuration stored in a ``train_image`` checkpoint.

    Raises:
        FileNotFoundError: no file at ``checkpoint``.
        et_ode.training.statefile.FileFormatError (a ValueError): an unreadable checkpoint, or one whose model description
            (``meta.model``), run settings (``meta.run``) or weights (``model``) do not make a model; naming the file
            and the entry.
    """
    state = load_checkpoint(checkpoint, map_location=resolve_device(device), required=("model", "meta"))
    meta = state["meta"]
    if not isinstance(meta, dict) or "model" not in meta or "run" not in meta:
        raise FileFormatError(
            checkpoint,
            "meta",
            f"not an image-completion checkpoint (its meta has "
            f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__})",
        )
    try:
        model = ImageET.from_config(meta["model"])
    except ValueError as error:
        raise FileFormatError(checkpoint, "meta.model", str(error)) from None
    try:
        run = ImageRunConfig.from_dict(meta["run"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise FileFormatError(checkpoint, "meta.run", f"{type(error).__name__}: {error}") from None
    try:
        model.load_state_dict(state["model"])
    except ValueError as error:
        raise FileFormatError(checkpoint, "model", str(error)) from None
    return model.to(resolve_device(device)).eval(), run


def _analysis_plots() -> Any | None:
    """``et_ode.analysis.plots`` when it is installed, else None (pictures are then skipped)."""
    try:
        from et_ode.analysis import plots
    except ImportError:
        return None
    return plots


def _close(figure: Any) -> None:
    from matplotlib import pyplot as plt

    plt.close(figure)


#: the colour of hidden patches in pictures of masked inputs (RGB): no grey level of an image can be mistaken for it
MASK_COLOUR = (0.85, 0.1, 0.75)


def masked_picture(images: torch.Tensor, hidden: torch.Tensor, patch: int) -> torch.Tensor:
    """``images (B, C, H, W)`` as RGB pictures ``(B, 3, H, W)`` with their hidden patches (``hidden (B, N)``) painted
    in :data:`MASK_COLOUR`, so a hidden patch stands out on grey and colour images alike."""
    rgb = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
    patches = patchify(rgb, patch).clone()
    colour = torch.tensor(MASK_COLOUR, dtype=patches.dtype).repeat_interleave(patch * patch)
    patches[hidden] = colour
    return unpatchify(patches, patch, (3, *images.shape[2:]))


def _masked_view(image: torch.Tensor, hidden: torch.Tensor, patch: int) -> torch.Tensor:
    """``image (C, H, W)`` with its hidden patches (``hidden (N,)``) greyed out at 0.5."""
    patches = patchify(image[None], patch)[0].clone()
    patches[hidden] = 0.5
    return unpatchify(patches[None], patch, image.shape)[0]


def complete(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    image: str | Path | None = None,
    index: int | None = None,
    frames: int = 9,
    t1: float | None = None,
    solver: Solver | str | None = None,
    ratio: float | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Complete one masked image with a trained model and record the completion over time.

    The image is a PNG file (``image``, the model's size) or image ``index`` of the run's test split (the split
    ``train_image`` scored, in its order: ``--test-path`` images when the run had them). Patches are
    hidden at random (``ratio``, default the run's) with ``seed``. The run's integration is used, with ``t1`` and
    ``solver`` replaced when given (a method's name keeps the run's tolerances where both are adaptive); ``frames``
    equally spaced times from 0 to ``t1`` are saved (:class:`~et_ode.EulerET` saves each of its steps). Writes to
    ``out_dir``: ``film.pt``
    (frames ``(T, C, H, W)``, times, target, masked input, hidden), ``energy.csv`` (time, energy), and when
    ``et_ode.analysis.plots`` is present ``film_strip.png`` and ``energy.png``. Returns a summary.
    """
    if (image is None) == (index is None):
        raise ValueError("give exactly one of image (a PNG file) and index (a test image of the run's data)")
    if not (isinstance(frames, int) and frames >= 2):
        raise ValueError(f"frames must be an integer >= 2 (--frames), got {frames!r}")
    model, run = load_trained(checkpoint, device)
    integration = run.integration.replace(attractor=None)  # a film follows the flow
    if t1 is not None:
        integration = integration.replace(t1=t1)
    if solver is not None:
        trained, chosen = integration.solver, as_solver(solver)
        if isinstance(solver, str) and isinstance(chosen, Adaptive) and isinstance(trained, Adaptive):
            chosen = Adaptive(solver, trained.rtol, trained.atol)  # another adaptive method at the run's tolerances
        integration = integration.replace(solver=chosen)
    times = None if isinstance(integration.solver, EulerET) else torch.linspace(0.0, integration.t1, frames)
    if image is not None:
        target: torch.Tensor = read_png(image, channels=model.image_shape[0])
        if tuple(target.shape) != model.image_shape:
            raise ValueError(
                f"image {image} has shape {tuple(target.shape)} (C, H, W); this model completes "
                f"images of shape {model.image_shape}"
            )
    else:
        test = load_run_split(run, "test")
        if not (isinstance(index, int) and 0 <= index < len(test)):
            raise ValueError(
                f"--index must be in [0, {len(test)}) for the test split of the run's data "
                f"({run.test_path or run.data}), got {index}"
            )
        target = test.images[index]
    ratio = run.ratio if ratio is None else ratio
    hidden, _ = random_masks(
        1, model.num_patches, ratio, visible_fraction=run.visible_fraction, generator=torch.Generator().manual_seed(seed)
    )
    target = target.to(next(model.parameters()).device)
    film, solution = model.film(target[None], hidden.to(target.device), times, integration)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    masked = _masked_view(target.cpu(), hidden[0], model.patch)
    ts = solution.ts.cpu()
    torch.save(
        {
            "frames": film[:, 0].cpu(),
            "times": ts,
            "target": target.cpu(),
            "masked": masked,
            "hidden": hidden[0],
            "energies": solution.energies[:, 0].cpu(),
        },
        out / "film.pt",
    )
    energies = solution.energies[:, 0].double().cpu()
    (out / "energy.csv").write_text(
        "time,energy\n" + "".join(f"{float(t)!r},{float(e)!r}\n" for t, e in zip(ts, energies, strict=True))
    )
    written = ["film.pt", "energy.csv"]
    plots = _analysis_plots()
    if plots is not None:
        _close(plots.plot_film_strip(film[:, 0].cpu(), ts, target=target.cpu(), masked=masked, path=out / "film_strip.png"))
        _close(plots.plot_convergence(solution, path=out / "energy.png"))
        written += ["film_strip.png", "energy.png"]
    scored = hidden[0].to(film.device)
    error = (patchify(film[-1], model.patch)[0] - patchify(target[None], model.patch)[0])[scored]
    return {
        "files": written,
        "masked_mse": float(error.square().mean()),
        "times": ts.tolist(),
        "energies": energies.tolist(),
        "monotone": bool((energies[1:] <= energies[:-1]).all()),
    }


def demo_config(quick: bool = False) -> ImageRunConfig:
    """The demo's run: bundled 8x8 digits, 4x4 patches, half hidden, trained through the adaptive Bogacki-Shampine
    solver (bosh3) with the adjoint (``quick``: a smoke run). Measured time: :data:`DEMO_TIME` (bosh3 needs about
    half of dopri5's evaluations at this tolerance)."""
    integration = Integration(
        solver=Adaptive("bosh3", rtol=1e-2, atol=1e-3), gradient=Adjoint(seminorm=True), t1=0.6, max_steps=2000
    )
    train = TrainConfig(
        epochs=1 if quick else DEMO_EPOCHS,
        batch_size=32,
        lr=3e-3,
        warmup=0.05,
        seed=0,
        device="auto",
        eval_every=5,
        progress=not quick,
    )
    return ImageRunConfig(
        data="digits",
        train_limit=64 if quick else None,
        test_limit=32 if quick else None,
        val_size=0,
        patch=4,
        dim=64,
        heads=4,
        head_dim=16,
        tau=1.0,
        ratio=0.5,
        integration=integration,
        train=train,
        threads=1,
    )


DEMO_EPOCHS = 35
#: what the whole `make demo` took, and where (docs/performance.md)
DEMO_TIME = (
    "2 min 4-10 s on an idle 2-core AMD EPYC at one thread; 4 min 16 s on the same kind of machine under "
    "a load average of 2-6"
)
# the demo's second look at its model: dopri5 a thousand times tighter than the training tolerance
TIGHT_SOLVER = Adaptive("dopri5", rtol=1e-6, atol=1e-8)
TIGHT_INTEGRATION = Integration(solver=TIGHT_SOLVER, gradient=Direct(), max_steps=20_000)


def demo(
    out_dir: str | Path = "runs/demo",
    *,
    quick: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    """Train the demo model and write ``out_dir/report.md`` with its pictures (see :func:`demo_config`).

    Pictures: completions against ground truth (``completions.png``), energy descent during inference and the
    token trajectories up to the horizon (``convergence.png``, ``trajectories.png`` from :mod:`et_ode.analysis.plots`
    when present), a film strip of one completion over time, and the test MSE against the baselines (``mse.png``).
    ``threads``: PyTorch's CPU threads (default 1).
    A folder holding files needs ``resume`` or ``overwrite`` (:func:`et_ode.training.runs.claim`; RunFolderError otherwise).
    """
    out = Path(out_dir)
    config = demo_config(quick)
    config.train.out_dir = str(out)
    config.train.resume, config.train.overwrite = resume, overwrite
    if threads is not None:
        config.threads = threads
    with runs.claim(out, config.to_dict(), resume=resume, overwrite=overwrite, may_change=RESUMABLE_CHANGES):
        return _demo(out, config)


def _demo(out: Path, config: ImageRunConfig) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    started = time.perf_counter()
    if config.train.progress:
        print(f"et-ode demo: measured {DEMO_TIME}. This machine: {runtime.cpu_description()}.", file=sys.stderr, flush=True)
    results = train_image(config)
    model, _ = load_trained(out / CHECKPOINT_NAME)
    test_set = load_run_split(config, "test", config.test_limit)
    test = fixed_mask_set(test_set.images, model.num_patches, config.ratio, config.visible_fraction, seed=config.mask_seed)
    images, hidden, _ = test.tensors
    # the same model integrated far more accurately: a continuous-time model's answer must not hinge on the solver
    results["model_tight_solver"] = evaluate_model(
        model, test, integration=TIGHT_INTEGRATION.replace(t1=config.integration.t1)
    )
    show = min(8, len(images))
    with torch.no_grad():  # hidden patches from the predictor, visible ones from the input
        truth = patchify(images[:show], model.patch)
        keep = hidden[:show, :, None]
        nearest = NearestNeighbour(load_run_split(config, "train", config.train_limit).images, model.patch)
        completed = unpatchify(
            torch.where(keep, model(images[:show], hidden[:show]).patches, truth), model.patch, model.image_shape
        )
        neighbour = unpatchify(
            torch.where(keep, nearest(images[:show], hidden[:show]).patches, truth), model.patch, model.image_shape
        )
    rows = [
        ("masked input", masked_picture(images[:show], hidden[:show], model.patch)),
        ("ET completion", completed.clamp(0, 1)),
        ("nearest neighbour", neighbour),
        ("ground truth", images[:show]),
    ]
    figure, axes = plt.subplots(len(rows), show, figsize=(1.2 * show, 1.3 * len(rows)), squeeze=False)
    for r, (name, row) in enumerate(rows):
        for c in range(show):
            axes[r][c].imshow(row[c].permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray", vmin=0, vmax=1)
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([])
        axes[r][0].set_ylabel(name, fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "completions.png", dpi=120)
    plt.close(figure)

    names = ["ET", "per-position mean", "nearest neighbour"]
    values = [results["model"]["mse"], results["mean_baseline"]["mse"], results["nearest_neighbour"]["mse"]]
    figure, axis = plt.subplots(figsize=(4.5, 2.6))
    axis.barh(names, values, color=["tab:blue", "tab:gray", "tab:orange"])
    axis.set_xlabel(f"masked-patch MSE on {len(images)} test images")
    figure.tight_layout()
    figure.savefig(out / "mse.png", dpi=120)
    plt.close(figure)

    pictures = ["completions.png", "mse.png"]
    plots = _analysis_plots()
    if plots is not None:
        with torch.no_grad():
            solution = config.integration.replace(gradient=Direct(), attractor=None).solve(
                model.field(),
                model.tokens(images[:show], hidden[:show]),
                torch.linspace(0, config.integration.t1, 25),
                save="all",
            )
        _close(plots.plot_convergence(solution, path=out / "convergence.png"))
        _close(plots.plot_trajectories(solution, sample=0, path=out / "trajectories.png"))
        film = complete(out / CHECKPOINT_NAME, out / "film", index=0, seed=config.mask_seed)
        del film
        pictures += ["convergence.png", "trajectories.png", "film/film_strip.png"]
    results["demo_seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(_demo_report(results, config, pictures))
    return results


def _cost_line(results: dict[str, Any]) -> str:
    """One sentence on the cost of a training step (``results["train_cost"]``,
    :func:`et_ode.training.train.training_cost`)."""
    cost = results.get("train_cost", {})
    if "seconds_per_step" not in cost:
        return ""
    return (
        f"{cost['steps']} steps of {cost['seconds_per_step']:.3f} s, with {cost.get('nfe_forward_per_step', 0):.1f} "
        f"forward and {cost.get('nfe_backward_per_step', 0):.1f} backward field evaluations per step."
    )


def _against_nearest(ours: float, nearest: float) -> str:
    side = "below" if ours < nearest else "above"
    return f"Against the nearest training image on the visible patches it is {abs(ours / nearest - 1):.1%} {side}."


def _biharmonic_lines(results: dict[str, Any]) -> list[str]:
    """The biharmonic baseline's score, and why it is poor on these images."""
    if "biharmonic" not in results:
        return []
    score, mean = results["biharmonic"]["mse"], results["mean_baseline"]["mse"]
    return [
        f"Biharmonic inpainting (scikit-image, no training) scores {score:.4f} here, {score / mean:.1f}x the "
        f"per-position mean's error. An 8x8 digit has only four 4x4 patches, so half hidden leaves two: each hole "
        f"is a quarter of the image, bordered by a few visible pixels, and the biharmonic surface through them "
        f"overshoots (it obeys no maximum principle) into saturated fills. On photographs, where holes are small "
        f"among many visible pixels, it is the strongest classical baseline.",
        "",
    ]


def _relative(improvement: float) -> str:
    side = "below" if improvement >= 0 else "above"
    return f"The ET's test error is {abs(improvement):.1%} {side} the per-position mean baseline's."


def _demo_report(results: dict[str, Any], config: ImageRunConfig, pictures: list[str]) -> str:
    model, mean, nearest = results["model"], results["mean_baseline"], results["nearest_neighbour"]
    descent = results.get("energy_descent", {})
    s = config.integration
    lines = [
        "# et-ode demo: masked completion of 8x8 digits with a continuous-time Energy Transformer",
        "",
        f"Data: scikit-learn digits, {results['train_images']} training and {results['test_images']} test images, "
        f"{config.patch}x{config.patch} patches ({results['patches']} tokens), {config.ratio:.0%} of the patches hidden "
        f"behind the MASK token.",
        f"Model: D={config.dim}, H={config.heads}, Y={config.head_dim}, K={config.memories or 4 * config.dim} "
        f"(relu Hopfield), tau={config.tau}.",
        f"Dynamics: {s.solver} from t=0 to t={s.t1}; gradients by {s.gradient}. "
        f"Training: {config.train.epochs} epochs of AdamW (lr {config.train.lr}, warm-up then cosine), "
        f"{results['train_seconds']:.0f} s; whole demo {results.get('demo_seconds', 0):.0f} s. " + _cost_line(results),
        "",
        "## Test masked-patch MSE (same masks, same evaluation code)",
        "",
        "| predictor | MSE |",
        "|---|---|",
        f"| ET ({s.solver.name}, mean NFE {model.get('nfe', 0):.0f} per batch) | {model['mse']:.4f} |",
        f"| the same ET integrated by dopri5 at rtol {TIGHT_SOLVER.rtol:g} (mean NFE "
        f"{results['model_tight_solver'].get('nfe', 0):.0f}) | {results['model_tight_solver']['mse']:.4f} |",
        f"| per-position mean of the training images | {mean['mse']:.4f} |",
        f"| nearest training image on the visible patches | {nearest['mse']:.4f} |",
        "",
        _relative(results["improvement_over_mean"]) + " " + _against_nearest(model["mse"], nearest["mse"]),
        "",
        *_biharmonic_lines(results),
        "## Energy during inference",
        "",
        f"Along the inference trajectory of every test image ({descent.get('images', 0)} images, "
        f"{descent.get('saved_times', 0)} saved times from 0 to t1), the energy rose between two saved times on "
        f"**{descent.get('exceptions', '?')}** images (largest relative change between saved times "
        f"{descent.get('largest_relative_change', 0):.2e}; "
        f"a rise counts when it exceeds {descent.get('tolerance', 0):.0e} of |E|).",
        "",
        "## Pictures",
        "",
    ]
    captions = {
        "completions.png": "Masked inputs (hidden patches in magenta); the hidden patches filled by the ET "
        "and by the nearest neighbour; the truth.",
        "mse.png": "Test MSE against the baselines.",
        "convergence.png": "Energy descent (and convergence measures) during inference, 8 test images.",
        "trajectories.png": f"Token trajectories of one test image from t=0 to the horizon t={s.t1}, "
        f"where the answer is read: a transient, not an attractor (the flow goes on "
        f"moving after t={s.t1}).",
        "film/film_strip.png": f"One completion over time, from the MASK tokens at t=0 to the answer at the "
        f"horizon t={s.t1}.",
    }
    for picture in pictures:
        lines += [f"![{picture}]({picture})", "", captions.get(picture, ""), ""]
    if "convergence.png" not in pictures:
        lines += [
            "(et_ode.analysis.plots was not installed: the convergence, attractor and film pictures were skipped.)",
            "",
        ]
    return "\n".join(lines)


def compare_solvers(
    checkpoint: str | Path,
    integrations: dict[str, Integration],
    *,
    test_limit: int | None = None,
    batch_size: int = 500,
    energy_points: int = 13,
    device: str = "cpu",
) -> dict[str, Any]:
    """Evaluate one trained model under several integrations of its dynamics, on the run's fixed test masks.

    For each named :class:`~et_ode.Integration`: masked-patch MSE, mean forward NFE per batch, solve seconds, mean
    final time and residual, and the energy-descent check (:func:`energy_descent`; skipped for steady-state
    solves, whose horizon differs per batch).
    """
    model, run = load_trained(checkpoint, device)
    test_set = load_run_split(run, "test", test_limit or run.test_limit)
    test = fixed_mask_set(test_set.images, model.num_patches, run.ratio, run.visible_fraction, seed=run.mask_seed)
    images, hidden, _ = test.tensors
    results: dict[str, Any] = {"checkpoint": str(checkpoint), "test_images": len(test)}
    for name, integration in integrations.items():
        metrics = evaluate_model(
            model, test, batch_size=batch_size, integration=integration, device=next(model.parameters()).device
        )
        entry: dict[str, Any] = {"integration": integration.to_dict(), **metrics}
        if integration.stop is None:
            entry["energy_descent"] = energy_descent(
                model, images, hidden, integration, points=energy_points, batch_size=batch_size
            )
        results[name] = entry
    return results
