"""Behaviour that mutation testing (``make mutate``) found unchecked: the evaluation count, failed solves' partial
solutions and errors, the settings objects' rules. Each test states a documented promise against an independent
reference (a closed form, a count of the model's actual evaluations, the documented message)."""

import math
import os
import re
import warnings

import pytest
import torch

from et_ode import (
    Adaptive,
    Adjoint,
    AttractorError,
    EnergyAttention,
    EnergyTransformer,
    ETField,
    EulerET,
    Fixed,
    GraphMask,
    Implicit,
    SolveError,
    Status,
    SteadyState,
    solve,
)
from et_ode.energy.neurons import radial_direction, tangent_projection
from et_ode.equilibrium.implicit import implicit_attractor
from tests.conftest import hand_rk4, random_model


def _state(batch: int = 2, n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(t=(0.0, 100.0), solver=Adaptive(rtol=1e-6, atol=1e-8), stop=SteadyState(1e-3)),
        dict(t=(0.0, 1e3), solver="bosh3", stop=SteadyState(0.1, measure="tangent_gradient")),
        dict(t=(0.0, 100.0), solver="dopri5", stop=SteadyState(1e-3, per_sample=True), save="final"),
        dict(solver=EulerET(0.1, 400), stop=SteadyState(1e-2)),
        dict(t=torch.linspace(0.0, 100.0, 5, dtype=torch.float64), solver="dopri5", stop=SteadyState(1e-3)),
        dict(t=(0.0, 2.0), solver=Fixed("rk4", step_size=0.1)),
    ],
)
def test_nfe_counts_every_evaluation_of_the_dynamics(monkeypatch, kwargs):
    """``stats.nfe_forward`` is the number of times the model's dynamics were evaluated during the solve, the stop
    test's evaluations included: counted here at ``ETField.velocity``, the one place the field computes them."""
    field = ETField(random_model(hopfield="softmax", eps=1e-3), tau=0.7)
    calls = []
    velocity = ETField.velocity

    def counted(self, x, *, out=None):
        calls.append(x.shape[:-2].numel())
        return velocity(self, x, out=out)

    monkeypatch.setattr(ETField, "velocity", counted)
    solution = solve(field, _state(batch=3), **kwargs)
    assert solution.stats.nfe_forward == len(calls) > 5
    assert solution.stats.sample_evaluations == sum(calls)
    if "stop" in kwargs:
        assert solution.status is Status.STEADY_STATE


def test_a_failed_solve_returns_its_last_state_with_its_layer_norm():
    """The partial solution of a failed solve: the state at the last step's start, its activation ``g`` by the
    LayerNorm's closed form, the failure time as its only time, and a measured wall time."""
    model = random_model(hopfield="softmax", eps=0.05)
    x0 = _state()
    with pytest.raises(SolveError, match="max_steps=6") as caught:
        solve(ETField(model), x0, (0.0, 100.0), max_steps=6)
    partial = caught.value.solution
    assert partial.status is Status.FAILED and 0 < caught.value.time < 100
    assert partial.ts.tolist() == [caught.value.time] and partial.xs.shape == (1, *x0.shape)
    x = partial.x
    centred = x - x.mean(dim=-1, keepdim=True)
    expected_g = (
        float(model.neuron.gamma.detach()) * centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + 0.05)
        + model.neuron.delta
    )
    torch.testing.assert_close(partial.g, expected_g, rtol=1e-12, atol=1e-12)
    assert isinstance(partial.stats.wall_time, float) and partial.stats.wall_time > 0


def test_a_non_finite_adjoint_state_is_a_named_solve_error():
    """A NaN reaching the adjoint's backward solve (here from the loss) stops it with a SolveError that says so and
    where, instead of torchdiffeq's step-size assertion."""
    field = ETField(random_model(hopfield="softmax"))
    solution = solve(field, _state(), (0.0, 1.0), gradient=Adjoint())
    loss = (solution.x * torch.full_like(solution.x, math.nan)).sum()
    with pytest.raises(SolveError, match="backward solve failed at t=1: a non-finite adjoint state") as caught:
        loss.backward()
    assert caught.value.time == 1.0 and caught.value.solution is None


def test_fixed_step_budget_counts_the_whole_grid_before_any_work():
    field = ETField(random_model(hopfield="softmax"))
    t = torch.tensor([0.0, 0.5, 10.0], dtype=torch.float64)
    with pytest.raises(SolveError, match=r"1000 fixed steps planned from t=0 to 10, more than max_steps=100"):
        solve(field, _state(), t, solver=Fixed("euler", step_size=0.01), max_steps=100)
    assert field.nfe == 0
    with pytest.raises(SolveError, match=r"steps=200 is more than max_steps=100; raise max_steps or take fewer"):
        solve(field, _state(), solver=EulerET(0.1, 200), max_steps=100)
    assert field.nfe == 0


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: Implicit(tol=math.inf), ValueError, "Implicit.tol must be a positive finite number"),
        (lambda: Implicit(tol=math.nan), ValueError, "Implicit.tol must be a positive finite number"),
        (lambda: Fixed("dopri5"), ValueError, r"Fixed.method .*, got 'dopri5' \(an adaptive method: use Adaptive\)$"),
        (lambda: Fixed("euler", options=3), TypeError, "Fixed.options must be a dict"),
    ],
)
def test_settings_refuse_bad_values_and_say_what_to_use(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("solver", ["dopri5", Fixed("rk4", step_size=0.05), EulerET(0.1, 400)])
def test_a_stop_saving_the_grid_goes_on_past_each_grid_time(solver):
    """With ``save="all"`` a stop integrates segment by segment to each time of the grid; torchdiffeq finds each
    segment's end by bisection to ``atol`` only, and the loop must know it reached the end there (it stopped at
    the first grid time, status ``reached_end``, at the default tolerances and with every fixed-step solver)."""
    field = ETField(random_model(hopfield="softmax", eps=1e-3), tau=0.7)
    x0, tol = _state(batch=3), 1e-2
    grid = {} if isinstance(solver, EulerET) else dict(t=torch.linspace(0.0, 100.0, 101, dtype=torch.float64))
    solution = solve(field, x0, solver=solver, stop=SteadyState(tol), save="all", **grid)
    final = solve(field, x0, solver=solver, stop=SteadyState(tol), save="final", **grid)
    assert solution.status is Status.STEADY_STATE and final.status is Status.STEADY_STATE
    t_stop = solution.stats.t_final
    assert 5 < t_stop < 50 and abs(t_stop - final.stats.t_final) <= 1e-5 * t_stop
    times = solution.ts.tolist()
    step = 0.07 if isinstance(solver, EulerET) else 1.0  # the grid: multiples of alpha * tau, or of 1
    assert times[-1] == t_stop and len(times) == math.floor(t_stop / step) + 2
    torch.testing.assert_close(solution.ts[:-1], torch.arange(len(times) - 1, dtype=torch.float64) * step)
    with torch.no_grad():
        rms = field.rms_dg_dt(solution.xs)  # (T, batch): the stop is the first time every sample is below tol
    assert float(rms[-1].max()) < tol * (1 + 1e-6) and float(rms[-2].max()) > tol


@pytest.mark.parametrize("solver", [EulerET(0.1, 20), Adaptive()])
def test_the_end_of_t_above_the_tolerance_is_reached_end(solver):
    """``status`` is ``steady_state`` only where the stop test holds at the returned state: a solve that runs out
    of time with the measure at 1.5 tol (the end found by bisection slightly before ``t1``) reports ``reached_end``."""
    field = ETField(random_model(hopfield="softmax", eps=1e-3), tau=0.7)
    x0 = _state()
    t = None if isinstance(solver, EulerET) else (0.0, 1.4)
    free = solve(field, x0, t, solver=solver, save="final")
    with torch.no_grad():
        tol = float(field.rms_dg_dt(free.x).max()) / 1.5
    stopped = solve(field, x0, t, solver=solver, stop=SteadyState(tol), save="final")
    assert stopped.status is Status.REACHED_END and abs(stopped.stats.t_final - 1.4) < 1e-5
    with torch.no_grad():
        assert float(field.rms_dg_dt(stopped.x).max()) > 1.4 * tol


def test_the_sphere_geometry_per_token_against_explicit_projectors():
    """``s_A = (g_A - delta - mean) / r_A`` and ``T = I - 11^T / D - s s^T`` per token, as explicit (D, D) matrices,
    over two batch dimensions (so that no token's reduction can run along another axis unnoticed)."""
    generator = torch.Generator().manual_seed(3)
    g = torch.randn(2, 3, 4, 6, dtype=torch.float64, generator=generator)
    v = torch.randn(2, 3, 4, 6, dtype=torch.float64, generator=generator)
    delta = torch.randn(6, dtype=torch.float64, generator=generator)
    s, radius = radial_direction(g, delta)
    centre = torch.eye(6, dtype=torch.float64) - 1 / 6
    u = (g - delta) @ centre
    assert radius.shape == (2, 3, 4, 1)
    torch.testing.assert_close(radius.squeeze(-1), u.norm(dim=-1), rtol=1e-14, atol=0)
    torch.testing.assert_close(s, u / u.norm(dim=-1, keepdim=True), rtol=1e-14, atol=1e-15)
    projectors = centre - s[..., :, None] * s[..., None, :]  # (2, 3, 4, D, D)
    expected = (projectors @ v[..., None]).squeeze(-1)
    torch.testing.assert_close(tangent_projection(v, s), expected, rtol=1e-13, atol=1e-14)


def test_attention_weights_with_self_attention_and_no_mask_are_the_softmax_over_keys():
    """``S[h, B, C] = softmax_B(beta_h K_hB . Q_hC)`` with every key allowed (the SPEC, by einsum)."""
    attention = EnergyAttention(6, 2, 3, beta=[0.7, 1.9], self_attention=True, dtype=torch.float64)
    g = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    keys = torch.einsum("hyd,bnd->bhny", attention.WK, g)
    queries = torch.einsum("hyd,bnd->bhny", attention.WQ, g)
    logits = torch.tensor([0.7, 1.9], dtype=torch.float64)[:, None, None] * torch.einsum("bhky,bhqy->bhkq", keys, queries)
    torch.testing.assert_close(attention.attention(g), torch.softmax(logits, dim=-2), rtol=1e-13, atol=1e-15)


def test_a_float32_attention_energy_on_a_graph_stays_float32():
    """``beta`` is held in float64 for every module dtype; a float32 module's energies are still float32 (and agree
    with the float64 module to float32 rounding), on the dense and the edge-list forms alike."""
    attention = EnergyAttention(6, 2, 3, beta=[0.7, 1.9], dtype=torch.float64)
    g = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    graph = GraphMask(torch.tensor([[0, 1, 2, 3, 4, 1], [1, 2, 3, 4, 0, 3]]), 5)
    single = EnergyAttention(6, 2, 3, beta=[0.7, 1.9]).float()
    single.load_state_dict(attention.state_dict())
    for mask in (None, graph):
        energy = single.energy(g.float(), mask)
        assert energy.dtype == torch.float32
        torch.testing.assert_close(energy.double(), attention.energy(g, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hopfield", ["relu", "softmax", "softplus"])
def test_a_model_is_built_on_the_device_it_is_given(hopfield):
    """``device=`` puts every parameter and buffer there, and the energies, their gradients and the attention
    weights compute there: checked on PyTorch's ``meta`` device (shapes only), which every machine has."""
    model = EnergyTransformer(8, 2, 4, 12, hopfield=hopfield, device="meta", dtype=torch.float64)
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    g = torch.empty(2, 5, 8, device="meta", dtype=torch.float64)
    for value, shape in (
        (model._energy_g(g, None), (2,)),
        (model._dE_dg(g, None), (2, 5, 8)),
        (model.attention.attention(g), (2, 2, 5, 5)),
        (model.neuron(g), (2, 5, 8)),
    ):
        assert value.device.type == "meta" and value.shape == shape
    grid = EulerET(0.1, 4).time_grid(None, 1.0, torch.device("meta"), 10)
    assert grid.device.type == "meta" and grid.shape == (5,)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: EnergyAttention(6, 2, 0), "head_dim must be a positive integer, got 0"),
        (lambda: EnergyAttention(6, 0, 3), "heads must be a positive integer, got 0"),
    ],
)
def test_sizes_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_implicit_gradients_refuse_uncertified_points_and_say_what_to_raise():
    """An implicit gradient asked of an uncertified sample is refused by name; conjugate gradients stopped by
    ``max_iter`` warn with the setting to raise (the one of ``solve`` and of ``find_attractor``)."""
    field = ETField(random_model(hopfield="softmax"))
    x = _state(batch=2, n=3)
    spheres_and_x = torch.tensor([False, True])
    weights = _state(batch=2, n=3, seed=1)  # a loss the spheres' tangent projection does not annihilate
    g = implicit_attractor(field, x, in_x=spheres_and_x, certified=torch.tensor([True, False]))
    with pytest.raises(
        AttractorError,
        match=r"no implicit gradient at sample\(s\) \[1\]: not a certified stable "
        r"attractor .*; see Attractor.kind and Attractor.converged",
    ):
        (g * weights).sum().backward()
    g = implicit_attractor(field, x, in_x=spheres_and_x, certified=torch.tensor([True, True]), max_iter=1)
    with pytest.warns(
        RuntimeWarning,
        match=r"stopped after 1 iterations .*; raise max_iter of the Implicit settings "
        r"\(solve's gradient=, find_attractor's implicit=, AttractorReadout's "
        r"implicit=\)",
    ):
        (g * weights).sum().backward()


def test_built_from_tensors_and_graph_masks_stay_on_their_device():
    """``EnergyTransformer.from_tensors`` takes the device of ``WK``; a graph mask's kept edges live on its device."""
    weights = [torch.empty(shape, device="meta", dtype=torch.float64) for shape in ((2, 4, 8), (2, 4, 8), (12, 8), (8,))]
    model = EnergyTransformer.from_tensors(weights[0], weights[1], weights[2], 1.3, weights[3])
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    mask = GraphMask(torch.tensor([[0, 1, 2, 2], [1, 2, 0, 2]]), 5).to("meta")
    assert mask.kept(True).device.type == "meta" and mask.kept(True).shape == (4,)


def test_tangent_gradient_and_energy_rate_against_explicit_formulas(monkeypatch):
    """``T dE/dg`` (explicit per-token projectors applied to autograd's ``dE/dg``), its RMS, and the exact
    ``dE/dt = dE/dx . dx/dt`` (autograd of the energy along the velocity), from ``x`` alone and from a velocity
    already computed; given the velocity, neither evaluates the dynamics again."""
    model = random_model(hopfield="softmax", eps=0.02)
    field = ETField(model, tau=0.6)
    x = _state(batch=2, n=4).requires_grad_(True)
    g = model.neuron(x)
    dE_dg, dE_dx = torch.autograd.grad(field.energy_g(g).sum(), (g, x))  # by autograd of the energy
    x = x.detach()
    s = g.detach() - model.neuron.delta.detach()
    s = s - s.mean(-1, keepdim=True)
    s = s / s.norm(dim=-1, keepdim=True)
    projectors = torch.eye(8, dtype=torch.float64) - 1 / 8 - s[..., :, None] * s[..., None, :]
    expected = (projectors @ dE_dg[..., None]).squeeze(-1)
    velocity = field.velocity(x)
    calls = []
    evaluate = ETField.velocity
    monkeypatch.setattr(ETField, "velocity", lambda self, x: calls.append(1) or evaluate(self, x))
    with torch.no_grad():
        given = (field.tangent_gradient(x, velocity), field.rms_tangent_gradient(x, velocity), field.dE_dt(x, velocity))
        assert calls == []
        alone = (field.tangent_gradient(x), field.rms_tangent_gradient(x), field.dE_dt(x))
    rate = (dE_dx * velocity).sum(dim=(-1, -2))
    for tangent, rms, dE_dt in (given, alone):
        torch.testing.assert_close(tangent, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(rms, expected.square().mean(dim=(-1, -2)).sqrt(), rtol=1e-10, atol=0)
        torch.testing.assert_close(dE_dt, rate, rtol=1e-10, atol=1e-14)


def test_a_state_too_large_for_float32_names_the_token():
    """A float32 state whose LayerNorm variance overflows is refused, naming the first bad token (batch, N)."""
    field = ETField(random_model(hopfield="softmax", dtype=torch.float32))
    x0 = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    x0[1, 2, 5] = 1e20
    with pytest.raises(ValueError, match=r"x0 is too large for torch.float32: the LayerNorm variance of token \(1, 2\)"):
        solve(field, x0, (0.0, 1.0))


def test_a_onednn_giving_wrong_products_is_refused_by_the_probe(monkeypatch):
    """The fused field uses oneDNN's packed GEMM only where a probe product is right: a build returning the right
    shape with wrong values (here zeros) must make the probe fail, so that the field falls back to ``matmul``."""
    from et_ode.kernels import gemm

    monkeypatch.setattr(gemm, "onednn_linear", lambda x, weight: x.new_zeros(x.shape[0], weight.shape[0]))
    assert not gemm.probe_onednn(torch.float32)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_single_infinite_or_nan_entry_is_refused(value):
    field = ETField(random_model(hopfield="softmax"))
    x0 = _state()
    x0[1, 2, 3] = value
    with pytest.raises(ValueError, match=r"x0 has 1 non-finite entries \(NaN or inf\)"):
        solve(field, x0, (0.0, 1.0))


def test_a_state_on_another_device_is_refused_by_name():
    """Checked on the ``meta`` device, which every machine has."""
    field = ETField(random_model(hopfield="softmax"))
    with pytest.raises(ValueError, match=r"x0 is on meta but the model is on cpu: move one, e.g. x0.to\('cpu'\)"):
        solve(field, torch.empty(2, 3, 8, dtype=torch.float64, device="meta"), (0.0, 1.0))


def test_the_reference_back_end_never_runs_the_fused_kernels(monkeypatch):
    """``backend="reference"`` evaluates the model's closed-form ``dE/dg`` (bit for bit), at every ``tau``."""
    from et_ode.kernels.fused import FusedGrad

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernels ran for backend='reference'")

    monkeypatch.setattr(FusedGrad, "__call__", refuse)
    model = random_model(hopfield="softmax", eps=0.02)
    x = _state()
    g = model.neuron(x)
    for tau in (1.0, 0.6):
        field = ETField(model, tau=tau, backend="reference")
        with torch.no_grad():
            torch.testing.assert_close(field(None, x), -model.dE_dg(g) / tau, rtol=0, atol=0)


@pytest.mark.parametrize("solver", [Adaptive(), Fixed("rk4", step_size=0.05)])
def test_a_stop_on_a_grid_time_ends_the_solve_there(solver):
    """Where the stop's crossing falls on a grid time (within the event search's tolerance, atol), the solve ends
    there, once: the saved times stay strictly increasing and the stop is the last of them."""
    field = ETField(random_model(hopfield="softmax", eps=1e-3), tau=0.7)
    x0, stop = _state(batch=3), SteadyState(1e-2)
    t_stop = solve(field, x0, (0.0, 100.0), solver=solver, stop=stop, save="final").stats.t_final
    for shift in (-1e-7, 4e-7):
        grid = torch.tensor([0.0, t_stop + shift, 100.0], dtype=torch.float64)
        solution = solve(field, x0, grid, solver=solver, stop=stop, save="all")
        assert solution.status is Status.STEADY_STATE and abs(solution.stats.t_final - t_stop) < 1e-6
        assert len(solution.ts) == 2 and solution.ts[-1] == solution.stats.t_final
        torch.testing.assert_close(solution.xs[-1], solution.x.detach(), rtol=0, atol=0)


def test_a_torchdiffeq_failure_reports_where_it_stopped():
    """torchdiffeq's own step cap (an option of the adaptive solver) ends the solve with a SolveError at the last
    step reached, not at ``t0``: the time, the message and the partial solution agree."""
    field = ETField(random_model(hopfield="softmax"))
    with pytest.raises(SolveError, match=r"torchdiffeq stopped after t=0\.[0-9]+: max_num_steps exceeded") as caught:
        solve(field, _state(), (0.0, 100.0), solver=Adaptive(options=dict(max_num_steps=5)))
    failed = caught.value
    assert 0 < failed.time < 100 and failed.solution.stats.t_final == failed.time
    assert f"t={failed.time:.6g}:" in str(failed)


def test_a_fixed_step_solve_without_gradients_saves_every_grid_time():
    """The lean loop (no gradients) keeps every grid state with ``save="all"`` and only the end with ``"final"``."""
    field = ETField(random_model(hopfield="softplus"), tau=0.8)
    x0, grid = _state(), torch.tensor([0.0, 0.1, 0.25, 0.3, 0.5], dtype=torch.float64)
    with torch.no_grad():
        every = solve(field, x0, grid, solver="rk4", save="all")
        final = solve(field, x0, grid, solver="rk4", save="final")
    assert every.xs.shape == (5, *x0.shape) and torch.equal(every.ts, grid)
    for k, got in enumerate(every.xs):  # bit for bit: the hand loop over the grid up to each saved time
        assert torch.equal(got, hand_rk4(field, x0, grid[: k + 1]))
    assert final.ts.tolist() == [0.5] and torch.equal(final.x, hand_rk4(field, x0, grid))


def test_saving_steps_with_a_fixed_step_stop_starts_at_t0_in_the_state_dtype():
    """torchdiffeq's fixed-step event loop reports no steps: the saved steps are then the start and the stop, with
    times in the state's dtype."""
    field = ETField(random_model(hopfield="softmax"))
    x0 = _state()
    out = solve(field, x0, (0.0, 50.0), solver=Fixed("euler", step_size=0.1), stop=SteadyState(0.05), save="steps")
    assert out.ts.dtype == torch.float64 and float(out.ts[0]) == 0.0 and torch.equal(out.xs[0], x0)
    assert float(out.ts[-1]) == pytest.approx(out.stats.t_final) and torch.equal(out.xs[-1], out.x)


def test_a_grid_that_goes_back_in_time_is_refused():
    field = ETField(random_model())
    with pytest.raises(ValueError, match="increasing"):
        solve(field, _state(), torch.tensor([0.0, 2.0, 1.0], dtype=torch.float64), solver="rk4")


def test_settings_errors_say_what_to_use():
    with pytest.raises(ValueError, match=r"use Fixed\)"):
        Adaptive("rk4")
    field = ETField(random_model())
    with pytest.raises(TypeError, match=r"stop must be an et_ode\.SteadyState or None, got str"):
        solve(field, _state(), (0.0, 1.0), stop="steady")


def test_the_default_step_budget_is_ten_thousand():
    """``max_steps`` defaults to 10,000: a paper-scheme solve of 10,001 steps is refused before any evaluation."""
    field = ETField(random_model())
    with pytest.raises(SolveError, match="10001"):
        solve(field, _state(), solver=EulerET(0.1, 10_001))
    assert field.nfe == 0


def test_a_torchdiffeq_step_cap_says_what_to_raise():
    """torchdiffeq's own step cap is a budget, not an overflow: the advice is the budget's."""
    field = ETField(random_model(hopfield="softmax"))
    with pytest.raises(SolveError, match="raise max_steps, loosen rtol/atol, or shorten the horizon"):
        solve(field, _state(), (0.0, 100.0), solver=Adaptive(options=dict(max_num_steps=5)))


@pytest.mark.parametrize("grad", [False, True])
def test_the_growth_warning_points_at_the_callers_line(grad):
    """A fixed step that multiplies the state is reported at the line that called ``solve``, lean loop or not."""
    if "MUTANT_UNDER_TEST" in os.environ:
        pytest.skip("mutmut's trampolines add frames between the caller and the library")
    field = ETField(random_model())
    with pytest.warns(RuntimeWarning, match="grew the state") as caught, torch.set_grad_enabled(grad):
        solve(field, _state(), solver=EulerET(1e4, 3))
    assert {record.filename for record in caught if "grew the state" in str(record.message)} == {__file__}


def test_the_growth_warning_reports_the_largest_step_ratio_of_max_abs_x():
    """The reported growth is the largest ratio of ``max |x|`` between consecutive states (every step's start and the
    final state), from a hand loop of the paper's update ``x <- x + alpha tau f(x)`` (here the largest entries in
    magnitude are negative)."""
    field = ETField(random_model(), tau=0.5)
    x0 = -_state().abs()
    alpha, steps = 1e4, 3
    states = [x0]
    with torch.no_grad():
        for _ in range(steps):
            states.append(states[-1] + alpha * field.tau * field(0.0, states[-1]))
    largest = [float(s.abs().max()) for s in states]
    want = max(b / a for a, b in zip(largest[:-1], largest[1:], strict=True))
    signed = [float(s.max()) for s in states]  # max x instead of max |x| would report another figure
    assert f"{want:.3g}" != f"{max(b / a for a, b in zip(signed[:-1], signed[1:], strict=True)):.3g}"
    with pytest.warns(RuntimeWarning, match=re.escape(f"grew the state {want:.3g}-fold")):
        solve(field, x0, solver=EulerET(alpha, steps))


@pytest.mark.parametrize("grad", [False, True])
def test_a_single_runaway_step_warns(grad):
    """The last step's growth counts too: one step has no second start to compare with, only the final state."""
    field = ETField(random_model(), tau=0.5)
    x0 = _state()
    with torch.no_grad():
        x1 = x0 + 1e4 * field.tau * field(0.0, x0)
    want = float(x1.abs().max()) / float(x0.abs().max())
    assert want > 1e3
    with pytest.warns(RuntimeWarning, match=re.escape(f"grew the state {want:.3g}-fold")), torch.set_grad_enabled(grad):
        solve(field, x0, solver=EulerET(1e4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        solve(field, x0, solver=EulerET(0.1, 1))  # a healthy step: no warning


def test_a_stop_saving_only_the_end_ignores_the_grids_inner_times():
    """With ``save="final"`` (or ``"steps"``) the inner times of ``t`` save nothing, so they must not cut the
    integration into segments: the result equals the solve over ``(t0, t1)`` bit for bit."""
    field = ETField(random_model(hopfield="softmax"))
    x0 = _state()
    grid = torch.tensor([0.0, 0.7, 3.0, 10.0, 100.0], dtype=torch.float64)
    for save in ("final", "steps"):
        whole = solve(field, x0, (0.0, 100.0), solver="dopri5", stop=SteadyState(1e-3), save=save)
        inner = solve(field, x0, grid, solver="dopri5", stop=SteadyState(1e-3), save=save)
        assert torch.equal(inner.x, whole.x) and torch.equal(inner.ts, whole.ts)
