"""``et-ode analyze``: the options of :func:`et_ode.analysis.analyze` and the tokens of photos (``--official``).

``add_analyze_arguments`` / ``run_analyze`` turn the options into one :func:`et_ode.analysis.analyze` call (usable
with any ``argparse`` parser): the model (a saved one, or the built-in random one), the initial states (a saved
tensor, or random ones) and the :class:`~et_ode.Integration` of the dynamics options. ``add_arguments`` / ``run`` add
``--official CKPT.npz --image A.png``, whose photos' tokens (:func:`et_ode.tasks.photos.official_tokens`) become the
initial states.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from et_ode.analysis.report import ANALYZE_INTEGRATION, analyze, random_model, random_states
from et_ode.cli.dynamics import add_dynamics_arguments, integration_from
from et_ode.cli.image import add_official_arguments, official_photos
from et_ode.cli.options import add_threads_argument, count_in, same_names
from et_ode.energy.model import EnergyTransformer
from et_ode.integrators.solvers import FIXED_METHODS
from et_ode.training import runs
from et_ode.training.io import load_states

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``et-ode analyze``: :func:`add_analyze_arguments` and the official checkpoint's."""
    add_analyze_arguments(parser)
    official = add_official_arguments(parser, masks=False)
    official.add_argument(
        "--image",
        action="append",
        default=None,
        help="with --official: an RGB photo whose tokens are the initial states (repeat for more)",
    )


def run(args: argparse.Namespace) -> Path:
    """Run ``et-ode analyze``: :func:`run_analyze` on the photos' tokens with ``--official``, else as given."""
    return run_analyze(_official_states(args))


def add_analyze_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``et-ode analyze`` to ``parser``."""
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model file written by et_ode.training.io.save_model (default: a built-in random model)",
    )
    parser.add_argument(
        "--x0", type=Path, default=None, help="torch-saved tensor of initial states (batch, N, D) (default: random)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/analyze"), help="output folder, new or empty")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the report in --out (a folder written by et-ode analyze)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random model and states")
    parser.add_argument("--dim", type=count_in(1, 4096), default=16, help="random model: token size D")
    parser.add_argument("--heads", type=count_in(1, 256), default=2, help="random model: attention heads H")
    parser.add_argument("--head-dim", type=count_in(1, 4096), default=8, help="random model: head dimension Y")
    parser.add_argument("--memories", type=count_in(1, 65536), default=32, help="random model: Hopfield memories K")
    parser.add_argument(
        "--hopfield", choices=("relu", "softplus", "softmax"), default="relu", help="random model: Hopfield form"
    )
    parser.add_argument("--tokens", type=count_in(1, 4096), default=8, help="random states: tokens N per sample")
    parser.add_argument("--batch", type=count_in(1, 4096), default=3, help="random states: number of samples")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float64",
        help="precision of the model and the states (float64: the landscape tools need it)",
    )
    parser.add_argument("--tau", type=float, default=1.0, help="time constant")
    add_dynamics_arguments(parser, ANALYZE_INTEGRATION, options=("solver", "t1", "rtol", "atol", "step", "steps"))
    parser.add_argument("--points", type=count_in(3, 100_000), default=61, help="saved times")
    parser.add_argument("--tol", type=float, default=1e-3, help="convergence tolerance on RMS |dg/dt|")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--landscape",
        action="store_true",
        help="add the landscape study of sample 0 (critical points, saddles, basins, asymptotic rate, "
        "Lyapunov spectrum, continuation) and the Hessian along the trajectories; small models",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_threads_argument(parser)
    return parser


def run_analyze(args: argparse.Namespace) -> Path:
    """Run :func:`analyze` from parsed ``et-ode analyze`` arguments; returns the report folder.

    ``--out`` is taken with :func:`et_ode.training.runs.claim`: a folder holding files needs ``--overwrite``
    (:class:`et_ode.training.runs.RunFolderError` otherwise, and while another process writes there).
    """
    if args.solver in FIXED_METHODS and args.step is None:
        raise ValueError(f"--solver {args.solver} is a fixed-step method: give --step")
    setup = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in sorted(vars(args).items())
        if isinstance(v, (str, int, float, bool, type(None), Path)) and k not in ("command", "overwrite")
    }
    with runs.claim(args.out, setup, overwrite=getattr(args, "overwrite", False), command="analyze"):
        return _run_analyze(args)


def _run_analyze(args: argparse.Namespace) -> Path:
    model, source = _model(args)
    device = torch.device(args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device)
    states = random_states(model, args.batch, args.tokens, seed=args.seed + 1) if args.x0 is None else args.x0
    if isinstance(states, Path):
        states = load_states(states, model.dim)
    return analyze(
        model,
        states,
        integration_from(args, ANALYZE_INTEGRATION),
        **same_names(args, "out", "tau", "points", "tol", "landscape"),
        source=source,
        progress=not args.no_progress,
    )


def _model(args: argparse.Namespace) -> tuple[EnergyTransformer, str]:
    """The model ``args`` name (a saved one, one given by ``--official``, or the built-in random one) and how the report
    names it."""
    if isinstance(args.model, EnergyTransformer):
        return args.model, "given EnergyTransformer"
    if args.model is not None:
        from et_ode.training.io import load_model

        loaded, _ = load_model(args.model)
        return loaded.to(DTYPES[args.dtype]), f"loaded from {args.model}"
    model = random_model(
        args.dim, args.heads, args.head_dim, args.memories, hopfield=args.hopfield, seed=args.seed, dtype=DTYPES[args.dtype]
    )
    return model, f"random (seed {args.seed})"


def _official_states(args: argparse.Namespace) -> argparse.Namespace:
    """With ``--official``: the checkpoint's ET block as ``--model`` and the tokens of the photos as ``--x0``."""
    if args.official is None:
        if args.image:
            raise ValueError("--image needs --official CKPT.npz (the photos' tokens are its initial states)")
        return args
    if args.model is not None or args.x0 is not None:
        raise ValueError("--official replaces --model and --x0; give one or the other")
    if not args.image:
        raise ValueError("--official needs at least one --image (the photos whose tokens are analysed)")
    from et_ode.tasks.photos import official_tokens

    model, _, images, hidden = official_tokens(args.official, args.image, **official_photos(args, seed=args.mask_seed))
    with torch.no_grad():
        states = model.tokens(images, hidden)
    return argparse.Namespace(**{**vars(args), "model": model.block, "x0": states, "tau": model.tau})
