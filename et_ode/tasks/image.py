"""The image-completion task's training recipe: a run's settings, its data and model, training, and the trained model.

:func:`train_image` (``et-ode train image``) trains an :class:`~et_ode.models.image.ImageET` on masked completion,
scores it on the whole test split beside the per-position mean, the nearest training image and, when scikit-image is
installed, biharmonic inpainting, and writes its run folder: ``config.json`` (the set-up, see
:func:`et_ode.training.runs.claim`), ``checkpoint.safetensors`` and ``metrics.jsonl`` (:func:`et_ode.training.train.fit`),
``results.json`` (the test scores, the energy check, the cost of training), ``et_block.pt`` and ``tokens.pt`` (the
trained block and encoded test token states ``(batch, N, D)``, for ``et-ode analyze``).

Data (:func:`et_ode.data.load_split`): the training, validation and test splits of ``config.data``; PNG folders and
the ``photos`` data set are split by source image, and ``config.test_path`` gives a separate folder of test images.
After each epoch the model is scored on the validation split when there is one, else on the first ``val_size`` test
images (for watching the run only: choose settings on a validation split).
:func:`load_trained` rebuilds the model and its settings from a checkpoint; :mod:`et_ode.tasks.film` completes an
image with it over time, :mod:`et_ode.tasks.evaluation` scores it on other data, :mod:`et_ode.tasks.demo` is the demo.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from et_ode.backend.devices import resolve_device
from et_ode.backend.validation import check_positive
from et_ode.data.images import SOURCES, ImageSet, Source, Split, data_fingerprint, load_split
from et_ode.energy.energies import HopfieldForm
from et_ode.equilibrium.attractor import AttractorReadout
from et_ode.integrators.solvers import EulerET
from et_ode.models.image import DEFAULT_INTEGRATION, CompletionTask, ImageET, evaluate_completion, fixed_mask_set
from et_ode.solving.gradients import Direct
from et_ode.solving.integration import Dynamics, Integration, settings_from_dict, settings_to_dict
from et_ode.tasks.baselines import Biharmonic, MeanImage, NearestNeighbour
from et_ode.training import distributed, runs
from et_ode.training.statefile import FileFormatError
from et_ode.training.train import TrainConfig, fit, load_checkpoint, training_cost


@dataclass
class ImageRunConfig:
    """Everything that defines an image-completion run (``train_image``)."""

    data: Source = "digits"
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
    hopfield: HopfieldForm = "relu"
    cls_token: bool = False
    fill: Literal["biharmonic"] | None = None  # None: hidden patches start as MASK; "biharmonic": the fill (ImageET)
    tau: float = 1.0
    ratio: float = 0.5
    visible_fraction: float = 0.0
    integration: Integration = DEFAULT_INTEGRATION  # the model's dynamics unless `attractor`; films and energy checks
    attractor: AttractorReadout | None = None  # the model reads its answer at the attractor (its dynamics)
    train: TrainConfig = field(default_factory=TrainConfig)
    mask_seed: int = 1234
    baselines: bool = True
    energy_check: bool = True
    tokens: int = 16
    threads: int | None = None
    init: str | None = None  # a train_image checkpoint whose weights start this run (same architecture)

    def __post_init__(self) -> None:
        check_positive("threads", self.threads, integer=True, optional=True)
        check_positive("tau", self.tau)
        if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio < 1):
            raise ValueError(f"mask ratio must be in (0, 1) (the fraction of patches scored), got {self.ratio!r}")
        if self.data not in SOURCES:
            raise ValueError(f"data must be one of {SOURCES}, got {self.data!r}")
        if self.channels not in (None, 1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels!r}")
        for name, value in (
            ("tile", self.tile),
            ("stride", self.stride),
            ("train_limit", self.train_limit),
            ("test_limit", self.test_limit),
            ("memories", self.memories),
        ):
            check_positive(name, value, integer=True, optional=True)
        if self.val_size is not None and not (isinstance(self.val_size, int) and self.val_size >= 0):
            raise ValueError(f"val_size must be a non-negative integer, got {self.val_size!r}")
        if self.data == "photos":  # its defaults, recorded in config.json: 16x16 grey tiles
            self.tile = 16 if self.tile is None else self.tile
            self.channels = 1 if self.channels is None else self.channels
        if not (isinstance(self.validation_fraction, (int, float)) and 0 <= self.validation_fraction < 1):
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction!r}")
        if self.attractor is not None and not isinstance(self.attractor, AttractorReadout):
            raise TypeError(f"attractor must be an et_ode.AttractorReadout or None, got {type(self.attractor).__name__}")

    @property
    def dynamics(self) -> Dynamics:
        """How the model runs its block: ``attractor`` when given, else ``integration``."""
        return self.integration if self.attractor is None else self.attractor

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "integration": self.integration.to_dict(),
            "attractor": None if self.attractor is None else settings_to_dict(self.attractor),
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ImageRunConfig:
        values = dict(values)
        attractor = values.pop("attractor")
        return cls(
            integration=Integration.from_dict(values.pop("integration")),
            attractor=None if attractor is None else settings_from_dict(attractor),
            train=TrainConfig(**values.pop("train")),
            **values,
        )


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


def load_run_split(config: ImageRunConfig, split: Split, limit: int | None = None) -> ImageSet:
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
        dynamics=config.dynamics,
        fill=config.fill,
    )


def initialise_from(model: ImageET, checkpoint: str | Path) -> None:
    """Copy the weights of a ``train_image`` checkpoint into ``model`` (a warm start, e.g. the direct phase before
    training at the attractor: :class:`~et_ode.AttractorReadout` gives the encoder, positions and MASK token no
    gradient, so they keep these weights). ValueError naming ``init`` when the architectures differ."""
    trained, _ = load_trained(checkpoint)
    if trained.config() | {"dynamics": None} != model.config() | {"dynamics": None}:
        mine, theirs = model.config(), trained.config()
        differ = sorted(k for k in mine if k != "dynamics" and mine.get(k) != theirs.get(k))
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
    t = None if isinstance(integration.solver, EulerET) else torch.linspace(0.0, integration.t1, points)
    without_stop = integration.replace(gradient=Direct(), stop=None)
    with torch.no_grad():
        for start in range(0, images.shape[0], batch_size):
            x0 = model.tokens(images[start : start + batch_size], hidden[start : start + batch_size])
            sol = without_stop.solve(model.field(), x0, t)
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
    dynamics: Dynamics | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Masked-patch MSE (and NFE, energy, time) of ``model`` on a fixed-mask test set (an ET model with its own
    dynamics, or ``dynamics`` when given)."""
    device = device or torch.device("cpu")
    loader = torch.utils.data.DataLoader(test, batch_size=batch_size)
    model.eval()
    started = time.perf_counter()
    with torch.no_grad():
        metrics = evaluate_completion(model, ([t.to(device) for t in b] for b in loader), dynamics=dynamics)
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
        "dynamics": settings_to_dict(config.dynamics),
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
    """``et_block.pt`` (the ET block with ``tau`` and the dynamics in its meta) and ``tokens.pt`` (encoded test
    tokens)."""
    from et_ode.training.io import save_model

    save_model(
        model.block,
        out / "et_block.pt",
        tau=model.tau,
        dynamics=settings_to_dict(model.dynamics),
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
