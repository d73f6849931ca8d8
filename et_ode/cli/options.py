"""Options that several ``et-ode`` commands share."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, once: not where the help already names its default, nor for a
    required option, an unset default (``None``) or an off switch (``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or action.required
            or action.default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return super()._get_help_string(action)


def add_command(
    commands: argparse._SubParsersAction, name: str, *, summary: str, description: str
) -> argparse.ArgumentParser:
    """A subcommand ``name`` whose ``--help`` shows ``description`` and every option's default (``summary`` is its
    line in the parent's list of commands)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=description, formatter_class=HelpFormatter
    )
    return parser


def thread_count(text: str) -> int:
    """argparse type of ``--threads``: an integer from 1 to the machine's CPU count."""
    most = os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer number of threads, got {text!r}") from None
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be from 1 to {most} (this machine's CPUs), got {value}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--threads N``: PyTorch's CPU threads for the command (applied by :func:`et_ode.cli.main` before it runs)."""
    parser.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="torch CPU threads, 1 to this machine's CPU count (default: torch's choice; on a busy "
        "machine use 1, see et_ode.backend.runtime.oversubscription)",
    )


def add_run_folder_arguments(parser: argparse.ArgumentParser) -> None:
    """``--resume`` and ``--overwrite`` (mutually exclusive): what to do when ``--out`` already holds a run
    (:func:`et_ode.training.runs.claim`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in OUT (its config.json must match these settings); a new or empty OUT starts afresh",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in OUT (a folder with an et-ode config.json) and start afresh",
    )


def same_names(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options ``names`` of ``args`` as keyword arguments of the same names (``{"lr": args.lr, ...}``)."""
    return {name: getattr(args, name) for name in names}


def count_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type of a count flag: an integer from ``low`` to ``high`` (None: no upper bound); an
    ``argparse.ArgumentTypeError`` (the usage error naming the flag) otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    parse.__name__ = "count"
    return parse


def command_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> set[str]:
    """The option strings (``--data-path``, ...) of the command that produced ``args``: ``parser``'s and
    those of each subcommand on the way (``et-ode train image``: the ``train`` and ``image`` parsers')."""
    options: set[str] = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            options |= command_options(action.choices[getattr(args, action.dest)], args)
    return options


# the argument a library message names: the name it starts with (``limit must ...``, ``TrainConfig.lr must ...``,
# ``masks PATH: ...``), or a switch set to True anywhere in it (``overwrite=True``)
_LEADING_NAME = re.compile(r"^(?:[A-Z]\w*\.)?([a-z]\w*)(?=[ :])")
_SWITCH = re.compile(r"\b([a-z]\w*)=True\b")


def command_line_words(message: str, options: set[str]) -> str:
    """A library error ``message`` as the command line says it: the Python argument it starts with, and every
    ``name=True``, become the flag (``data_path`` -> ``--data-path``) where ``options`` holds that flag; the rest
    stays as it is."""

    def flag(name: str) -> str | None:
        candidate = "--" + name.replace("_", "-")
        return candidate if candidate in options else None

    leading = _LEADING_NAME.match(message)
    if leading is not None and flag(leading.group(1)) is not None:
        message = f"{flag(leading.group(1))}{message[leading.end() :]}"
    return _SWITCH.sub(lambda match: flag(match.group(1)) or match.group(0), message)
