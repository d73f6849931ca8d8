"""``et-ode evaluate CKPT --out DIR``: options in, :func:`et_ode.tasks.evaluation.evaluate_checkpoint` out."""

from __future__ import annotations

import argparse
import json

import torch

from et_ode.cli.options import add_command, add_threads_argument, count_in, same_names
from et_ode.data.images import SOURCES
from et_ode.integrators.solvers import ADAPTIVE_METHODS, METHODS, Adaptive, as_solver
from et_ode.solving.integration import Integration
from et_ode.tasks.evaluation import PREDICTORS, evaluate_checkpoint
from et_ode.tasks.image import load_trained

DESCRIPTION = (
    "Complete the images of a split (default: the run's test split) with the trained ET, the "
    "per-position mean and the nearest training image (both from the run's training data) and "
    "biharmonic inpainting (scikit-image), on the same seeded masks; write OUT/evaluation.json, "
    "OUT/evaluation.md (the table), OUT/completions.npz (images, masks, completions, per-image MSE) "
    "and OUT/completions.png."
)


def add_evaluate(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands,
        "evaluate",
        summary="score a trained checkpoint and the classical baselines on any data, with saved masks",
        description=DESCRIPTION,
    )
    parser.add_argument("checkpoint", help="OUT/checkpoint.safetensors written by `et-ode train image`")
    parser.add_argument("--out", required=True, help="output folder (new or empty; see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier evaluation in --out")
    data = parser.add_argument_group("what is evaluated (default: the run's test split)")
    data.add_argument("--data", default=None, choices=SOURCES, help="another source (tiled like the run's)")
    data.add_argument("--data-path", default=None, help="its folder (see `et-ode train image --help`)")
    data.add_argument(
        "--test-path", default=None, metavar="DIR", help="a folder of PNG images to evaluate (tiled like the run's data)"
    )
    data.add_argument("--split", default="test", choices=("test", "validation"), help="the split of the data")
    data.add_argument("--limit", type=count_in(1), default=None, help="only the first N images")
    masks = parser.add_argument_group("masks (the run's ratio and visible fraction)")
    masks.add_argument("--mask-seed", type=int, default=None, help="seed of the masks (default: the run's)")
    masks.add_argument(
        "--masks", default=None, metavar="NPZ", help="reuse the masks of an earlier evaluation's completions.npz"
    )
    model = parser.add_argument_group("the model's dynamics (default: the run's)")
    model.add_argument("--solver", default=None, choices=METHODS, help="ODE method")
    model.add_argument("--t1", type=float, default=None, help="horizon")
    model.add_argument("--rtol", type=float, default=None, help="adaptive rtol")
    model.add_argument("--atol", type=float, default=None, help="adaptive atol")
    parser.add_argument(
        "--predictors", default=",".join(PREDICTORS), help=f"comma-separated subset of {','.join(PREDICTORS)}"
    )
    parser.add_argument("--batch-size", type=count_in(1, 1_000_000), default=250, help="images per batch")
    parser.add_argument("--grid", type=count_in(0, 1000), default=8, help="images in completions.png (0: none)")
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:i")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    parser.set_defaults(run=_run_evaluate)


def integration_for(
    run: Integration, solver: str | None, t1: float | None, rtol: float | None, atol: float | None
) -> Integration:
    """The run's integration with ``--solver``, ``--t1``, ``--rtol``, ``--atol`` replaced where given (an adaptive
    method keeps the run's tolerances unless new ones are given; 'et' takes EulerET's alpha 0.1 and 12 steps)."""
    integration = run if t1 is None else run.replace(t1=t1)
    if solver is None and rtol is None and atol is None:
        return integration
    trained = as_solver(integration.solver)
    name = solver or trained.name
    if name in ADAPTIVE_METHODS:
        default = trained if isinstance(trained, Adaptive) else Adaptive()
        return integration.replace(
            solver=Adaptive(name, default.rtol if rtol is None else rtol, default.atol if atol is None else atol)
        )
    if rtol is not None or atol is not None:
        raise ValueError(
            f"--rtol and --atol apply to an adaptive --solver ({', '.join(ADAPTIVE_METHODS)}); the "
            f"model is integrated by {name}"
        )
    return integration.replace(solver=as_solver(name))


def _run_evaluate(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    integration = None
    if any(value is not None for value in (args.solver, args.t1, args.rtol, args.atol)):
        _, run = load_trained(args.checkpoint)
        integration = integration_for(run.integration, args.solver, args.t1, args.rtol, args.atol)
    results = evaluate_checkpoint(
        args.checkpoint,
        args.out,
        **same_names(args, "data", "data_path", "test_path", "split", "limit", "mask_seed", "masks"),
        **same_names(args, "batch_size", "grid", "overwrite", "device"),
        dynamics=integration,
        predictors=tuple(p.strip() for p in args.predictors.split(",") if p.strip()),
        progress=not args.no_progress,
    )
    print(
        json.dumps(
            {
                "images": results["images"],
                "best": results["best"],
                "files": results["files"],
                "mse": {name: entry["mse"] for name, entry in results["predictors"].items()},
            },
            indent=2,
        )
    )
