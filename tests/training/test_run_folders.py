"""Run folders that survive faults: locks created complete and taken over when stale, released on every exit path
(a full disk included), temporary files of killed writes cleaned, and runs that never started leave no trace."""

from __future__ import annotations

import errno
import json
import os
import socket

import numpy as np
import pytest

from et_ode.cli import main
from et_ode.training import runs
from et_ode.training.runs import CONFIG_NAME, LOCK_NAME, RunFolderError, RunWriteError, claim, lock


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runs.os, "fsync", no_space)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"   \n",
        b"\x00\xff garbage",
        b"[1, 2]",
        b'{"pid": "12"}',
        b'{"pid": -4, "host": "x"}',
        b'{"pid": true}',
        json.dumps({"pid": 2**70, "host": socket.gethostname()}).encode(),
    ],
)
def test_an_empty_garbage_or_impossible_lock_is_taken_over(tmp_path, content):
    (tmp_path / LOCK_NAME).write_bytes(content)
    with pytest.warns(UserWarning, match="taking over the lock"), lock(tmp_path):
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_live_process_on_another_host_keeps_its_lock(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x"}))
    with pytest.raises(RunFolderError, match="process 1 on host 'elsewhere'"), lock(tmp_path):
        pass
    assert (tmp_path / LOCK_NAME).exists()


def test_a_full_disk_while_locking_is_a_named_error_and_leaves_no_lock(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _full_disk(patch)
        with pytest.raises(RunWriteError, match=rf"{LOCK_NAME}.*No space left") as caught, lock(out):
            pass
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, RunFolderError)
    assert os.listdir(out) == []  # neither a lock nor a temporary file
    with lock(out):  # the folder is usable once space is back
        assert (out / LOCK_NAME).exists()


def test_a_full_disk_while_writing_the_setup_releases_the_lock(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_fsync = os.fsync
    calls = []

    def fail_second(descriptor: int) -> None:  # the lock is written, then the disk fills
        calls.append(descriptor)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(descriptor)

    monkeypatch.setattr(runs.os, "fsync", fail_second)
    with pytest.raises(RunWriteError, match=rf"{CONFIG_NAME}"), claim(out, {"a": 1}):
        pass
    monkeypatch.undo()
    assert not out.exists()  # the folder it created is gone: nothing left
    with claim(out, {"a": 1}):
        pass
    assert json.loads((out / CONFIG_NAME).read_text()) == {"a": 1}


def test_temporary_files_of_killed_writes_are_cleaned_at_the_next_start(tmp_path):
    (tmp_path / "fold0").mkdir()
    stray = [
        tmp_path / ".checkpoint.safetensors.ab12cd_9.tmp",
        tmp_path / "fold0" / ".metrics.csv.k3j9x_2a.tmp",
        tmp_path / ".config.json.4242.tmp",
        tmp_path / f"{LOCK_NAME}.999999999.ffffffff.tmp",
    ]
    for path in stray:
        path.write_bytes(b"partial")
    mine = tmp_path / f"{LOCK_NAME}.{os.getpid()}.beefbeef.tmp"  # a lock being written by a live process
    mine.write_bytes(b"{")
    kept = [tmp_path / "notes.tmp", tmp_path / ".notes.tmp", tmp_path / ".draft.v2.tmp"]  # not et-ode's
    for path in kept:
        path.write_text("a file of the user's")
    with lock(tmp_path):
        assert not any(path.exists() for path in stray) and mine.exists() and all(path.exists() for path in kept)


def test_a_dangling_symlink_out_is_a_named_error(tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "missing")
    with pytest.raises(RunFolderError, match=r"symbolic link to .*missing.*does not exist"), claim(link, {}):
        pass


def test_a_run_that_fails_before_writing_leaves_the_folder_as_it_was(tmp_path):
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for out in (new, empty):
        with pytest.raises(ValueError, match="bad argument"), claim(out, {"a": 1}):
            raise ValueError("bad argument")
    assert not new.exists() and os.listdir(empty) == []
    with pytest.raises(KeyboardInterrupt), claim(empty, {"a": 1}) as out:
        (out / "metrics.csv").write_text("epoch\n1\n")
        raise KeyboardInterrupt
    assert sorted(os.listdir(empty)) == [CONFIG_NAME, "metrics.csv"]  # a started run keeps its set-up


def test_the_corrected_command_is_accepted_after_a_refused_one(tmp_path, capsys):
    out = tmp_path / "graph-run"
    assert main(["train", "graph", "classify", "--root", "", "--out", str(out)]) == 2
    assert "needs --root" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("kind", ["directory", "deep", "list", "huge"])
def test_a_resume_refuses_a_setup_file_that_is_not_a_setup(tmp_path, kind):
    config = tmp_path / CONFIG_NAME
    if kind == "directory":
        config.mkdir()
    elif kind == "deep":
        config.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "list":
        config.write_text("[1, 2]")
    else:
        with open(config, "wb") as file:
            file.truncate(runs.MAX_CONFIG_BYTES + 1)
    (tmp_path / "metrics.csv").write_text("")
    with pytest.raises(RunFolderError, match=CONFIG_NAME), claim(tmp_path, {"a": 1}, resume=True):
        pass


def test_overwrite_and_resume_accept_only_a_run_of_the_same_command(tmp_path):
    training, film = tmp_path / "training", tmp_path / "film"
    with claim(training, {"epochs": 1}) as out:
        (out / "checkpoint.safetensors").write_bytes(b"weights")
    with claim(film, {"frames": 3}, command="complete") as out:
        (out / "film.pt").write_bytes(b"film")
    for folder, command in ((training, "complete"), (film, None), (film, "evaluate")):
        before = sorted(p.name for p in folder.iterdir())
        for flags in ({"overwrite": True}, {"resume": True}):
            refusal = "refused: .* holds (a training run|a run of `et-ode complete`)"
            if flags == {"resume": True} and folder == training:  # a set-up without a command: compared instead
                refusal = "set-up differs"
            with pytest.raises(RunFolderError, match=refusal):
                with claim(folder, {"frames": 3}, command=command, **flags):
                    pass
        assert sorted(p.name for p in folder.iterdir()) == before
    with claim(film, {"frames": 4}, command="complete", overwrite=True) as out:
        assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_NAME, LOCK_NAME])
    with claim(film, {"frames": 4}, command="complete", resume=True):
        pass


def test_written_files_keep_the_usual_permissions(tmp_path):
    from et_ode.training.statefile import atomic_write

    mask = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "a.bin", lambda stream: stream.write(b"x"))
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o600)
        atomic_write(path, lambda stream: stream.write(b"y"))
        assert path.stat().st_mode & 0o777 == 0o600 and path.read_bytes() == b"y"
    finally:
        os.umask(mask)


def _pngs(folder, count: int, seed: int):
    from PIL import Image

    folder.mkdir(exist_ok=True)
    generator = np.random.default_rng(seed)
    for k in range(count):
        Image.fromarray(generator.integers(0, 256, (6, 6), dtype=np.uint8)).save(folder / f"p{k}__a.png")


def test_a_resume_on_changed_data_is_refused_with_the_difference(tmp_path):
    from et_ode.data.images import data_fingerprint

    data, out = tmp_path / "pngs", tmp_path / "run"
    _pngs(data, 5, seed=0)
    with claim(out, {"lr": 1}, data=data_fingerprint("png", data)) as folder:
        (folder / "checkpoint.safetensors").write_bytes(b"weights")
    with claim(out, {"lr": 1}, resume=True, data=data_fingerprint("png", data)):
        pass  # the same data
    _pngs(data, 5, seed=1)  # every image replaced by another of the same size
    with pytest.raises(RunFolderError, match=r"the data differ(.|\n)*content_sha256"):
        with claim(out, {"lr": 1}, resume=True, data=data_fingerprint("png", data)):
            pass
    _pngs(data, 6, seed=0)  # one image more
    with pytest.raises(RunFolderError, match=r"(.|\n)*\n  files +5 +6"):
        with claim(out, {"lr": 1}, resume=True, data=data_fingerprint("png", data)):
            pass
    assert data_fingerprint("digits", None)["files"] == 0


def test_a_run_without_a_data_fingerprint_is_resumed_with_a_warning(tmp_path):
    from et_ode.data.images import data_fingerprint

    with claim(tmp_path, {"lr": 1}) as folder:
        (folder / "metrics.csv").write_text("")
    with pytest.warns(UserWarning, match="no fingerprint of the run's data"):
        with claim(tmp_path, {"lr": 1}, resume=True, data=data_fingerprint("digits", None)):
            pass


@pytest.mark.slow  # two short trainings
def test_a_disk_that_fills_mid_training_stops_with_a_named_error_and_resumes_exactly(tmp_path, monkeypatch):
    import torch

    from et_ode.training import statefile
    from et_ode.training.train import CHECKPOINT_NAME, TrainConfig, fit
    from tests.training.test_train import NoisyRegression, linear, regression_data

    data = regression_data()

    def config(out):
        return TrainConfig(
            epochs=2, batch_size=10, lr=0.02, checkpoint_every=3, out_dir=str(out), resume=True, progress=False, seed=3
        )

    full = linear()
    fit(full, NoisyRegression(), data, None, config(tmp_path / "full"))
    real_fsync, writes = os.fsync, []

    def fills_up(descriptor: int) -> None:
        writes.append(descriptor)
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(descriptor)

    out = tmp_path / "cut"
    monkeypatch.setattr(statefile.os, "fsync", fills_up)
    with pytest.raises(RunWriteError, match=rf"{CHECKPOINT_NAME}: No space left on device"):
        fit(linear(), NoisyRegression(), data, None, config(out))
    monkeypatch.undo()
    assert not (out / LOCK_NAME).exists() and not [p for p in os.listdir(out) if p.endswith(".tmp")]
    resumed = linear()
    fit(resumed, NoisyRegression(), data, None, config(out))
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in full.state_dict().items())


def test_a_file_system_without_hard_links_still_gets_a_complete_lock(tmp_path, monkeypatch):
    def no_links(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(runs.os, "link", no_links)
    with lock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    with pytest.raises(RunFolderError, match="in use by another run"):
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
        with lock(tmp_path):
            pass


def test_a_write_refused_by_the_disk_inside_a_run_is_named(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RunWriteError, match=r"film.pt: No space left on device") as caught, claim(out, {}, command="c"):
        (out / "energy.csv").write_text("time,energy\n")
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "film.pt"))
    assert caught.value.errno == errno.ENOSPC and caught.value.path == out / "film.pt"
    assert not (out / LOCK_NAME).exists()
    with pytest.raises(FileNotFoundError), claim(tmp_path / "other", {}):
        raise FileNotFoundError(errno.ENOENT, "missing", "data.png")  # not a disk refusal: unchanged


def test_graph_runs_fingerprint_the_files_they_read(tmp_path):
    from et_ode.cli import build_parser
    from et_ode.cli.graph import _data_files
    from et_ode.data.images import files_fingerprint

    raw = tmp_path / "T" / "raw"
    raw.mkdir(parents=True)
    for kind in ("A", "graph_indicator", "graph_labels"):
        (raw / f"T_{kind}.txt").write_text("1, 2\n")
    args = build_parser().parse_args(
        ["train", "graph", "classify", "--root", str(tmp_path), "--name", "T", "--out", str(tmp_path / "run")]
    )
    files = _data_files(args)
    assert [f.name for f in files] == ["T_A.txt", "T_graph_indicator.txt", "T_graph_labels.txt"]
    before = files_fingerprint(files, "graph")
    (raw / "T_A.txt").write_text("2, 1\n")  # same size, other edges
    after = files_fingerprint(_data_files(args), "graph")
    assert before["bytes"] == after["bytes"] and before["content_sha256"] != after["content_sha256"]
