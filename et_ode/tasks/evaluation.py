"""Score a trained image-completion checkpoint on any data beside the classical baselines, with fixed, saved masks.

:func:`evaluate_checkpoint` lets the checkpoint's model and the classical predictors of :data:`PREDICTORS` (the
per-position mean, the nearest training image, biharmonic inpainting: :mod:`et_ode.tasks.baselines`) complete the
same images with the same masks, and scores each by the masked-patch MSE, the training loss
(:func:`et_ode.models.image.masked_mse`). The baselines that learn from data use the run's training split, never the
evaluated images; the masks come from a seed or from an earlier evaluation, so two checkpoints evaluated on the same
data are scored on the same patches.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from et_ode.backend.validation import check_positive
from et_ode.data.images import ImageSet
from et_ode.models.image import fixed_mask_set, masked_mse, patchify, unpatchify
from et_ode.solving.integration import Dynamics, Integration, settings_to_dict
from et_ode.tasks.baselines import Biharmonic, MeanImage, NearestNeighbour
from et_ode.tasks.film import masked_picture
from et_ode.tasks.image import ImageRunConfig, energy_descent, evaluate_model, load_run_split, load_trained
from et_ode.training import runs
from et_ode.training.statefile import read_npz

PREDICTORS = ("et", "mean", "nearest", "biharmonic")
TITLES = {
    "et": "ET (the checkpoint)",
    "mean": "per-position mean of the training images",
    "nearest": "nearest training image on the visible patches",
    "biharmonic": "biharmonic inpainting (scikit-image)",
}


def evaluate_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    data: str | None = None,
    data_path: str | Path | None = None,
    test_path: str | Path | None = None,
    split: str = "test",
    limit: int | None = None,
    mask_seed: int | None = None,
    masks: str | Path | None = None,
    dynamics: Dynamics | None = None,
    predictors: tuple[str, ...] = PREDICTORS,
    batch_size: int = 250,
    grid: int = 8,
    overwrite: bool = False,
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Score ``checkpoint`` (``OUT/checkpoint.safetensors`` of ``et-ode train image``) and the baselines on one split.

    The files written to ``out_dir`` (a new or empty folder, :func:`et_ode.training.runs.claim`):

    * ``config.json``: what is evaluated (checkpoint, data, masks, dynamics);
    * ``evaluation.json``: the MSE, seconds and (the model) solver statistics of each predictor;
    * ``evaluation.md``: the same as a markdown table;
    * ``completions.npz``: ``images (n, C, H, W)``, ``hidden``, ``scored`` (boolean ``(n, N)``), for each predictor
      ``completion_<name> (n, C, H, W)`` (its patches where hidden, the input elsewhere) and ``mse_<name> (n,)`` (the
      per-image MSE over the scored pixels), all float32;
    * ``completions.png``: the first ``grid`` images: masked input, each predictor's completion, the truth.

    Args:
        checkpoint: the training checkpoint.
        out_dir: the folder of the files listed above.
        data, data_path: the evaluated source and its folder (default: the run's; the run's tile, stride and
            channels apply).
        test_path: a folder of PNG images evaluated instead (default: the run's, if it had one).
        split: ``"test"`` (default) or ``"validation"``.
        limit: evaluate only the first ``limit`` images.
        mask_seed: seed of the masks (default: the run's); the run's mask ratio and visible fraction apply.
        masks: an earlier evaluation's ``completions.npz`` whose ``hidden`` and ``scored`` masks are reused; they
            must be for as many images of the model's patch grid.
        dynamics: how the model runs its block, an :class:`~et_ode.Integration` or an
            :class:`~et_ode.AttractorReadout` (default: the run's).
        predictors: a subset of :data:`PREDICTORS`.
        batch_size: images per batch.
        grid: images shown in ``completions.png`` (0: no picture).
        overwrite: replace an earlier evaluation in ``out_dir``.
        device: where the model and the learned baselines run (biharmonic inpainting runs on the CPU).
        progress: tqdm bars.

    Returns:
        The dictionary written to ``evaluation.json``.

    Raises:
        et_ode.training.runs.RunFolderError: ``out_dir`` is a file or holds files, and ``overwrite`` is not set.
        ValueError: images of another shape than the model's, masks of another shape, an unknown predictor, or
            any data error (the argument named).
    """
    unknown = [p for p in predictors if p not in PREDICTORS]
    if unknown or not predictors:
        raise ValueError(f"predictors must name some of {', '.join(PREDICTORS)}, got {', '.join(predictors) or 'none'}")
    if split not in ("test", "validation"):
        raise ValueError(f"split must be test or validation, got {split!r}")
    check_positive("limit", limit, integer=True, optional=True)
    model, run = load_trained(checkpoint, device)
    source = _source(run, data, data_path, test_path, split)
    evaluated = _evaluated_images(run, source, model.image_shape)
    if limit is not None:
        evaluated = evaluated.subset(slice(0, limit))
    dynamics = dynamics or run.dynamics
    setup = {
        "checkpoint": str(Path(checkpoint).resolve()),
        **source,
        "limit": limit,
        "mask_seed": run.mask_seed if mask_seed is None else mask_seed,
        "masks": str(Path(masks).resolve()) if masks is not None else None,
        "ratio": run.ratio,
        "visible_fraction": run.visible_fraction,
        "dynamics": settings_to_dict(dynamics),
        "predictors": list(predictors),
    }
    with runs.claim(Path(out_dir), setup, overwrite=overwrite, command="evaluate") as out:
        images = evaluated.images
        if masks is not None:
            hidden, scored = _read_masks(masks, images.shape[0], model.num_patches)
        else:
            hidden, scored = fixed_mask_set(
                images, model.num_patches, run.ratio, run.visible_fraction, seed=setup["mask_seed"]
            ).tensors[1:]
        train_images = _training_images(run) if {"mean", "nearest"} & set(predictors) else None
        model_device = next(model.parameters()).device

        def reference() -> Tensor:  # the training images, loaded whenever "mean" or "nearest" is asked for
            assert train_images is not None
            return train_images

        makers: dict[str, Callable[[], nn.Module]] = {
            "et": lambda: model,
            "mean": lambda: MeanImage(reference(), model.patch).to(model_device),
            "nearest": lambda: NearestNeighbour(reference(), model.patch).to(model_device),
            "biharmonic": lambda: Biharmonic(model.image_shape, model.patch),
        }
        truth = patchify(images, model.patch)
        results: dict[str, Any] = {
            "checkpoint": setup["checkpoint"],
            "data": source,
            "images": images.shape[0],
            "image_shape": list(model.image_shape),
            "patches": model.num_patches,
            "hidden_per_image": float(hidden.sum(1).float().mean()),
            "mask_seed": setup["mask_seed"],
            "predictors": {},
        }
        arrays: dict[str, np.ndarray] = {"images": images.numpy(), "hidden": hidden.numpy(), "scored": scored.numpy()}
        completions: dict[str, Tensor] = {}
        for name in predictors:
            patches, entry = _predict(name, makers[name](), images, hidden, batch_size, dynamics, model_device, progress)
            entry["mse"] = float(masked_mse(patches, truth, scored))
            results["predictors"][name] = entry
            completion = unpatchify(torch.where(hidden[..., None], patches, truth), model.patch, model.image_shape)
            completions[name] = completion
            arrays[f"completion_{name}"] = completion.numpy()
            arrays[f"mse_{name}"] = _per_image_mse(patches, truth, scored).numpy()
        results["best"] = min(results["predictors"], key=lambda n: results["predictors"][n]["mse"])
        # numpy's stub types the keyword allow_pickle: bool, which a dict of arrays cannot rule out
        np.savez_compressed(out / "completions.npz", **arrays)  # type: ignore[arg-type]
        (out / "evaluation.json").write_text(json.dumps(results, indent=2))
        (out / "evaluation.md").write_text(_table(results, setup))
        files = ["config.json", "evaluation.json", "evaluation.md", "completions.npz"]
        if grid:
            _picture(
                images[:grid],
                hidden[:grid],
                {n: c[:grid] for n, c in completions.items()},
                model.patch,
                out / "completions.png",
            )
            files.append("completions.png")
        results["files"] = files
    return results


def _source(
    run: ImageRunConfig, data: str | None, data_path: str | Path | None, test_path: str | Path | None, split: str
) -> dict[str, Any]:
    """What is evaluated: the given source, else the run's. Another ``data`` drops the run's folders; another
    ``data_path`` drops the run's test folder; a ``test_path`` replaces the test split."""
    if data is None:
        data = run.data
        data_path = run.data_path if data_path is None else data_path
        test_path = run.test_path if test_path is None and data_path == run.data_path else test_path
    return {
        "data": data,
        "data_path": None if data_path is None else str(data_path),
        "test_path": None if test_path is None else str(test_path),
        "split": split,
    }


def _evaluated_images(run: ImageRunConfig, source: dict[str, Any], shape: tuple[int, int, int]) -> ImageSet:
    """The images of ``source`` (data, data_path, test_path, split), tiled like the run's and of its channels."""
    tiled = source["data"] in ("png", "photos") or source["test_path"] is not None
    where = dataclasses.replace(
        run,
        data=source["data"],
        data_path=source["data_path"],
        test_path=source["test_path"],
        channels=shape[0] if tiled else None,
        tile=run.tile if tiled else None,
        stride=run.stride if tiled else None,
        validation_fraction=run.validation_fraction if source["data"] == run.data else 0.0,
    )
    images = load_run_split(where, source["split"])
    if tuple(images.shape) != tuple(shape):
        raise ValueError(
            f"the evaluated images have shape {images.shape} (C, H, W); the model completes {tuple(shape)}: "
            f"give data of that size (PNG photos are cut into tiles of the run's tile size, {run.tile})"
        )
    return images


def _training_images(run: ImageRunConfig) -> Tensor:
    """The run's training images (what the model learned from), for the baselines that learn."""
    return load_run_split(run, "train", run.train_limit).images


def _read_masks(path: str | Path, count: int, num_patches: int) -> tuple[Tensor, Tensor]:
    try:
        saved = read_npz(path, ("hidden", "scored"), what="masks file", allow_empty=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"masks {path}: not the completions.npz of an evaluation ({error})") from None
    hidden, scored = torch.from_numpy(saved["hidden"]), torch.from_numpy(saved["scored"])
    for key, mask in (("hidden", hidden), ("scored", scored)):
        if mask.dtype != torch.bool:
            raise ValueError(f"masks {path}: {key!r} holds {mask.dtype} values; masks are boolean arrays")
        if tuple(mask.shape) != (count, num_patches):
            raise ValueError(
                f"masks {path}: {key!r} has shape {tuple(mask.shape)}; these {count} images of "
                f"{num_patches} patches need ({count}, {num_patches})"
            )
    if not bool(scored.any()):
        raise ValueError(f"masks {path}: 'scored' marks no patch, so there is nothing to score")
    return hidden, scored


def _predict(
    name: str,
    predictor: nn.Module,
    images: Tensor,
    hidden: Tensor,
    batch_size: int,
    dynamics: Dynamics,
    device: torch.device,
    progress: bool,
) -> tuple[Tensor, dict[str, Any]]:
    """``predictor``'s patches ``(n, N, C P P)`` on the CPU, and its seconds (and solver statistics)."""
    parts, entry = [], {"seconds": 0.0}
    nfe, solves = 0.0, 0
    started = time.perf_counter()
    predictor.eval()
    with torch.no_grad():
        for start in tqdm(range(0, images.shape[0], batch_size), desc=name, disable=not progress, leave=False):
            batch = images[start : start + batch_size].to(device)
            mask = hidden[start : start + batch_size].to(device)
            out = predictor(batch, mask, dynamics) if name == "et" else predictor(batch, mask)
            parts.append(out.patches.float().cpu())
            if out.solution is not None:
                nfe += out.solution.stats.nfe_forward
                solves += 1
    entry["seconds"] = time.perf_counter() - started
    if solves:
        entry["nfe_per_batch"] = nfe / solves
    return torch.cat(parts), entry


def _per_image_mse(patches: Tensor, truth: Tensor, scored: Tensor) -> Tensor:
    weight = scored.to(patches.dtype)[..., None]
    return ((patches - truth).square() * weight).sum((1, 2)) / (weight.sum((1, 2)) * patches.shape[-1]).clamp_min(1)


def _table(results: dict[str, Any], setup: dict[str, Any]) -> str:
    where = setup["test_path"] or f"{setup['data']} ({setup['data_path'] or 'built in'}), {setup['split']} split"
    lines = [
        f"# Evaluation of {setup['checkpoint']}",
        "",
        f"{results['images']} images of shape {tuple(results['image_shape'])} from {where}; "
        f"{results['hidden_per_image']:.1f} of {results['patches']} patches hidden per image "
        f"({'masks of ' + setup['masks'] if setup['masks'] else 'mask seed ' + str(setup['mask_seed'])}).",
        "",
        "| predictor | masked-patch MSE | seconds |",
        "| --- | --- | --- |",
    ]
    for name, entry in results["predictors"].items():
        mark = "**" if name == results["best"] else ""
        lines.append(f"| {TITLES[name]} | {mark}{entry['mse']:.5f}{mark} | {entry['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def _picture(images: Tensor, hidden: Tensor, completions: dict[str, Tensor], patch: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [("masked input", masked_picture(images, hidden, patch))]
    rows += [(name, completion.clamp(0, 1)) for name, completion in completions.items()] + [("truth", images)]
    count = images.shape[0]
    figure, axes = plt.subplots(len(rows), count, figsize=(1.2 * count, 1.3 * len(rows)), squeeze=False)
    for r, (name, row) in enumerate(rows):
        for c in range(count):
            picture = row[c].permute(1, 2, 0).numpy()
            axes[r][c].imshow(picture[..., 0] if picture.shape[-1] == 1 else picture, cmap="gray", vmin=0, vmax=1)
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([])
        axes[r][0].set_ylabel(name, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


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
            model, test, batch_size=batch_size, dynamics=integration, device=next(model.parameters()).device
        )
        entry: dict[str, Any] = {"integration": integration.to_dict(), **metrics}
        if integration.stop is None:
            entry["energy_descent"] = energy_descent(
                model, images, hidden, integration, points=energy_points, batch_size=batch_size
            )
        results[name] = entry
    return results
