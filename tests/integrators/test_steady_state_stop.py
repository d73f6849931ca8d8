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


def test_a_float32_sample_resting_a_few_rounding_units_above_tol_stops_on_torchdiffeqs_loop(fixtures):
    """A trained float32 model's batch (``tests/fixtures/float32_at_rest.pt``) in which one sample's measure settles
    at ``tol (1 + 1.9e-6)``, 16 rounding units above ``tol``, where its event search ends: judged with its dtype's
    rounding, it stops there, and the batch reaches its end in a few steps instead of crawling from one event search
    to the next until the step budget is spent."""
    import et_ode
    from et_ode.integrators.stopping import within_tol

    stored = torch.load(fixtures / "float32_at_rest.pt", weights_only=True)
    model = et_ode.EnergyTransformer(8, 2, 4, 32, hopfield="relu").to(torch.float32)
    model.load_state_dict(stored["model"])
    field, x0 = et_ode.ETField(model), stored["x"]
    stop = et_ode.SteadyState(0.01, measure="tangent_gradient", per_sample=True)
    solution = et_ode.solve(
        field, x0, (0.0, 20.0), solver=et_ode.Adaptive(rtol=1e-4, atol=1e-8), stop=stop, save="final", max_steps=300
    )
    assert solution.stats.stop_times is not None and int((solution.stats.stop_times < 20.0).sum()) >= 1
    stopped = solution.stats.stop_times < 20.0
    measure = stop.rms(field, solution.x, field(None, solution.x))
    assert bool(within_tol(measure[stopped], 0.01).all())
    assert float(measure[stopped].max()) < 0.01 * (1 + 1e-5)  # a few float32 rounding units at most
    one = torch.ones(1)
    assert bool(within_tol(one.double() * (1 + 2e-6), 1.0)) is False  # float64 keeps the 1e-6 slack
    assert bool(within_tol(one * (1 + 2e-6), 1.0)) and not bool(within_tol(one * (1 + 1e-5), 1.0))
