"""Run folders that never clobber one another: a lock per folder, and a set-up that a resume must keep.

A *run folder* (``--out``) holds one run: ``config.json`` (its set-up), the checkpoint, metrics and results.
:func:`claim` takes a folder for a run, in this order, before the run writes anything:

1. ``out`` must not be an existing file.
2. The lock ``out/.et-ode.lock`` is created with ``O_CREAT | O_EXCL`` and holds the pid, host, start time and
   command line. A lock held by a live process refuses the run, naming that process; a lock left by a dead
   process on this host (a killed run) is taken over with a warning.
3. A folder with files needs ``resume=True`` or ``overwrite=True``. A resume compares the whole set-up with
   the folder's ``config.json`` and refuses any change (a table of the differences), except in the settings
   named ``may_change`` (how a run executes: device, threads, progress bars, ...). An overwrite empties the
   folder, and only a folder that holds an et-ode run (a ``config.json``).
4. ``config.json`` is written once the run is accepted (a resume keeps the original).

The lock is released when the ``with`` block ends, however it ends. Within one process the lock is
re-entrant, so the training loop (:func:`et_ode.train.fit`) can lock the folder its caller claimed, and a nested
claim of a folder the process holds is accepted without the checks (the outer claim made them).

Public API::

    with claim(out, setup, *, resume=False, overwrite=False, may_change=()) as out: ...
    with lock(out): ...
    RunFolderError      # ValueError: the folder is a file, not empty, in use, or holds another set-up

The command-line flags ``--resume`` / ``--overwrite`` are :func:`et_ode.cli.options.add_run_folder_arguments`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

LOCK_NAME = ".et-ode.lock"
CONFIG_NAME = "config.json"
_held: dict[Path, int] = {}  # folders this process has locked -> nesting depth


class RunFolderError(ValueError):
    """An output folder that cannot be used as asked: a file, a folder of another run, in use, or a resume
    with a changed set-up. The message says what is there and what to do."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _check_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out/out_dir {out} is an existing file, not a folder; give a folder (new or empty, "
                             f"or a run folder with --resume / --overwrite)")


@contextlib.contextmanager
def lock(out: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``out/.et-ode.lock`` while the block runs (see the module docstring); re-entrant in one process.

    Raises:
        RunFolderError: ``out`` is a file, or another live process holds the lock (named in the message).
    """
    out = Path(out)
    _check_folder(out)
    key = out.resolve()
    if key in _held:
        _held[key] += 1
        try:
            yield out
        finally:
            _held[key] -= 1
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv)}
    for _attempt in range(2):
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                other = json.loads(path.read_text())
            except (OSError, ValueError):
                other = {}
            pid, host = other.get("pid"), other.get("host")
            if isinstance(pid, int) and host == record["host"] and not _alive(pid):
                warnings.warn(f"{path}: taking over the lock of process {pid}, which is no longer running "
                              f"(started {other.get('started')})", stacklevel=3)
                path.unlink(missing_ok=True)
                continue
            raise RunFolderError(
                f"{out} is in use by another run: process {pid} on host {host!r}, started {other.get('started')} "
                f"({other.get('command', '?')!r}). Wait for it to finish or choose another --out; if that process "
                f"is gone, delete {path}") from None
        with os.fdopen(handle, "w") as file:
            file.write(json.dumps(record))
        break
    _held[key] = 1
    try:
        yield out
    finally:
        del _held[key]
        path.unlink(missing_ok=True)


def _flat(values: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(values, dict):
        flat: dict[str, Any] = {}
        for key, value in values.items():
            flat.update(_flat(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: list(values) if isinstance(values, tuple) else values}


def differences(saved: dict[str, Any], now: dict[str, Any], may_change: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    """``(setting, saved, now)`` for every dotted setting (e.g. ``"integration.solver.method"``) that differs, except those
    in ``may_change`` (or under one of them)."""
    allowed = tuple(may_change)
    a, b = _flat(json.loads(json.dumps(saved))), _flat(json.loads(json.dumps(now)))
    missing = object()
    return [(key, a.get(key, missing), b.get(key, missing)) for key in sorted(set(a) | set(b))
            if a.get(key, missing) != b.get(key, missing)
            and not any(key == name or key.startswith(f"{name}.") for name in allowed)]


def _table(rows: list[tuple[str, Any, Any]]) -> str:
    def show(value: Any) -> str:
        return "(absent)" if not isinstance(value, (str, int, float, bool, list, dict, type(None))) else repr(value)

    cells = [("setting", "run in the folder", "now")] + [(k, show(a), show(b)) for k, a, b in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    return "\n".join("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in cells)


@contextlib.contextmanager
def claim(out: str | os.PathLike[str], setup: dict[str, Any], *, resume: bool = False, overwrite: bool = False,
          may_change: Iterable[str] = ()) -> Iterator[Path]:
    """Take ``out`` for a run whose set-up is ``setup`` (JSON-like); see the module docstring.

    Raises:
        RunFolderError: ``out`` is a file; it holds files and neither ``resume`` nor ``overwrite`` was given;
            ``resume`` with a set-up that differs from ``out/config.json`` (a table of the differences);
            ``overwrite`` of a folder that is not an et-ode run; another live process holds the lock.
            Nothing in ``out`` has changed when it is raised.
    """
    out = Path(out)
    if resume and overwrite:
        raise RunFolderError("give --resume (continue the run in --out) or --overwrite (replace it), not both")
    _check_folder(out)
    if out.resolve() in _held:  # claimed by this process already (e.g. the demo around its training run)
        with lock(out):
            yield out
        return
    with lock(out):
        entries = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)
        config = out / CONFIG_NAME
        if entries and resume:
            if config.is_file():
                try:
                    saved = json.loads(config.read_text())
                except ValueError as error:
                    raise RunFolderError(f"cannot resume {out}: its {CONFIG_NAME} is not valid JSON ({error})") from None
                rows = differences(saved, setup, may_change)
                if rows:
                    raise RunFolderError(
                        f"cannot resume {out}: the set-up differs from the run's {config}:\n{_table(rows)}\n"
                        f"Resume with the run's settings, start a new --out, or replace the run with --overwrite")
            else:
                warnings.warn(f"{out} has no {CONFIG_NAME} (a run from an older et-ode?): its set-up cannot be "
                              f"compared; resuming on trust", stacklevel=3)
        elif entries and overwrite:
            if not config.is_file():
                raise RunFolderError(f"--overwrite refused: {out} holds {_listing(entries)} but no {CONFIG_NAME}, so "
                                     f"it is not an et-ode run folder; et-ode only empties folders it wrote")
            for name in entries:
                target = out / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
        elif entries:
            raise RunFolderError(f"{out} is not empty ({_listing(entries)}): it holds another run. Continue it "
                                 f"with --resume (same set-up), replace it with --overwrite, or choose a new --out")
        if not (resume and config.is_file()):
            config.write_text(json.dumps(setup, indent=2))
        yield out


def _listing(entries: list[str], limit: int = 5) -> str:
    shown = ", ".join(entries[:limit])
    return shown + (f", ... ({len(entries)} entries)" if len(entries) > limit else "")
