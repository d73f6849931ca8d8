"""Run folders that never clobber one another: a lock per folder, and a set-up that a resume must keep.

A run folder holds one run: ``config.json`` (its set-up), the checkpoint, metrics and results. :func:`claim` takes a
folder for a run before the run writes anything (the lock, the resume and overwrite rules, ``config.json``) and
:func:`lock` holds a folder's lock; :class:`RunFolderError` and its subclasses name what is refused. One rule serves
every command that writes a folder (train, complete, evaluate, analyze, demo), and none replaces another's run.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import re
import shutil
import socket
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

LOCK_NAME = ".et-ode.lock"
CONFIG_NAME = "config.json"
COMMAND_KEY = "et_ode_command"  # in config.json: the command that wrote the folder (absent: a training run)
DATA_KEY = "data_fingerprint"  # in config.json: what the run read (claim's ``data``)
_held: dict[Path, int] = {}  # folders this process has locked -> nesting depth


class RunFolderError(ValueError):
    """An output folder that cannot be used as asked: a file, a dangling link, a folder of another run, in use, or a
    resume with a changed set-up. The message says what is there and what to do."""


class RunFolderInUse(RunFolderError, FileExistsError):
    """A folder that holds files (of another run, or of another command) and may not be written as asked."""


class RunWriteError(RunFolderError):
    """A file of a run folder could not be written or created (a full or read-only disk, no permission): the
    message names the file and the operating system's reason, ``errno`` holds its code. Nothing half-written is
    left behind, and the folder's lock is released."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(
            f"cannot write {path}: {error.strerror or error} (errno {error.errno}); free space or choose a writable folder"
        )
        self.errno = error.errno
        self.path = path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except (OverflowError, ValueError, OSError):  # not a process id this system can have
        return False
    return True


def _check_folder(out: Path) -> None:
    if out.is_symlink() and not out.exists():
        raise RunFolderError(
            f"the run folder {out} is a symbolic link to {os.readlink(out)!r}, which does not exist; "
            f"create its target or give another folder"
        )
    if out.exists() and not out.is_dir():
        raise RunFolderError(
            f"the run folder {out} is an existing file, not a folder; give a folder (new or empty, "
            f"or a run folder to resume or overwrite)"
        )


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file beside it, fsync, ``os.replace``).

    Raises:
        RunWriteError: the disk refused (full, read-only, no permission), naming ``path``; no temporary file is left.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise RunWriteError(path, error) from None


def _lock_record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def _create_lock(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` in one step (a complete temporary file hard-linked to ``path``): True, or
    False when ``path`` exists. RunWriteError when the disk refuses."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        handle = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except OSError as error:
            if error.errno not in _NO_HARD_LINKS:
                raise
            _create_exclusive(path, text)  # a file system without hard links: created, then filled
        return True
    except FileExistsError:
        return False
    except OSError as error:
        raise RunWriteError(path, error) from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()


DISK_FULL_OR_READ_ONLY = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def _create_exclusive(path: Path, text: str) -> None:
    """Create ``path`` (FileExistsError if it exists) and write ``text``; removed again if the write fails."""
    handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _stale(raw: bytes, host: str) -> tuple[str | None, dict[str, Any]]:
    """Why the lock holding ``raw`` can be taken over (None: it cannot, a live or unknown process holds it), and the
    record it holds."""
    try:
        other = json.loads(raw)
    except (ValueError, RecursionError):
        other = None
    if not isinstance(other, dict):
        return ("it is empty" if not raw.strip() else "it holds no lock record"), {}
    pid = other.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return f"it names no process (pid {pid!r})", other
    if other.get("host") == host and not _alive(pid):
        return f"process {pid} is no longer running (started {other.get('started')})", other
    return None, other


def _take_over(path: Path, raw: bytes) -> bool:
    """Move the stale lock ``path`` (read as ``raw``) aside and delete it: True, or False when ``path`` changed
    meanwhile (another process took it first; then its lock is put back)."""
    aside = path.with_name(f"{path.name}.{os.getpid()}.stale.tmp")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return True  # gone already
    try:
        if aside.read_bytes() != raw:
            with contextlib.suppress(OSError):
                os.link(aside, path)
            return False
        return True
    finally:
        with contextlib.suppress(OSError):
            aside.unlink()


def _acquire(out: Path, path: Path) -> None:
    record = _lock_record()
    text = json.dumps(record)
    for _attempt in range(5):
        if _create_lock(path, text):
            return
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as error:
            raise RunFolderError(
                f"{out}: its lock {path} cannot be read ({error.strerror}); delete it if no run uses the folder"
            ) from None
        reason, other = _stale(raw, record["host"])
        if reason is None:
            raise RunFolderError(
                f"{out} is in use by another run: process {other.get('pid')} on host {other.get('host')!r}, started "
                f"{other.get('started')} ({other.get('command', '?')!r}). Wait for it to finish or choose another "
                f"folder; if that process is gone, delete {path}"
            )
        if _take_over(path, raw):
            warnings.warn(f"{path}: taking over the lock of process {other.get('pid')}: {reason}", stacklevel=4)
    raise RunFolderError(f"{out}: could not take its lock {path} (other processes keep taking it); try again")


# the temporary files of et-ode's atomic writes: ".<file>.<mkstemp's 8 characters or a pid>.tmp", and the lock's
# ".et-ode.lock.<pid>.<hex or 'stale'>.tmp"
_TEMPORARY = re.compile(re.escape(LOCK_NAME) + r"\.(\d+)\.([0-9a-f]{8}|stale)\.tmp|\..+\.([a-z0-9_]{8}|\d+)\.tmp")


def _clean_temporaries(out: Path) -> None:
    """Delete the temporary files that killed et-ode writes left in ``out`` and its subfolders (named like
    ``.checkpoint.safetensors.k3j9x_2a.tmp``; other files are never touched); a lock's temporary file is kept while
    the process named in it runs."""
    for folder, _dirs, files in os.walk(out):
        for name in files:
            match = _TEMPORARY.fullmatch(name)
            if match is None or (match.group(1) is not None and _alive(int(match.group(1)))):
                continue
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)


@contextlib.contextmanager
def lock(out: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``out/.et-ode.lock`` while the block runs (the lock of :func:`claim`); re-entrant in one process.

    The lock file is created complete in one step (a temporary file hard-linked into place). A lock that is empty,
    holds no valid record, or names a process of this host that has exited is taken over with a warning.
    Once held, the temporary files (``.*.tmp``) that killed writes left in ``out`` are deleted.

    Raises:
        RunFolderError: ``out`` is a file or a dangling link, or another live process holds the lock (named).
        RunWriteError: the folder or its lock cannot be created (full or read-only disk), naming the path.
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
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunWriteError(out, error) from None
    path = out / LOCK_NAME
    _acquire(out, path)
    _held[key] = 1
    try:
        _clean_temporaries(out)
        yield out
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            path.unlink()


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
    return [
        (key, a.get(key, missing), b.get(key, missing))
        for key in sorted(set(a) | set(b))
        if a.get(key, missing) != b.get(key, missing)
        and not any(key == name or key.startswith(f"{name}.") for name in allowed)
    ]


def _table(rows: list[tuple[str, Any, Any]]) -> str:
    def show(value: Any) -> str:
        return "(absent)" if not isinstance(value, (str, int, float, bool, list, dict, type(None))) else repr(value)

    cells = [("setting", "run in the folder", "now")] + [(k, show(a), show(b)) for k, a, b in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    return "\n".join("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in cells)


@contextlib.contextmanager
def claim(
    out: str | os.PathLike[str],
    setup: dict[str, Any],
    *,
    resume: bool = False,
    overwrite: bool = False,
    may_change: Iterable[str] = (),
    command: str | None = None,
    data: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """Take ``out`` for a run whose set-up is ``setup`` (JSON-like), in this order, before the run writes anything:

    1. ``out`` must not be an existing file.
    2. The lock ``out/.et-ode.lock`` is created complete in one step (a temporary file hard-linked into place) and
       holds the pid, host, start time and command line. A lock held by a live process refuses the run, naming that
       process; a lock left by a dead process on this host (a killed run), an empty one or one without a valid
       record is taken over with a warning. Once it is held, temporary files (``.*.tmp``) of killed writes are
       deleted.
    3. A folder with files needs ``resume`` or ``overwrite``. A resume compares the whole set-up with the folder's
       ``config.json`` and refuses any change (a table of the differences), except in the settings named
       ``may_change`` (how a run executes: device, threads, progress bars, ...). An overwrite empties the folder,
       and only a folder that holds an et-ode run (a ``config.json``) of the same ``command``.
    4. ``config.json`` is written once the run is accepted (a resume keeps the original).

    The lock is released when the ``with`` block ends, however it ends (a full disk included). Within one process
    the lock is re-entrant: :func:`et_ode.training.train.fit` can lock the folder its caller claimed, and a nested
    claim of a folder the process holds is accepted without the checks (the outer claim made them).

    A run that raises before it writes anything (bad arguments, missing data) leaves ``out`` unchanged: the
    ``config.json`` written here is removed, and so is the folder if this claim created it.

    Args:
        out: the run folder, created if missing.
        setup: the run's set-up (JSON-like), written to ``out/config.json``.
        resume: continue the run in ``out``; its set-up must equal ``setup`` but for ``may_change``.
        overwrite: empty ``out`` first (a run of the same ``command``).
        may_change: the dotted settings a resume may change (how a run executes: device, threads, progress bars).
        command: the et-ode command that writes the folder (e.g. ``"complete"``; None: a training run), kept in
            ``config.json`` under ``"et_ode_command"``; ``overwrite`` or ``resume`` accept only a folder the same
            command wrote, so that no command replaces another's run.
        data: a fingerprint of the data the run reads (e.g. :func:`et_ode.data.images.data_fingerprint`), kept under
            ``"data_fingerprint"``; a resume whose data differ from the run's is refused with a table of the
            differences (a run without one is resumed with a warning).

    Yields:
        ``out`` as a ``Path``, locked while the block runs.

    Raises:
        RunFolderError: ``out`` is a file or a dangling link; another live process holds the lock; a resume with
            a set-up that differs from ``out/config.json`` (a table of the differences). Its subclass
            :class:`RunFolderInUse` (also a FileExistsError): ``out`` holds files and the call gives neither
            ``resume`` nor ``overwrite``, or gives them for a folder that is not a run of ``command``.
            Nothing in ``out`` has changed when it is raised.
        RunWriteError: a full or read-only disk, naming the file: while the folder is taken, or any write of the
            run inside the ``with`` block that fails for lack of space or a read-only disk (an OSError of those
            kinds leaving the block becomes a RunWriteError naming its file).
    """
    out = Path(out)
    if resume and overwrite:
        raise RunFolderError("give resume (continue the run in the folder) or overwrite (replace it), not both")
    _check_folder(out)
    if out.resolve() in _held:  # claimed by this process already (e.g. the demo around its training run)
        with lock(out):
            yield out
        return
    created, wrote = not out.exists(), False
    try:
        with lock(out):
            wrote = _prepare(out, setup, resume, overwrite, may_change, command, data)
            try:
                yield out
            except BaseException:
                if wrote:
                    _forget_setup(out)
                raise
    except OSError as error:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty
        if error.errno in DISK_FULL_OR_READ_ONLY:  # a write of the run's refused by the disk: named
            raise RunWriteError(Path(error.filename) if error.filename else out, error) from error
        raise
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty
        raise


def _prepare(
    out: Path,
    setup: dict[str, Any],
    resume: bool,
    overwrite: bool,
    may_change: Iterable[str],
    command: str | None,
    data: dict[str, Any] | None,
) -> bool:
    """The checks of :func:`claim` in the locked folder, then its ``config.json``: whether this call writes it."""
    entries = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)
    config = out / CONFIG_NAME
    if entries and resume:
        _check_resume(out, config, setup, may_change, command, data)
    elif entries and overwrite:
        _check_owner(out, config, entries, command, "overwrite")
        for name in entries:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
    elif entries:
        raise RunFolderInUse(
            f"{out} is not empty ({_listing(entries)}): it holds another run. Continue it "
            f"with resume (the same set-up), replace it with overwrite, or choose another folder"
        )
    if resume and config.is_file():
        return False
    record = setup if command is None else {COMMAND_KEY: command, **setup}
    if data is not None:
        record = {**record, DATA_KEY: data}
    write_text(config, json.dumps(record, indent=2))
    return True


def _what(command: str | None) -> str:
    return "a training run" if command is None else f"a run of `et-ode {command}`"


def _check_owner(out: Path, config: Path, entries: list[str], command: str | None, asked: str) -> dict[str, Any]:
    """The set-up in ``config`` when ``out`` is a run folder of ``command`` (RunFolderInUse otherwise, naming what the
    call ``asked``: ``"resume"`` or ``"overwrite"``). A resume also accepts a set-up that names no command (its
    set-up is compared instead)."""
    if config.is_symlink() or not config.is_file():
        raise RunFolderInUse(
            f"{asked} refused: {out} holds {_listing(entries)} but no {CONFIG_NAME}, so it is not an "
            f"et-ode run folder; et-ode only replaces or continues folders it wrote"
        )
    saved = read_config(config)
    found = saved.get(COMMAND_KEY)
    if found != command and not (asked == "resume" and found is None):
        held = _what(found) if isinstance(found, str) else "a training run (its config.json names no command)"
        raise RunFolderInUse(
            f"{asked} refused: {out} holds {held}, not {_what(command)}; et-ode replaces or "
            f"continues only a folder the same command wrote. Choose another folder"
        )
    return saved


def _check_resume(
    out: Path,
    config: Path,
    setup: dict[str, Any],
    may_change: Iterable[str],
    command: str | None,
    data: dict[str, Any] | None,
) -> None:
    if not config.exists() and not config.is_symlink():
        warnings.warn(
            f"{out} has no {CONFIG_NAME} (a run from an older et-ode?): its set-up cannot be compared; resuming on trust",
            stacklevel=5,
        )
        return
    saved = _check_owner(out, config, [CONFIG_NAME], command, "resume")
    saved.pop(COMMAND_KEY, None)
    _check_data(out, config, saved.pop(DATA_KEY, None), data)
    rows = differences(saved, setup, may_change)
    if rows:
        raise RunFolderError(
            f"cannot resume {out}: the set-up differs from the run's {config}:\n{_table(rows)}\n"
            f"Resume with the run's settings, choose another folder, or replace the run (overwrite)"
        )


def _check_data(out: Path, config: Path, saved: Any, data: dict[str, Any] | None) -> None:
    """A resume reads the data the run read: RunFolderError with a table of the differences otherwise."""
    if data is None:
        return
    if not isinstance(saved, dict):
        warnings.warn(
            f"{config} holds no fingerprint of the run's data (an older et-ode?): the data cannot be "
            f"compared; resuming on trust",
            stacklevel=6,
        )
        return
    rows = differences(saved, data)
    if rows:
        raise RunFolderError(
            f"cannot resume {out}: the data differ from those the run read ({config}):\n"
            f"{_table(rows)}\nResume with the run's data, or choose another folder"
        )


MAX_CONFIG_BYTES = 16 * 2**20


def read_config(config: Path) -> dict[str, Any]:
    """A run's ``config.json``: a JSON object of at most ``MAX_CONFIG_BYTES`` (RunFolderError naming the file
    otherwise: too large, not JSON, nested too deep, not an object)."""
    try:
        size = config.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise RunFolderError(f"{config} holds {size} bytes, more than a run's set-up ({MAX_CONFIG_BYTES})")
        saved = json.loads(config.read_text())
    except RecursionError:
        raise RunFolderError(f"{config} is nested too deeply to be a run's set-up") from None
    except (ValueError, OSError) as error:
        raise RunFolderError(f"cannot resume from {config}: not a readable JSON file ({error})") from None
    if not isinstance(saved, dict):
        raise RunFolderError(f"{config} does not hold a run's set-up (a JSON object), got {type(saved).__name__}")
    return saved


def _forget_setup(out: Path) -> None:
    """Remove the ``config.json`` a claim wrote when the run left nothing else in ``out``."""
    entries = {p.name for p in out.iterdir()} - {LOCK_NAME, CONFIG_NAME}
    if not entries:
        with contextlib.suppress(OSError):
            (out / CONFIG_NAME).unlink()


def _listing(entries: list[str], limit: int = 5) -> str:
    shown = ", ".join(entries[:limit])
    return shown + (f", ... ({len(entries)} entries)" if len(entries) > limit else "")
