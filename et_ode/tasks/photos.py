"""Photos in, pictures out: the official release's pretrained model on real images, studied as an ODE.

:func:`complete_photos` loads an official-format checkpoint (:mod:`et_ode.models.official`), reads RGB photos
(scaled and centre-cropped to the model's size, normalised as the release does), hides a reproducible set of patches
(the release's scheme) and completes every photo three ways: the release's 12 Euler steps of 0.1, dopri5 to the same
time ``t = 1.2 tau``, and dopri5 to the steady state. It writes the reconstructions side by side with the energy
against time, the Lyapunov verdict of each solve (:func:`et_ode.analysis.check_lyapunov`) and ``report.md``.
:func:`official_tokens` gives the initial states of photos, for the analysis report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from et_ode.backend.validation import check_positive
from et_ode.data.images import read_photo
from et_ode.integrators.solution import Solution
from et_ode.integrators.solvers import Adaptive, EulerET
from et_ode.integrators.stopping import SteadyState
from et_ode.models.image import ImageET, patchify, unpatchify
from et_ode.models.official import denormalize, load_official, normalize_pixels, official_masks
from et_ode.solving.integration import Integration
from et_ode.solving.solve import solve
from et_ode.training import runs

PathLike = str | os.PathLike[str]
SOLVES = ("euler", "dopri5", "steady_state")
TITLES = {
    "euler": "official: 12 Euler steps of 0.1",
    "dopri5": "dopri5 to the same time",
    "steady_state": "dopri5 to the steady state",
}


def official_tokens(
    checkpoint: PathLike,
    photos: Sequence[PathLike],
    *,
    image_shape: Sequence[int] = (3, 224, 224),
    patch: int = 16,
    masked: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[ImageET, Tensor, Tensor, Tensor]:
    """The official model, the photos' pixels ``(B, 3, H, W)`` uint8, the normalized images in ``dtype`` and the
    masks ``hidden (B, N)`` (``masked`` patches per photo, default 100 of 196 scaled; seeded by ``seed``).
    The initial ET states are then ``model.tokens(images, hidden)``, ``(B, 1 + N, D)``."""
    if isinstance(photos, (str, os.PathLike)) or not photos:
        raise ValueError(f"photos must be a non-empty list of image files, got {photos!r}")
    model = load_official(checkpoint, image_shape, patch, dtype=dtype)
    if model.image_shape[0] != 3:
        raise ValueError(f"photos are RGB: image_shape must have 3 channels, got {model.image_shape}")
    size = model.image_shape[1:]
    pixels = torch.stack([read_photo(path, size) for path in photos])
    images = normalize_pixels(pixels).to(dtype)
    hidden = official_masks(len(photos), model.num_patches, masked, seed=seed)
    return model, pixels, images, hidden


def _solves(model: ImageET, x0: Tensor, *, rtol: float, atol: float, steady_state: float, t1: float) -> dict[str, Solution]:
    """The three solves of one photo's tokens ``x0 (1, 1 + N, D)``, each keeping its states for the checks."""
    field, integration = model.field(), model.dynamics
    if not (isinstance(integration, Integration) and isinstance(integration.solver, EulerET)):
        raise ValueError(f"the model must integrate with the release's EulerET scheme, got {integration!r}")
    euler = integration.solver
    horizon = euler.steps * euler.alpha * model.tau
    dopri5 = Adaptive("dopri5", rtol=rtol, atol=atol)
    with torch.no_grad():
        return {
            "euler": integration.solve(field, x0),
            "dopri5": solve(
                field, x0, torch.linspace(0.0, horizon, 25, dtype=torch.float64), solver=dopri5, max_steps=100_000
            ),
            "steady_state": solve(
                field, x0, (0.0, t1), solver=dopri5, stop=SteadyState(steady_state), max_steps=100_000, save="steps"
            ),
        }


def complete_photos(
    checkpoint: PathLike,
    photos: Sequence[PathLike],
    out_dir: PathLike,
    *,
    image_shape: Sequence[int] = (3, 224, 224),
    patch: int = 16,
    masked: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    steady_state: float = 1e-3,
    t1: float = 100.0,
    device: str | torch.device = "cpu",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Complete masked photos with the official model three ways; write pictures, ``report.md`` and the tensors.

    Args:
        checkpoint: an official-format ``.npz`` (:func:`et_ode.models.official.load_official`).
        photos: image files (any size; scaled and center-cropped to ``image_shape``).
        out_dir: the folder to write; it must be new or empty unless ``overwrite``.
        image_shape, patch: the checkpoint's image size and patch side (the release: (3, 224, 224), 16).
        masked, seed: patches hidden per photo (default 100 of 196, scaled) and the seed of the masks.
        dtype: torch.float32 or torch.float64.
        rtol, atol: the adaptive solves' tolerances.
        steady_state, t1: the steady-state solve stops where RMS |dg/dt| < ``steady_state``, or at ``t1``.
        device: where to compute.
        overwrite: write into a non-empty ``out_dir``.
        progress: a progress bar over the photos.

    Writes ``photo_<k>.png`` (photo, masked input, the three reconstructions, energy against time),
    ``completions.pt`` (a dict of tensors: ``pixels``, ``images``, ``hidden`` and each solve's reconstruction
    ``(B, 3, H, W)`` in normalized units, read with ``torch.load(..., weights_only=True)``), ``report.json`` and
    ``report.md``. Returns the summary of ``report.json``.

    Raises:
        et_ode.training.runs.RunFolderInUse (a FileExistsError and a ValueError): ``out_dir`` is not empty and
            ``overwrite`` is False, or ``overwrite`` names a folder that is not a run of ``et-ode complete``.
        et_ode.training.runs.RunFolderError: ``out_dir`` is a file, a dangling link or in use (RunWriteError: a full disk).
        FileNotFoundError, ValueError: a missing or unreadable checkpoint or photo, bad sizes or settings. A
            refused call leaves ``out_dir`` unchanged.
    """
    for name, value in (("steady_state", steady_state), ("t1", t1), ("rtol", rtol), ("atol", atol)):
        check_positive(name, value)
    out = Path(out_dir)
    setup = {
        "checkpoint": str(checkpoint),
        "photos": [str(p) for p in photos],
        "image_shape": list(image_shape),
        "patch": patch,
        "masked": masked,
        "seed": seed,
        "dtype": str(dtype),
        "rtol": rtol,
        "atol": atol,
        "steady_state": steady_state,
        "t1": t1,
    }
    with runs.claim(out, setup, overwrite=overwrite, command="complete"):
        model, pixels, images, hidden = official_tokens(
            checkpoint, photos, image_shape=image_shape, patch=patch, masked=masked, seed=seed, dtype=dtype
        )
        return _complete_photos(
            out, model.to(torch.device(device)), photos, pixels, images, hidden, setup, progress=progress
        )


def _complete_photos(
    out: Path,
    model: ImageET,
    photos: Sequence[PathLike],
    pixels: Tensor,
    images: Tensor,
    hidden: Tensor,
    setup: dict[str, Any],
    *,
    progress: bool,
) -> dict[str, Any]:
    """The three solves of every photo, written into the claimed folder ``out``; returns the summary."""
    from et_ode.analysis import check_lyapunov  # downstream of the model: imported where it is used

    device = model.block.neuron.delta.device
    rtol, atol, steady_state, t1 = (setup[k] for k in ("rtol", "atol", "steady_state", "t1"))
    checkpoint, dtype, seed = setup["checkpoint"], images.dtype, setup["seed"]
    reconstructions: dict[str, list[Tensor]] = {name: [] for name in SOLVES}
    records = []
    for k in tqdm(range(len(photos)), desc="photos", disable=not progress):
        image, mask = images[k : k + 1].to(device), hidden[k : k + 1].to(device)
        x0 = model.tokens(image, mask).detach()
        solutions = _solves(model, x0, rtol=rtol, atol=atol, steady_state=steady_state, t1=t1)
        record: dict[str, Any] = {"photo": str(photos[k]), "masked": int(mask.sum()), "solves": {}}
        truth = patchify(image, model.patch)
        for name, solution in solutions.items():
            with torch.no_grad():
                patches = model.decode(solution.g)
            reconstructions[name].append(unpatchify(patches, model.patch, model.image_shape)[0].cpu())
            lyapunov = check_lyapunov(solution)
            energies = solution.energies[:, 0].double().cpu()
            error = (patches - truth)[mask].square().mean()
            record["solves"][name] = {
                "t_final": solution.stats.t_final,
                "nfe": solution.stats.nfe_forward,
                "status": str(solution.status),
                "steps": solution.stats.accepted_steps,
                "energy_start": float(energies[0]),
                "energy_final": float(energies[-1]),
                "residual": float(solution.residual[0]),
                "masked_mse": float(error),
                "lyapunov_descends": lyapunov.descends[0],
                "lyapunov_follows_rate": lyapunov.follows_rate[0],
                "violations": len(lyapunov.violations),
                "times": solution.ts.tolist(),
                "energies": energies.tolist(),
            }
        euler, adaptive, steady = (reconstructions[name][-1] for name in SOLVES)
        record["rms_euler_vs_dopri5"] = float((euler - adaptive).square().mean().sqrt())
        record["rms_dopri5_vs_steady_state"] = float((adaptive - steady).square().mean().sqrt())
        picture = f"photo_{k}.png"
        _picture(
            model, pixels[k], mask[0].cpu(), {name: reconstructions[name][-1] for name in SOLVES}, record, out / picture
        )
        record["picture"] = picture
        records.append(record)
    stacked = {name: torch.stack(values) for name, values in reconstructions.items()}
    torch.save(
        {"pixels": pixels, "images": images, "hidden": hidden, **stacked, "photos": [str(p) for p in photos]},
        out / "completions.pt",
    )
    summary = {
        "checkpoint": str(checkpoint),
        "image_shape": list(model.image_shape),
        "patch": model.patch,
        "num_patches": model.num_patches,
        "dim": model.dim,
        "heads": model.block.attention.heads,
        "head_dim": model.block.attention.head_dim,
        "memories": model.block.hopfield.memories,
        "dtype": str(dtype).replace("torch.", ""),
        "seed": seed,
        "rtol": rtol,
        "atol": atol,
        "steady_state": steady_state,
        "t1": t1,
        "photos": records,
        "files": [r["picture"] for r in records] + ["completions.pt", "report.json", "report.md"],
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(_report(summary))
    return summary


def _verdict(entry: dict[str, Any]) -> str:
    descends = "descends" if entry["lyapunov_descends"] else "RISES"
    follows = "follows dE/dt" if entry["lyapunov_follows_rate"] else "does not follow dE/dt"
    return f"energy {descends}, {follows}"


def _picture(
    model: ImageET, pixels: Tensor, hidden: Tensor, completed: dict[str, Tensor], record: dict[str, Any], path: Path
) -> None:
    """Photo, masked input, the three reconstructions (top); the energy against time of each solve (bottom)."""
    from matplotlib.figure import Figure

    photo = pixels.to(torch.float64) / 255
    patches = patchify(photo[None], model.patch)[0].clone()
    patches[hidden] = 0.5
    masked = unpatchify(patches[None], model.patch, model.image_shape)[0]
    panels = [("photo", photo), (f"masked input ({int(hidden.sum())} of {model.num_patches} patches)", masked)]
    for name in SOLVES:
        entry = record["solves"][name]
        panels.append(
            (
                f"{TITLES[name]}\nt = {entry['t_final']:.3g}, {entry['nfe']} evaluations",
                denormalize(completed[name].to(torch.float64)),
            )
        )
    figure = Figure(figsize=(3.0 * len(panels), 6.6), layout="constrained")
    grid = figure.add_gridspec(2, len(panels), height_ratios=(1.15, 1.0))
    for column, (title, image) in enumerate(panels):
        axis = figure.add_subplot(grid[0, column])
        axis.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        axis.set_title(title, fontsize="small")
        axis.set_xticks([])
        axis.set_yticks([])
    early = figure.add_subplot(grid[1, : len(panels) // 2])
    late = figure.add_subplot(grid[1, len(panels) // 2 :])
    styles: dict[str, dict[str, Any]] = {
        "euler": dict(marker="o", linestyle="none", color="tab:red"),
        "dopri5": dict(color="tab:blue"),
        "steady_state": dict(color="tab:green", linestyle="--"),
    }
    for name in SOLVES:
        entry = record["solves"][name]
        times, energies = entry["times"], entry["energies"]
        label = f"{TITLES[name]}: {_verdict(entry)}"
        shown = [(t, e) for t, e in zip(times, energies, strict=True) if t <= record["solves"]["euler"]["t_final"]]
        early.plot(*zip(*shown, strict=True), label=label, **styles[name])
        if name != "euler":
            late.plot(
                [t for t in times if t > 0],
                [e for t, e in zip(times, energies, strict=True) if t > 0],
                label=TITLES[name],
                **styles[name],
            )
    early.set(title="Energy up to the release's horizon t = 1.2", xlabel="time t (tau = 1)", ylabel="energy E")
    late.set(title="Energy to the steady state", xlabel="time t (log scale)", ylabel="energy E", xscale="log")
    early.legend(fontsize="x-small")
    late.legend(fontsize="x-small")
    for axis in (early, late):
        axis.grid(True, alpha=0.3)
    figure.suptitle(Path(record["photo"]).name)
    figure.savefig(path, dpi=90)


def _report(summary: dict[str, Any]) -> str:
    lines = [
        "# The official Energy Transformer on photos",
        "",
        f"Checkpoint `{summary['checkpoint']}`: image {tuple(summary['image_shape'])}, {summary['patch']}x"
        f"{summary['patch']} patches ({summary['num_patches']} tokens + CLS), D = {summary['dim']}, H = "
        f"{summary['heads']}, Y = {summary['head_dim']}, {summary['memories']} memories; {summary['dtype']}. Masks "
        f"seeded by {summary['seed']}. Each photo is completed three ways: the release's 12 Euler steps of 0.1, "
        f"dopri5 (rtol {summary['rtol']:g}, atol {summary['atol']:g}) to the same time t = 1.2, and dopri5 to the "
        f"steady state (RMS |dg/dt| < {summary['steady_state']:g}, at most t = {summary['t1']:g}). The pictures "
        f"decode every token, as the release shows its output. MSE: over the masked patches, in normalized units "
        f"(ImageNet mean and standard deviation). Lyapunov: the energy never rises (descends) and its changes match "
        f"the exact dE/dt = -(1/tau) sum (dE/dg)^T M (dE/dg) (follows dE/dt; a step too coarse for the ODE "
        f"fails this).",
        "",
    ]
    for k, record in enumerate(summary["photos"]):
        lines += [
            f"## Photo {k}: `{record['photo']}` ({record['masked']} patches masked)",
            "",
            "| solve | t final | evaluations | status | energy start | energy final | RMS dg/dt at the end | "
            "masked MSE | Lyapunov |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in SOLVES:
            e = record["solves"][name]
            lines.append(
                f"| {TITLES[name]} | {e['t_final']:.4g} | {e['nfe']} | {e['status']} | "
                f"{e['energy_start']:.6g} | {e['energy_final']:.6g} | {e['residual']:.3g} | "
                f"{e['masked_mse']:.4g} | {_verdict(e)} |"
            )
        lines += [
            "",
            f"RMS difference of the reconstructions (normalized units): official Euler vs dopri5 at the "
            f"same time {record['rms_euler_vs_dopri5']:.3g}; dopri5 at t = 1.2 vs the steady state "
            f"{record['rms_dopri5_vs_steady_state']:.3g}.",
            "",
            f"![photo {k}]({record['picture']})",
            "",
        ]
    return "\n".join(lines)
