"""What a state's dtype and the machine cannot hold: horizons and tolerances refused naming the argument, solves that
say truthfully how they ended, and allocations beyond memory named (et_ode.OutOfMemoryError)."""

from __future__ import annotations

import math

import pytest
import torch

import et_ode
from et_ode import Adaptive, ETField, EulerET, Fixed, SolveError, Status, SteadyState, solve
from et_ode.integrators import loop
from tests.conftest import random_model


def field_of(dtype: torch.dtype) -> ETField:
    return ETField(random_model(dtype=dtype))


def states(dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def rms_in(dtype: torch.dtype, value: float) -> float:
    """The RMS of a constant field ``value``, formed from squares in ``dtype`` (as the stop's measures are)."""
    return float(torch.full((4, 8), value, dtype=torch.float64).to(dtype).square().mean().sqrt())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tolerance_below_what_the_measure_resolves_is_refused(dtype):
    floor = math.sqrt(torch.finfo(dtype).tiny)
    # independently: an RMS of squares in this dtype is exact above the floor, lost well below it
    assert rms_in(dtype, 4 * floor) == pytest.approx(4 * floor, rel=1e-5)
    small = 1.2345 * floor / 2**24
    assert abs(rms_in(dtype, small) - small) > 1e-3 * small
    field, x0 = field_of(dtype), states(dtype)
    with pytest.raises(ValueError, match=r"SteadyState\.tol=.*below what the measure resolves"):
        solve(field, x0, (0.0, 1.0), stop=SteadyState(floor / 2))
    solution = solve(field, x0, (0.0, 0.5), stop=SteadyState(2 * floor), save="final")
    assert solution.stats.status is Status.REACHED_END and solution.stats.t_final == 0.5  # honest: not met by 0.5


def test_the_issues_float32_horizon_and_tolerance_are_refused_naming_them():
    field, x0 = field_of(torch.float32), states(torch.float32)
    with pytest.raises(ValueError, match=r"SteadyState\.tol"):
        solve(field, x0, (0.0, 1e308), stop=SteadyState(1e-300))
    assert float(torch.tensor(1e308, dtype=torch.float32)) == math.inf  # the horizon itself overflows float32
    with pytest.raises(ValueError, match=r"^t reaches 1e\+308, beyond the largest torch.float32"):
        solve(field, x0, (0.0, 1e308), stop=SteadyState(1e-3))
    with pytest.raises(ValueError, match="^t reaches"):
        solve(field, x0, (0.0, 1e39))
    # float64 holds that horizon: not refused, the step budget ends it
    with pytest.raises(SolveError, match="max_steps=20"):
        solve(field_of(torch.float64), states(torch.float64), (0.0, 1e39), max_steps=20)


def test_steps_that_do_not_move_the_time_are_refused_naming_t():
    assert 1e20 + 0.1 == 1e20 and 1e20 + 1.0 == 1e20  # float64 cannot step there
    field, x0 = field_of(torch.float64), states(torch.float64)
    with pytest.raises(ValueError, match=r"^t reaches 1e\+20, where a step of 0.1 does not move the time"):
        solve(field, x0, (1e20,), solver=EulerET(0.1, 12))
    with pytest.raises(ValueError, match=r"^t reaches 1e\+20, where a step of 1 does not move the time"):
        solve(field, x0, (1e20, 1e20 + 2**20), solver=Fixed("euler", step_size=1.0), max_steps=2**21)
    for loop_name in ("torchdiffeq", "et_ode"):
        with pytest.raises(SolveError, match="start t nearer 0"):
            solve(field, x0, (1e20, 1e20 + 1e6), solver=Adaptive(loop=loop_name))
    assert 1e17 + 1.0 == 1e17  # where torchdiffeq's event search (from t0 to t0 + 1) cannot set out
    with pytest.raises(SolveError, match=r"event search cannot set out from t=1e\+17(.|\n)*start t nearer 0"):
        solve(field, x0, (1e17, 1e17 + 1e3), solver=Adaptive(loop="torchdiffeq"), stop=SteadyState(1e-3))
    # a fixed-step stop counts time in the state's dtype: float32 cannot step 0.1 at 1e8, float64 can
    assert float(torch.tensor(1e8, dtype=torch.float32) + 0.1) == 1e8
    stop, euler = SteadyState(1e-3), Fixed("euler", step_size=0.1)
    with pytest.raises(ValueError, match="does not move the time in x0's dtype torch.float32"):
        solve(field_of(torch.float32), states(torch.float32), (1e8, 1e8 + 1), solver=euler, stop=stop)
    solution = solve(field, x0, (1e8, 1e8 + 1), solver=euler, stop=stop, save="final")
    assert solution.stats.t_final == 1e8 + 1


@pytest.mark.parametrize("solver", [Adaptive(loop="torchdiffeq"), Fixed("rk4", step_size=0.05)])
def test_an_event_search_that_ends_short_of_the_stop_integrates_on(solver, monkeypatch):
    """The event search may end where the test does not hold (a sign change at a step's end that its interpolant
    does not show: the measure at its dtype's rounding); planted here as a false event at t = 0.3. The solve must go
    on: it ends at the stop (measure below tol) or at the end of the span, never in between claiming either."""
    real, calls = loop.odeint_event, []

    def false_event_first(func, y0, t0, *, event_fn, **kwargs):
        calls.append(float(t0))
        if len(calls) == 1:
            planted = event_fn

            def event_fn(t, y):
                return torch.minimum(planted(t, y), (0.3 - t).to(y.dtype))

        return real(func, y0, t0, event_fn=event_fn, **kwargs)

    monkeypatch.setattr(loop, "odeint_event", false_event_first)
    field, x0 = field_of(torch.float64), states(torch.float64)
    tol = 1e-2  # met near t = 10
    solution = solve(field, x0, (0.0, 40.0), solver=solver, stop=SteadyState(tol), save="final")
    assert len(calls) >= 2 and calls[1] == pytest.approx(0.3, abs=1e-5)  # it went on from the false event
    with torch.no_grad():
        measure = float(field.rms_dg_dt(solution.x).max())
    assert solution.stats.status is Status.STEADY_STATE and measure < tol * (1 + 1e-6)
    assert 0.3 < solution.stats.t_final < 40.0
    monkeypatch.setattr(loop, "odeint_event", real)
    reference = solve(field, x0, (0.0, 40.0), solver=solver, stop=SteadyState(tol), save="final")
    assert solution.stats.t_final == pytest.approx(reference.stats.t_final, rel=1e-3)


def test_a_model_beyond_memory_is_named():
    # 2**57 memories of 8 numbers: 2**62 bytes in float32, beyond any machine (and any address space)
    named = r"EnergyTransformer\(dim=8, .*memories=144115188075855872\)"
    with pytest.raises(et_ode.OutOfMemoryError, match=named) as caught:
        et_ode.EnergyTransformer(8, 1, 4, 2**57)
    assert caught.value.requested == 4 * 8 * 2**57 and "4.61 EB" in str(caught.value)
    with pytest.raises(et_ode.OutOfMemoryError, match="more bytes than 64 bits count"):
        et_ode.EnergyTransformer(8, 1, 4, 2**62)  # a byte count that overflows: PyTorch's own refusal, named too


ALLOCATOR_FAILURES = [
    RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 160000000000 bytes. Error code 12 (Cannot allocate memory)"
    ),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 149.01 GiB. GPU 0 has a total capacity of 79 GiB"),
]


@pytest.mark.parametrize("failure", ALLOCATOR_FAILURES, ids=["cpu", "cuda"])
def test_solve_and_find_attractor_name_an_allocation_beyond_memory(failure, monkeypatch):
    field, x0 = field_of(torch.float64), states(torch.float64)

    def allocation_fails(self, t, x):
        raise failure

    monkeypatch.setattr(ETField, "__call__", allocation_fails)
    expected = round(149.01 * 2**30) if isinstance(failure, torch.OutOfMemoryError) else 160_000_000_000
    for entry, call in (
        ("solve", lambda: solve(field, x0, (0.0, 1.0))),
        ("find_attractor", lambda: et_ode.find_attractor(field, x0)),
    ):
        with pytest.raises(et_ode.OutOfMemoryError, match=rf"^{entry}: x0 of shape \(2, 4, 8\)") as caught:
            call()
        assert caught.value.requested == expected and "allocator" not in str(caught.value)
        assert isinstance(caught.value, MemoryError) and caught.value.__cause__ is None


def test_other_runtime_errors_pass_unchanged(monkeypatch):
    field, x0 = field_of(torch.float64), states(torch.float64)

    def broken(self, t, x):
        raise RuntimeError("a bug in the field")

    monkeypatch.setattr(ETField, "__call__", broken)
    with pytest.raises(RuntimeError, match="a bug in the field"):
        solve(field, x0, (0.0, 1.0))
