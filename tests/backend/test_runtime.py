"""Machine facts: the CPU's vector extensions are read, never assumed."""

import pytest

from et_ode.backend import runtime


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "AVX-512"),
        ({"avx", "avx2", "fma", "f16c"}, "AVX2"),  # the AMD EPYC hosts without AVX-512
        ({"avx"}, "AVX"),
        (set(), "none known"),  # not Linux, or not x86
    ],
)
def test_vector_extensions_follow_the_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset(flags))
    assert runtime.vector_extensions() == expected


def test_description_names_the_forced_avx2_paths(monkeypatch):
    for name in runtime.AVX2_PATHS:
        monkeypatch.delenv(name, raising=False)
    assert "forced" not in runtime.cpu_description()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert runtime.forced_paths() == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "forced: ONEDNN_MAX_CPU_ISA=AVX2" in runtime.cpu_description()
    assert runtime.vector_extensions() in runtime.cpu_description()
