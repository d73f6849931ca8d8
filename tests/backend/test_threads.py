"""Threads on a busy machine: the check warns once with the fix, every computing command takes --threads, and
--help states each default once."""

from __future__ import annotations

import argparse
import re
import warnings

import pytest
import torch

from et_ode import cli
from et_ode.backend import runtime


@pytest.fixture
def machine(monkeypatch):
    """A machine with 2 available cores whose load average the test sets."""
    monkeypatch.delenv(runtime.THREAD_CHECK_VARIABLE, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(runtime, "_warned", False)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)

    def set_load(load: float) -> None:
        monkeypatch.setattr(runtime.os, "getloadavg", lambda: (load, load, load))

    return set_load


def test_a_busy_machine_with_two_threads_is_flagged_with_the_fix(machine):
    machine(4.0)
    message = runtime.oversubscription(threads=2)
    assert message is not None
    assert "load average 4.0 on 2 available cores" in message
    for fix in ("torch.set_num_threads(1)", "OMP_WAIT_POLICY=PASSIVE"):
        assert fix in message
    assert "(`--threads 1`)" in runtime.oversubscription(threads=2, one_thread="`--threads 1`")  # the command line's


@pytest.mark.parametrize("load,threads", [(0.1, 2), (4.0, 1), (1.0, 1)])
def test_an_idle_machine_or_one_thread_is_not_flagged(machine, load, threads):
    machine(load)
    assert runtime.oversubscription(threads=threads) is None


def test_passive_waiting_is_not_flagged(machine, monkeypatch):
    machine(6.0)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert runtime.oversubscription(threads=2) is None


def test_the_warning_comes_once_and_can_be_silenced(machine, monkeypatch):
    machine(3.0)
    with pytest.warns(RuntimeWarning, match=r"Use one thread \(`torch.set_num_threads\(1\)`\), or start Python"):
        assert runtime.warn_if_oversubscribed(threads=2) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.warn_if_oversubscribed(threads=2) is None  # once per process
        monkeypatch.setattr(runtime, "_warned", False)
        monkeypatch.setenv(runtime.THREAD_CHECK_VARIABLE, "0")
        assert runtime.warn_if_oversubscribed(threads=2) is None


def test_no_load_average_means_no_verdict(machine, monkeypatch):
    def unavailable():
        raise OSError("no load average here")

    monkeypatch.setattr(runtime.os, "getloadavg", unavailable)
    assert runtime.load_average() is None and runtime.oversubscription(threads=2) is None


def _subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(words, parser) for every command and sub-command of the CLI."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, prefix + (name,))
    if prefix:
        yield prefix, parser


COMPUTING = {("train", "image"), ("train", "graph"), ("complete",), ("evaluate",), ("analyze",), ("demo",)}


def test_every_computing_command_takes_threads():
    found = {
        words
        for words, parser in _subcommands(cli.build_parser())
        if any("--threads" in a.option_strings for a in parser._actions)
    }
    assert COMPUTING <= found, COMPUTING - found


def test_help_states_each_default_once_and_none_for_required_options():
    for words, parser in _subcommands(cli.build_parser()):
        text = re.sub(r"\s+", " ", parser.format_help())
        assert "(default: None)" not in text, words
        assert not re.search(r"\(default[^)]*\) \(default: ", text), (words, text)
    analyze = dict(_subcommands(cli.build_parser()))[("analyze",)]
    text = re.sub(r"\s+", " ", analyze.format_help())
    assert "(default: runs/analyze)" in text
    assert re.search(r"--dtype \{float32,float64\} precision", text)


def test_the_cli_applies_threads_before_the_command_and_checks_the_machine(monkeypatch, machine):
    machine(5.0)
    seen = {}
    import et_ode.cli.analyze as analyze_cli

    monkeypatch.setattr(analyze_cli, "run", lambda args: seen.setdefault("threads", torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one thread on a busy machine: no warning
            assert cli.main(["analyze", "--threads", "1"]) == 0
        assert seen["threads"] == 1
        torch.set_num_threads(2)
        with pytest.warns(RuntimeWarning, match="busy"):
            assert cli.main(["analyze"]) == 0
    finally:
        torch.set_num_threads(before)
