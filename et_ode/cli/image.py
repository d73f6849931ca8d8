"""``et-ode train image``, ``et-ode complete`` and ``et-ode demo``: options in, :mod:`et_ode.tasks` calls out.

``add_train_image``, ``add_complete`` and ``add_demo`` each add one subcommand's parser; its ``run`` default turns
the parsed options into :class:`et_ode.tasks.image.ImageRunConfig` / :class:`et_ode.Integration`
and calls :func:`~et_ode.tasks.image.train_image`, :func:`~et_ode.tasks.film.complete` (or, with ``--official``,
:func:`et_ode.tasks.photos.complete_photos`) or :func:`~et_ode.tasks.demo.demo`.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import torch

from et_ode.cli.dynamics import add_dynamics_arguments, integration_from
from et_ode.cli.options import add_command, add_run_folder_arguments, add_threads_argument, count_in, same_names
from et_ode.data.images import SOURCES
from et_ode.equilibrium.attractor import AttractorReadout
from et_ode.integrators.solvers import METHODS
from et_ode.tasks.demo import DEMO_EPOCHS, DEMO_TIME, demo
from et_ode.tasks.film import complete
from et_ode.tasks.image import ImageRunConfig, train_image
from et_ode.training import distributed, runs
from et_ode.training.train import TrainConfig

MAX_FRAMES = 10_000  # saved times of `complete --frames`: each is a full state in film.pt


def add_train_image(subparsers: argparse._SubParsersAction) -> None:
    run, train = ImageRunConfig(), TrainConfig()
    parser = add_command(
        subparsers,
        "image",
        summary="masked image completion",
        description="Train an image ET on masked-patch completion; evaluate it on the test split against the "
        "per-position mean and nearest-neighbour baselines; write OUT/ (checkpoint.safetensors, metrics.jsonl, "
        "results.json, et_block.pt, tokens.pt).",
    )
    data = parser.add_argument_group("data (read from local files; nothing is downloaded)")
    data.add_argument("--data", default=run.data, choices=SOURCES, help="image source")
    data.add_argument(
        "--data-path",
        default=None,
        help="folder of the IDX .gz files (fashion-mnist default /usr/share/datasets/fashion-mnist; "
        "mnist) or of the PNG images (png: split by source image: a subfolder per photo, or "
        "files named <source>__<anything>.png; see docs/guides/tasks.md)",
    )
    data.add_argument(
        "--test-path",
        default=None,
        metavar="DIR",
        help="a folder of PNG test images (tiled like --data-path); the data then gives only the "
        "training and validation images",
    )
    data.add_argument(
        "--tile",
        type=count_in(1, 65536),
        default=None,
        help="png, photos, --test-path: cut each image into TILE x TILE tiles (photos: 16)",
    )
    data.add_argument("--stride", type=count_in(1, 65536), default=None, help="distance between tiles (default: --tile)")
    data.add_argument(
        "--channels",
        type=int,
        choices=(1, 3),
        default=None,
        help="png, photos, --test-path: 1 grey, 3 RGB (photos: 1; RGB uses its colour photographs)",
    )
    data.add_argument(
        "--validation-fraction",
        type=float,
        default=run.validation_fraction,
        help="fraction of the training data (of its source images, for png) held out as the "
        "validation split scored after each epoch (photos: a fixed split)",
    )
    data.add_argument("--train-limit", type=count_in(1), default=None, help="use only the first N training images")
    data.add_argument("--test-limit", type=count_in(1), default=None, help="use only the first N test images")
    data.add_argument(
        "--val-size",
        type=count_in(0),
        default=run.val_size,
        help="images scored after each epoch: of the validation split, or of the test split when "
        "there is none (all test images at the end); 0: all",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--patch", type=count_in(1, 4096), default=run.patch, help="patch side P (divides the image side)")
    model.add_argument("--dim", type=count_in(1, 8192), default=run.dim, help="token size D")
    model.add_argument("--heads", type=count_in(1, 256), default=run.heads, help="attention heads H")
    model.add_argument("--head-dim", type=count_in(1, 8192), default=run.head_dim, help="head dimension Y")
    model.add_argument("--memories", type=count_in(1), default=None, help="Hopfield memories K (default 4 D)")
    model.add_argument(
        "--hopfield", default=run.hopfield, choices=("relu", "softplus", "softmax"), help="Hopfield energy form"
    )
    model.add_argument("--cls-token", action="store_true", help="prepend a CLS token")
    model.add_argument(
        "--fill",
        choices=("biharmonic",),
        default=None,
        help="start the hidden patches from this classical fill (the ET learns a correction to it) "
        "instead of the MASK token",
    )
    model.add_argument("--tau", type=float, default=run.tau, help="time constant of the dynamics")
    mask = parser.add_argument_group("masks")
    mask.add_argument("--mask-ratio", type=float, default=run.ratio, help="fraction of patches scored, in (0, 1)")
    mask.add_argument(
        "--visible-fraction",
        type=float,
        default=run.visible_fraction,
        help="fraction of the scored patches left visible (the paper: 0.1 = 10 of 100)",
    )
    mask.add_argument("--mask-seed", type=int, default=run.mask_seed, help="seed of the fixed test masks")
    add_dynamics_arguments(parser, run.integration)
    parser.add_argument(
        "--attractor",
        action=argparse.BooleanOptionalAction,
        default=run.attractor is not None,
        help="read the answer at the certified attractor (find_attractor, implicit gradients: "
        "et_ode.AttractorReadout); the dynamics options then serve films and energy checks",
    )
    opt = parser.add_argument_group("training")
    opt.add_argument("--epochs", type=count_in(1), default=train.epochs)
    opt.add_argument("--batch-size", type=count_in(1, 1_000_000), default=train.batch_size)
    opt.add_argument("--lr", type=float, default=train.lr, help="peak AdamW learning rate")
    opt.add_argument("--weight-decay", type=float, default=train.weight_decay)
    opt.add_argument("--warmup", type=float, default=train.warmup, help="warm-up: fraction of steps if < 1, else steps")
    opt.add_argument("--grad-clip", type=float, default=train.grad_clip, help="gradient-norm clip (0: none)")
    opt.add_argument("--seed", type=int, default=train.seed)
    opt.add_argument(
        "--init",
        default=None,
        metavar="CHECKPOINT",
        help="start from the weights of another run's checkpoint.safetensors (same model); e.g. a "
        "direct phase before --attractor, which trains only the energy and the decoder",
    )
    opt.add_argument("--device", default=train.device, help="auto, cpu, cuda or cuda:i")
    add_threads_argument(opt)
    opt.add_argument("--max-train-batches", type=count_in(1), default=None, help="cap on batches per epoch")
    opt.add_argument(
        "--max-time",
        type=float,
        default=None,
        metavar="MINUTES",
        help="wall-clock budget of the training loop: the warm-up + cosine schedule is planned for the "
        "steps that fit (at most --epochs), and the run stops at the budget with a checkpoint",
    )
    opt.add_argument(
        "--checkpoint-every",
        type=count_in(0),
        default=train.checkpoint_every,
        help="also checkpoint every N steps within an epoch (0: at epoch ends only)",
    )
    opt.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    opt.add_argument("--no-baselines", action="store_true", help="skip the mean and nearest-neighbour baselines")
    parser.add_argument("--out", required=True, help="output folder (new or empty; see --resume, --overwrite)")
    add_run_folder_arguments(parser)
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel training under torchrun (required: RANK, WORLD_SIZE, LOCAL_RANK, "
        "MASTER_ADDR, MASTER_PORT); without the flag a torchrun environment is detected. "
        "--batch-size is the global batch, split over the processes",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=distributed.DEFAULT_TIMEOUT.total_seconds(),
        help="seconds a rank waits for the others (rendezvous, gradient averaging) before failing",
    )
    parser.set_defaults(run=_run_train_image)


def _run_train_image(args: argparse.Namespace) -> None:
    with distributed.session(
        True if args.distributed else None, device=args.device, timeout=datetime.timedelta(seconds=args.dist_timeout)
    ):
        _train_image_from_args(args)


def _train_image_from_args(args: argparse.Namespace) -> None:
    train = TrainConfig(
        **same_names(args, "epochs", "batch_size", "lr", "weight_decay", "warmup", "seed", "device"),
        **same_names(args, "resume", "overwrite", "max_train_batches", "checkpoint_every"),
        grad_clip=args.grad_clip or None,
        out_dir=args.out,
        progress=not args.no_progress,
        max_time=None if args.max_time is None else _minutes(args.max_time) * 60.0,
    )
    config = ImageRunConfig(
        **same_names(args, "data", "data_path", "test_path", "tile", "stride", "channels", "validation_fraction"),
        **same_names(args, "train_limit", "test_limit", "val_size"),
        **same_names(args, "patch", "dim", "heads", "head_dim", "memories", "hopfield", "cls_token", "fill", "tau"),
        **same_names(args, "visible_fraction", "mask_seed", "threads", "init"),
        ratio=args.mask_ratio,
        integration=integration_from(args, ImageRunConfig().integration),
        attractor=AttractorReadout() if args.attractor else None,
        train=train,
        baselines=not args.no_baselines,
    )
    results = train_image(config)
    if distributed.is_main():
        print(json.dumps(_summary(results), indent=2))


def _minutes(value: float) -> float:
    if not 0 < value < float("inf"):
        raise ValueError(f"--max-time must be a positive number of minutes, got {value!r}")
    return value


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "model",
        "model_tight_solver",
        "mean_baseline",
        "nearest_neighbour",
        "biharmonic",
        "improvement_over_mean",
        "energy_descent",
        "train_seconds",
        "train_cost",
        "stopped",
        "demo_seconds",
    )
    return {k: results[k] for k in keys if k in results}


def add_complete(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands,
        "complete",
        summary="complete a masked image with a trained model (or photos with the official checkpoint)",
        description="Hide random patches of one image, run the trained ET from the MASK tokens to the horizon, and "
        "write OUT/film.pt (frames over time, target, masked input), OUT/energy.csv, and, with "
        "et_ode.analysis installed, OUT/film_strip.png and OUT/energy.png. With --official: complete "
        "photos with the official release's checkpoint three ways (its 12 Euler steps, dopri5 to the same "
        "time, dopri5 to the steady state) and write OUT/report.md with pictures (et_ode.tasks.photos).",
    )
    parser.add_argument(
        "checkpoint", nargs="?", default=None, help="OUT/checkpoint.safetensors written by `et-ode train image`"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--image",
        action="append",
        help="a PNG file of the model's image size (with --official: any RGB photo, resized and cropped; repeat for more)",
    )
    source.add_argument(
        "--index",
        type=count_in(0),
        help="index of an image of the run's test split (in the order "
        "`et-ode train image` scored them; --test-path images if the run "
        "had them)",
    )
    add_official_arguments(parser, masks=True)
    official = parser.add_argument_group("solves of `--official`")
    official.add_argument("--rtol", type=float, default=1e-5, help="dopri5 rtol")
    official.add_argument("--atol", type=float, default=1e-7, help="dopri5 atol")
    official.add_argument(
        "--steady-state", type=float, default=1e-3, metavar="TOL", help="the steady state: RMS |dg/dt| < TOL"
    )
    official.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier `et-ode complete` output in --out (never another command's run)",
    )
    official.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--mask-ratio", type=float, default=None, help="fraction of patches hidden (default: the run's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random mask")
    parser.add_argument("--frames", type=count_in(2, MAX_FRAMES), default=9, help="saved times from 0 to the horizon")
    parser.add_argument(
        "--t1",
        type=float,
        default=None,
        help="horizon (default: the run's; with --official the longest time of the steady-state solve, 100)",
    )
    parser.add_argument("--solver", default=None, choices=METHODS, help="ODE method (default: the run's)")
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:i")
    add_threads_argument(parser)
    parser.set_defaults(run=_run_complete)


def add_official_arguments(parser: argparse.ArgumentParser, masks: bool) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("the official release's checkpoint (et_ode.models.official)")
    group.add_argument(
        "--official",
        type=Path,
        default=None,
        metavar="CKPT.npz",
        help="an official-format .npz checkpoint (plain dict: Wk, Wq, Xi, Wenc, ...); use --image",
    )
    group.add_argument(
        "--image-shape",
        type=int,
        nargs=3,
        default=(3, 224, 224),
        metavar=("C", "H", "W"),
        help="the checkpoint's image size",
    )
    group.add_argument("--patch", type=int, default=16, help="the checkpoint's patch side")
    group.add_argument(
        "--masked",
        type=int,
        default=None,
        help="patches hidden per photo (default: 100 of 196, scaled to the number of patches)",
    )
    if masks:
        group.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="model precision")
    else:
        group.add_argument("--mask-seed", type=int, default=0, help="seed of the masks")
    return group


def official_photos(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The keyword arguments that :func:`add_official_arguments`' options give the official checkpoint's photo
    functions (:func:`et_ode.tasks.photos.official_tokens`, :func:`~et_ode.tasks.photos.complete_photos`), with
    masks drawn from ``seed``."""
    return {
        "image_shape": tuple(args.image_shape),
        "patch": args.patch,
        "masked": args.masked,
        "seed": seed,
        "dtype": getattr(torch, args.dtype),
    }


def _run_complete(args: argparse.Namespace) -> None:
    if args.official is not None:
        _run_complete_official(args)
        return
    if args.checkpoint is None:
        raise ValueError("give a CHECKPOINT (written by `et-ode train image`) or --official CKPT.npz")
    if args.image is not None and len(args.image) > 1:
        raise ValueError("a trained CHECKPOINT completes one --image at a time")
    image = args.image[0] if args.image else None
    setup = same_names(args, "checkpoint", "image", "index", "frames", "t1", "solver", "mask_ratio", "seed")
    with runs.claim(args.out, setup, overwrite=args.overwrite, command="complete"):
        summary = complete(
            args.checkpoint,
            args.out,
            image=image,
            ratio=args.mask_ratio,
            **same_names(args, "index", "frames", "t1", "solver", "seed", "device"),
        )
    print(json.dumps({k: summary[k] for k in ("files", "masked_mse", "monotone")}, indent=2))


def _run_complete_official(args: argparse.Namespace) -> None:
    from et_ode.tasks.photos import complete_photos

    if args.checkpoint is not None or args.index is not None:
        raise ValueError("--official completes photos (--image); it takes no CHECKPOINT or --index")
    trained_only = [
        flag for flag, value in (("--mask-ratio", args.mask_ratio), ("--solver", args.solver)) if value is not None
    ]
    if trained_only:
        raise ValueError(
            f"{', '.join(trained_only)} apply to trained checkpoints; with --official use --masked, "
            f"--steady-state, --t1, --rtol, --atol (the three solves are fixed)"
        )
    try:
        summary = complete_photos(
            args.official,
            args.image,
            args.out,
            **official_photos(args, seed=args.seed),
            **same_names(args, "rtol", "atol", "steady_state", "device", "overwrite"),
            **({} if args.t1 is None else {"t1": args.t1}),
            progress=not args.no_progress,
        )
    except FileExistsError as error:
        raise ValueError(str(error)) from None
    verdicts = {
        record["photo"]: {
            name: {k: entry[k] for k in ("t_final", "masked_mse", "lyapunov_descends", "lyapunov_follows_rate")}
            for name, entry in record["solves"].items()
        }
        for record in summary["photos"]
    }
    print(json.dumps({"files": summary["files"], "photos": verdicts}, indent=2))


def add_demo(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands,
        "demo",
        summary="train an image ET on the bundled 8x8 digits and write a report with pictures",
        description=f"Train an image ET on scikit-learn's 8x8 digits (4x4 patches, half hidden; the adaptive bosh3 "
        f"solver with the adjoint to t = 0.6; {DEMO_EPOCHS} epochs; {DEMO_TIME}), evaluate "
        f"it against the mean and nearest-neighbour baselines, and write OUT/report.md with completions, "
        f"energy descent, token trajectories up to the horizon and the test MSEs.",
    )
    parser.add_argument("--out", default="runs/demo", help="output folder")
    parser.add_argument("--quick", action="store_true", help="a smoke run on a few images (seconds; for tests)")
    add_threads_argument(parser)
    add_run_folder_arguments(parser)
    parser.set_defaults(
        run=lambda args: print(
            json.dumps(
                _summary(
                    demo(args.out, quick=args.quick, resume=args.resume, overwrite=args.overwrite, threads=args.threads)
                ),
                indent=2,
            )
        )
    )
