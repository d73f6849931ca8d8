"""Options that several ``et-ode`` commands share."""

from __future__ import annotations

import argparse


def add_command(commands: argparse._SubParsersAction, name: str, *, summary: str,
                description: str) -> argparse.ArgumentParser:
    """A subcommand ``name`` whose ``--help`` shows ``description`` and every option's default (``summary`` is its
    line in the parent's list of commands)."""
    parser: argparse.ArgumentParser = commands.add_parser(name, help=summary, description=description,
                                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return parser


def add_run_folder_arguments(parser: argparse.ArgumentParser) -> None:
    """``--resume`` and ``--overwrite`` (mutually exclusive): what to do when ``--out`` already holds a run
    (:func:`et_ode.runs.claim`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true",
                       help="continue the run in OUT (its config.json must match these settings); a new or empty OUT "
                            "starts afresh")
    group.add_argument("--overwrite", action="store_true",
                       help="delete the run in OUT (a folder with an et-ode config.json) and start afresh")
