"""The demo (``et-ode demo``, ``make demo``): an image ET trained on the bundled 8x8 digits, and its report.

:func:`demo` trains :func:`demo_config`'s run with :func:`et_ode.tasks.image.train_image`, scores the model again
under a much tighter solver, and writes ``report.md`` with completions, the test MSEs against the baselines, the
energy during inference, token trajectories and a film strip of one completion.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from et_ode.backend import runtime
from et_ode.integrators.solvers import Adaptive
from et_ode.models.image import fixed_mask_set, patchify, unpatchify
from et_ode.solving.gradients import Adjoint, Direct
from et_ode.solving.integration import Integration
from et_ode.tasks.baselines import NearestNeighbour
from et_ode.tasks.film import analysis_plots, close_figure, complete, masked_picture
from et_ode.tasks.image import RESUMABLE_CHANGES, ImageRunConfig, evaluate_model, load_run_split, load_trained, train_image
from et_ode.training import runs
from et_ode.training.train import CHECKPOINT_NAME, TrainConfig


def demo_config(quick: bool = False) -> ImageRunConfig:
    """The demo's run: bundled 8x8 digits, 4x4 patches, half hidden, trained through the adaptive Bogacki-Shampine
    solver (bosh3) with the adjoint (``quick``: a smoke run). bosh3 takes fewer field evaluations than dopri5 at
    this loose tolerance; the demo's time is on the performance page."""
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
#: how long the demo runs; the measured times, with the machines, are on the docs' performance page
DEMO_TIME = "a few minutes on one thread (measured times: the performance page of the docs)"
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
        print(f"et-ode demo: {DEMO_TIME}. This machine: {runtime.cpu_description()}.", file=sys.stderr, flush=True)
    results = train_image(config)
    model, _ = load_trained(out / CHECKPOINT_NAME)
    test_set = load_run_split(config, "test", config.test_limit)
    test = fixed_mask_set(test_set.images, model.num_patches, config.ratio, config.visible_fraction, seed=config.mask_seed)
    images, hidden, _ = test.tensors
    # the same model integrated far more accurately: a continuous-time model's answer must not hinge on the solver
    results["model_tight_solver"] = evaluate_model(model, test, dynamics=TIGHT_INTEGRATION.replace(t1=config.integration.t1))
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
    plots = analysis_plots()
    if plots is not None:
        with torch.no_grad():
            solution = config.integration.replace(gradient=Direct()).solve(
                model.field(), model.tokens(images[:show], hidden[:show]), torch.linspace(0, config.integration.t1, 25)
            )
        close_figure(plots.plot_convergence(solution, path=out / "convergence.png"))
        close_figure(plots.plot_trajectories(solution, sample=0, path=out / "trajectories.png"))
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
