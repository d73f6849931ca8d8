"""What the machine offers: the CPU's vector extensions and the code paths PyTorch takes on them (a leaf module).

Machines of the same kind differ (some AMD EPYC hosts have AVX-512, some only AVX2), so nothing in et-ode assumes a
CPU feature: the fused field asks oneDNN whether it packs a dtype (:func:`et_ode.kernels.gemm.supports_onednn`), and
the benchmarks name the code path they run on (:func:`cpu_description`).
"""

from __future__ import annotations

import os
import platform
import warnings
from functools import lru_cache

import torch

# the environment variables that force the AVX2 code paths on an AVX-512 machine (oneDNN, MKL, ATen)
AVX2_PATHS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the OS reports them (Linux's ``/proc/cpuinfo``; empty where unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def vector_extensions() -> str:
    """``"AVX-512"``, ``"AVX2"``, ``"AVX"`` or ``"none known"``: the widest x86 vector extension the CPU has."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "AVX" if "avx" in flags else "none known"


def forced_paths() -> dict[str, str]:
    """The variables among :data:`AVX2_PATHS` set in this process's environment, with their values."""
    return {name: os.environ[name] for name in AVX2_PATHS if name in os.environ}


def cpu_description() -> str:
    """One line naming the processor, its vector extensions and the path PyTorch's kernels dispatch to, e.g.
    ``"AMD EPYC, AVX-512 CPU, ATen AVX2 kernels (forced: ONEDNN_MAX_CPU_ISA=AVX2, ...)"``."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name)
    except OSError:
        pass
    line = f"{name}, {vector_extensions()} CPU, ATen {torch.backends.cpu.get_cpu_capability()} kernels"
    forced = forced_paths()
    if forced:
        line += " (forced: " + ", ".join(f"{key}={value}" for key, value in forced.items()) + ")"
    return line


# --- threads on a busy machine ---------------------------------------------------------------------------------

#: set to ``0`` to silence :func:`warn_if_oversubscribed`
THREAD_CHECK_VARIABLE = "ET_ODE_THREAD_CHECK"
_warned = False


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The machine's load average over the last minute (``None`` where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def oversubscription(threads: int | None = None, one_thread: str = "`torch.set_num_threads(1)`") -> str | None:
    """Why PyTorch's threads would fight for this machine's cores, with the fix; ``None`` when they would not.

    The cores are oversubscribed when the load average (other processes' runnable threads) plus PyTorch's
    ``threads`` (default :func:`torch.get_num_threads`) exceed the available cores by more than half a core:
    OpenMP's threads then spin waiting for each other at every parallel region, which slows small solves many times
    over (figures in the getting-started guide). One thread, or ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep instead of
    spinning), is never flagged. ``one_thread`` says how to run one thread where the message is read (the command
    line gives its own option).
    """
    threads = torch.get_num_threads() if threads is None else threads
    if threads <= 1 or os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return None
    load, cores = load_average(), available_cores()
    if load is None or load + threads <= cores + 0.5:
        return None
    return (
        f"this machine is busy (load average {load:.1f} on {cores} available core{'s' * (cores != 1)}) and "
        f"PyTorch runs {threads} threads, which then wait on each other: computations can be many times slower "
        f"(18-60x measured on a loaded 2-core machine). Use one thread ({one_thread}), or start Python with "
        f"OMP_WAIT_POLICY=PASSIVE. "
        f"({THREAD_CHECK_VARIABLE}=0 silences this check.)"
    )


def warn_if_oversubscribed(threads: int | None = None, one_thread: str = "`torch.set_num_threads(1)`") -> str | None:
    """Warn (a ``RuntimeWarning``, once per process) when :func:`oversubscription` finds the cores oversubscribed;
    returns its message, or ``None``. Skipped when the environment sets ``ET_ODE_THREAD_CHECK=0``."""
    global _warned
    if _warned or os.environ.get(THREAD_CHECK_VARIABLE, "1").strip() == "0":
        return None
    message = oversubscription(threads, one_thread)
    if message is not None:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return message


_SOLVE_PROGRESS = {"default": False}
SLOW_SOLVE_SECONDS = 3.0  # a solve that runs this long shows its bar when the bar is on by default


def show_solve_progress(on: bool) -> None:
    """Whether :func:`et_ode.solve` shows a progress bar when its ``progress`` argument is left at None (the
    command line turns it on: a solve then shows its bar once it has run :data:`SLOW_SOLVE_SECONDS`)."""
    _SOLVE_PROGRESS["default"] = bool(on)


def solve_progress_default() -> bool:
    """The default that :func:`show_solve_progress` set (off until it is called)."""
    return _SOLVE_PROGRESS["default"]
