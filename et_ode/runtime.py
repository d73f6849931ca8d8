"""What the machine offers: the CPU's vector extensions and the code paths PyTorch takes on them (a leaf module).

Machines of the same kind differ (some AMD EPYC hosts have AVX-512, some only AVX2), so nothing in et-ode assumes a
CPU feature: the fused field asks oneDNN whether it packs a dtype (:func:`et_ode.fused.supports_onednn`), and
timings name the path they were measured on (:func:`cpu_description`).
"""

from __future__ import annotations

import os
import platform
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
