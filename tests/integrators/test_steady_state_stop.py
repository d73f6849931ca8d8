"""The steady-state stop's bookkeeping: each sample's stop time, and no memory kept after a solve with gradients."""

from __future__ import annotations

import gc

import pytest
import torch

from et_ode import EnergyTransformer, ETField, SteadyState, solve


def _field() -> ETField:
    torch.manual_seed(0)
    return ETField(EnergyTransformer(dim=8, heads=2, head_dim=4, memories=16, dtype=torch.float64))


@pytest.mark.parametrize("per_sample", [True, False])
def test_a_sample_that_never_stops_carries_the_span_end(per_sample: bool) -> None:
    field = _field()
    x0 = torch.randn(3, 5, 8, dtype=torch.float64)
    out = solve(field, x0, (0.0, 0.5), stop=SteadyState(1e-12, per_sample=per_sample), save="final")
    assert out.status.value == "reached_end"
    assert out.stats.stop_times is not None
    assert (out.stats.stop_times == 0.5).all()  # exactly t1, not the event search's approximation of it


def test_stopped_and_unstopped_samples_apart() -> None:
    field = _field()
    x0 = torch.randn(4, 5, 8, dtype=torch.float64)
    late = solve(field, x0, (0.0, 200.0), stop=SteadyState(1e-3, per_sample=True), save="final").stats.stop_times
    assert late is not None and (late < 200.0).all()
    span = float(late.min() + late.max()) / 2  # some samples converge inside it, others do not
    out = solve(field, x0, (0.0, span), stop=SteadyState(1e-3, per_sample=True), save="final")
    assert out.stats.stop_times is not None
    converged = field.rms_dg_dt(out.x, field(None, out.x)) < 1e-3 * (1 + 1e-6)
    assert converged.any() and not converged.all()
    assert (out.stats.stop_times[~converged] == span).all()
    assert (out.stats.stop_times[converged] < span).all()


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if torch.is_tensor(obj))


@pytest.mark.parametrize("per_sample", [True, False])
def test_no_tensors_outlive_a_steady_state_solve_with_gradients(per_sample: bool) -> None:
    field = _field()
    x0 = torch.randn(3, 5, 8, dtype=torch.float64)

    def run() -> None:
        out = solve(field, x0, (0.0, 50.0), stop=SteadyState(1e-2, per_sample=per_sample), save="final")
        assert out.x.requires_grad  # the graph exists, and is dropped with the solution

    run()
    before = _live_tensors()
    for _ in range(6):
        run()
    assert _live_tensors() - before <= 2
