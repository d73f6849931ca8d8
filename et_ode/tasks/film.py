"""Complete one masked image with a trained model and record the completion over time.

:func:`complete` (``et-ode complete``) hides patches of one image, runs the model's dynamics from the MASK tokens to
the horizon and writes the frames, the energy over time and, where :mod:`et_ode.analysis.plots` is installed, a film
strip and the energy picture. :func:`masked_picture` paints the hidden patches of masked inputs for pictures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from et_ode.data.images import read_png
from et_ode.integrators.solvers import Adaptive, EulerET, Solver, as_solver
from et_ode.models.image import patchify, random_masks, unpatchify
from et_ode.tasks.image import load_run_split, load_trained


def analysis_plots() -> Any | None:
    """``et_ode.analysis.plots`` when it is installed, else None (pictures are then skipped)."""
    try:
        from et_ode.analysis import plots
    except ImportError:
        return None
    return plots


def close_figure(figure: Any) -> None:
    """Free a matplotlib figure once it is saved (pyplot keeps it otherwise)."""
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
    ``train_image`` scored, in its order: the ``test_path`` images when the run had them). Patches are
    hidden at random (``ratio``, default the run's) with ``seed``. The run's integration is used (also for a model
    that reads its answer at the attractor: a film follows the flow), with ``t1`` and
    ``solver`` replaced when given (a method's name keeps the run's tolerances where both are adaptive); ``frames``
    equally spaced times from 0 to ``t1`` are saved (:class:`~et_ode.EulerET` saves each of its steps). Writes to
    ``out_dir``: ``film.pt``
    (frames ``(T, C, H, W)``, times, target, masked input, hidden), ``energy.csv`` (time, energy), and when
    ``et_ode.analysis.plots`` is present ``film_strip.png`` and ``energy.png``. Returns a summary.
    """
    if (image is None) == (index is None):
        raise ValueError("give exactly one of image (a PNG file) and index (a test image of the run's data)")
    if not (isinstance(frames, int) and frames >= 2):
        raise ValueError(f"frames must be an integer >= 2, got {frames!r}")
    model, run = load_trained(checkpoint, device)
    integration = run.integration
    if t1 is not None:
        integration = integration.replace(t1=t1)
    if solver is not None:
        trained, chosen = integration.solver, as_solver(solver)
        if isinstance(solver, str) and isinstance(chosen, Adaptive) and isinstance(trained, Adaptive):
            chosen = Adaptive(chosen.method, trained.rtol, trained.atol)  # another adaptive method, the run's tolerances
        integration = integration.replace(solver=chosen)
    t = None if isinstance(integration.solver, EulerET) else torch.linspace(0.0, integration.t1, frames)
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
                f"index must be in [0, {len(test)}) for the test split of the run's data "
                f"({run.test_path or run.data}), got {index}"
            )
        target = test.images[index]
    ratio = run.ratio if ratio is None else ratio
    hidden, _ = random_masks(
        1, model.num_patches, ratio, visible_fraction=run.visible_fraction, generator=torch.Generator().manual_seed(seed)
    )
    target = target.to(next(model.parameters()).device)
    film, solution = model.film(target[None], hidden.to(target.device), t, integration)
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
    plots = analysis_plots()
    if plots is not None:
        close_figure(
            plots.plot_film_strip(film[:, 0].cpu(), ts, target=target.cpu(), masked=masked, path=out / "film_strip.png")
        )
        close_figure(plots.plot_convergence(solution, path=out / "energy.png"))
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
