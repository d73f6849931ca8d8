"""Every gradient path against an independent reference, in float64, at non-default settings.

The reference for a gradient is the central finite difference of the whole forward pipeline (a solve, a
steady-state stop, an attractor, the image and graph models) along a random direction per parameter group,
evaluated with ``backend="reference"``; the gradient under test comes from the library's backward passes
(direct, adjoint, implicit) on either field back end. The reference for a value is the SPEC's energy written
out again in ``tests/fd_reference.py`` and differentiated by autograd. Settings differ from every default
(a per-head ``beta``, ``beta_hn``, ``eps``, ``gamma``, ``tau``, a random mask) so that a dropped or wrong
constant in the forward or the backward pass changes the numbers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from et_ode import Adaptive, ETField, EulerET, Fixed, Implicit, Integration, SteadyState, find_attractor, solve
from tests.conftest import random_model
from tests.fd_reference import (
    directional_derivative,
    relative_error,
    richardson,
    spec_rk4,
    spec_velocity,
)

FORMS = ("relu", "softplus", "softmax")
BETA_HN = {"relu": None, "softplus": 2.5, "softmax": 3.0}
TAU = 0.6
BLOCK = ("attention.WK", "attention.WQ", "hopfield.xi", "neuron.gamma_raw", "neuron.delta")


def make_model(form: str, *, seed: int = 3, eps: float = 1e-2, **kwargs: object) -> torch.nn.Module:
    """D=6, H=2, Y=3, K=5 at a per-head beta, a non-default beta_hn, eps and gamma (~1.7)."""
    model = random_model(6, 2, 3, 5, hopfield=form, beta=[0.7, 1.9], beta_hn=BETA_HN[form], eps=eps, seed=seed, **kwargs)
    with torch.no_grad():
        model.neuron.gamma_raw.fill_(1.5)
    return model


def problem(seed: int = 0, batch: int = 2, tokens: int = 3, dim: int = 6):
    generator = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, tokens, dim, dtype=torch.float64, generator=generator)
    target = torch.randn(batch, tokens, dim, dtype=torch.float64, generator=generator)
    mask = torch.rand(batch, tokens, tokens, generator=generator) > 0.3
    return x0, target, mask


def weighted_loss(g: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    weight = torch.linspace(0.5, 1.5, g.shape[-1], dtype=g.dtype)
    return ((g - target).square() * weight).sum()


def directions(tensors: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, dtype=t.dtype, generator=generator) for name, t in tensors.items()}


def analytic(grads: dict[str, torch.Tensor | None], direction: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: 0.0 if grads[name] is None else float((grads[name] * d).sum()) for name, d in direction.items()}


def finite_differences(
    loss, tensors: dict[str, torch.Tensor], direction: dict[str, torch.Tensor], h: float = 1e-4
) -> dict[str, float]:
    """Richardson-extrapolated central differences (error O(h^4)) of ``loss`` along ``direction``, per group."""
    return {name: richardson(loss, tensors[name], direction[name], h)[0] for name in tensors}


def assert_close_per_group(got: dict[str, float], want: dict[str, float], tol: float, what: str) -> None:
    scale = 1e-6 * max(abs(v) for v in want.values())
    errors = {name: relative_error(got[name], want[name], scale) for name in want}
    bad = {
        name: f"{errors[name]:.2e} (got {got[name]:.10g}, finite differences {want[name]:.10g})"
        for name in want
        if not errors[name] < tol
    }
    assert not bad, f"{what}: relative error above {tol:g} for {bad}"


class Pipeline:
    """``loss(solve(field, x0).g)`` for one model, problem and solver; the gradient by any mode and back end."""

    def __init__(self, model, x0, target, mask, **solve_options):
        self.model, self.x0, self.target, self.mask = model, x0.clone().requires_grad_(True), target, mask
        self.options = solve_options
        self.tensors = {**dict(model.named_parameters()), "x0": self.x0}

    def loss(self, backend: str = "reference", **overrides) -> torch.Tensor:
        field = ETField(self.model, tau=TAU, backend=backend, mask=self.mask)
        solution = solve(field, self.x0, save="final", **{**self.options, **overrides})
        return weighted_loss(solution.g, self.target)

    def gradient(self, backend: str, **overrides) -> dict[str, torch.Tensor | None]:
        for tensor in self.tensors.values():
            tensor.grad = None
        self.loss(backend, **overrides).backward()
        return {name: tensor.grad for name, tensor in self.tensors.items()}


# ------------------------------------------------------------------------------------------- field level
def test_field_matches_the_spec_at_non_default_settings():
    """Both back ends against the SPEC's energy, differentiated by autograd, for every form, with a mask."""
    x, _, mask = problem(seed=4)
    for form in FORMS:
        for self_attention in (False, True):
            model = make_model(form, self_attention=self_attention)
            reference = spec_velocity(model, x, tau=TAU, mask=mask)
            for backend in ("reference", "fused"):
                got = ETField(model, tau=TAU, backend=backend, mask=mask)(torch.zeros(()), x)
                torch.testing.assert_close(
                    got, reference, rtol=1e-10, atol=1e-12, msg=lambda m, f=form, b=backend: f"{f} {b}: {m}"
                )


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    form=st.sampled_from(FORMS),
    eps=st.floats(1e-6, 0.3),
    beta=st.lists(st.floats(0.2, 4.0), min_size=2, max_size=2),
    beta_hn=st.floats(0.3, 12.0),
    gamma_raw=st.floats(-1.0, 2.0),
    tau=st.floats(0.1, 5.0),
    self_attention=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_field_and_its_backward_match_the_spec(form, eps, beta, beta_hn, gamma_raw, tau, self_attention, masked, seed):
    """Random settings: the velocity and its vector-Jacobian product with respect to the state and every
    parameter, for both back ends, against autograd of the SPEC's energy (a second derivative)."""
    torch.manual_seed(seed)
    model = random_model(
        6, 2, 3, 5, hopfield=form, beta=beta, beta_hn=beta_hn, eps=eps, self_attention=self_attention, seed=seed
    )
    with torch.no_grad():
        model.neuron.gamma_raw.fill_(gamma_raw)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 4, 4) > 0.4 if masked else None
    cotangent = torch.randn(2, 4, 6, dtype=torch.float64)
    inputs = [x, *model.parameters()]
    reference = spec_velocity(model, x, tau=tau, mask=mask, create_graph=True)
    want = torch.autograd.grad((reference * cotangent).sum(), inputs)
    for backend in ("reference", "fused"):
        velocity = ETField(model, tau=tau, backend=backend, mask=mask)(torch.zeros(()), x)
        torch.testing.assert_close(velocity, reference.detach(), rtol=1e-9, atol=1e-11)
        got = torch.autograd.grad((velocity * cotangent).sum(), inputs)
        for name, a, b in zip(["x", *dict(model.named_parameters())], got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=lambda m, n=name, k=backend: f"{k} {n}: {m}")


def test_solve_follows_the_spec_dynamics_at_two_time_constants():
    """The solved state against an independent RK4 integration of ``-(1/tau) dE/dg``; tau changes the answer."""
    x0, _, mask = problem(seed=5)
    model = make_model("softmax")
    finals = []
    for tau in (0.5, 2.0):
        with torch.no_grad():  # RK4 at 100 and 200 steps, Richardson-extrapolated (error ~1e-9 here)
            coarse, fine = (spec_rk4(model, x0, tau=tau, t1=1.0, steps=n, mask=mask) for n in (100, 200))
        reference = (16 * fine - coarse) / 15
        for backend in ("reference", "fused"):
            solution = solve(
                ETField(model, tau=tau, backend=backend, mask=mask),
                x0,
                (0.0, 1.0),
                solver=Adaptive(rtol=1e-11, atol=1e-12),
                save="final",
            )
            torch.testing.assert_close(solution.x.detach(), reference, rtol=1e-7, atol=1e-8)
        finals.append(reference)
    assert float((finals[0] - finals[1]).abs().max()) > 1e-2


# ------------------------------------------------------------------------------------------- fixed horizon
def flow_reference(pipeline: Pipeline, direction: dict[str, torch.Tensor], smooth: bool) -> dict[str, float]:
    """Derivatives of the exact flow: finite differences of RK4 solves at steps 0.02 and 0.01, extrapolated in
    the step (error O(step^5)); ReLU's kinks break that expansion, so there the 0.01 solve alone."""
    fine = finite_differences(lambda: pipeline.loss(solver=Fixed("rk4", step_size=0.01)), pipeline.tensors, direction)
    if not smooth:
        return fine
    coarse = finite_differences(lambda: pipeline.loss(solver=Fixed("rk4", step_size=0.02)), pipeline.tensors, direction)
    return {name: (16 * fine[name] - coarse[name]) / 15 for name in direction}


def check_fixed_horizon(form: str, combinations: tuple[tuple[str, str], ...]) -> None:
    x0, target, mask = problem()
    model = make_model(form)
    pipeline = Pipeline(model, x0, target, mask, t=(0.0, 1.0), solver=Fixed("rk4", step_size=0.05))
    direction = directions(pipeline.tensors)
    discrete = finite_differences(pipeline.loss, pipeline.tensors, direction)
    for backend in ("reference", "fused"):
        got = analytic(pipeline.gradient(backend), direction)
        assert_close_per_group(got, discrete, 1e-7, f"{form} rk4 direct {backend}")

    flow = flow_reference(pipeline, direction, smooth=form != "relu")
    tol, rtol = (5e-3, 1e-8) if form == "relu" else (1e-6, 1e-10)
    adaptive = Adaptive(rtol=rtol, atol=rtol / 100)
    for backend, grad in combinations:
        got = analytic(pipeline.gradient(backend, gradient=grad, solver=adaptive), direction)
        assert_close_per_group(got, flow, tol, f"{form} dopri5 {grad} {backend}")


@pytest.mark.parametrize("form", FORMS)
def test_fixed_horizon_gradients_match_finite_differences(form):
    """Direct mode through a fixed-step solve is the exact gradient of that discrete map (to 1e-7 relative, both
    back ends); direct and adjoint through dopri5 are the gradient of the flow (1e-6 relative at rtol 1e-10 for
    smooth energies; 5e-3 at rtol 1e-8 for ReLU, whose kinks spoil adaptive step control and RK4's order)."""
    combinations = (("fused", "direct"), ("fused", "adjoint"))
    if form != "relu":
        combinations += (("reference", "adjoint"),)
    check_fixed_horizon(form, combinations)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_fixed_horizon_gradients_every_combination(form):
    check_fixed_horizon(form, tuple((b, g) for b in ("reference", "fused") for g in ("direct", "adjoint")))


def test_central_differences_are_converged():
    """The reference itself: Richardson extrapolation changes the central difference by less than 1e-8."""
    x0, target, mask = problem()
    pipeline = Pipeline(make_model("softplus"), x0, target, mask, t=(0.0, 1.0), solver=Fixed("rk4", step_size=0.05))
    direction = directions(pipeline.tensors)
    for name in ("attention.WQ", "neuron.gamma_raw", "x0"):
        extrapolated, spread = richardson(pipeline.loss, pipeline.tensors[name], direction[name], 1e-4)
        plain = directional_derivative(pipeline.loss, pipeline.tensors[name], direction[name], 1e-6)
        assert spread < 1e-6 * abs(extrapolated)
        assert abs(plain - extrapolated) < 1e-8 * abs(extrapolated)


# ------------------------------------------------------------------------------------------- steady-state stop
def steady_pipeline(form: str) -> Pipeline:
    """Stopped where the RMS |dg/dt| falls below 3e-2 (t ~ 7), dopri5 at rtol 1e-10; the event time is bisected to
    atol, so its finite differences hold to ~1e-8."""
    x0, target, mask = problem()
    return Pipeline(
        make_model(form), x0, target, mask, t=(0.0, 100.0), solver=Adaptive(rtol=1e-10, atol=1e-12), stop=SteadyState(3e-2)
    )


@pytest.mark.parametrize(
    "grad, backend", [("direct", "fused"), ("adjoint", "fused"), pytest.param("direct", "reference", marks=pytest.mark.slow)]
)
def test_steady_state_stop_gradient_of_the_initial_state(grad, backend):
    pipeline = steady_pipeline("softmax")
    direction = directions(pipeline.tensors)
    want = {"x0": richardson(pipeline.loss, pipeline.x0, direction["x0"], 1e-4)[0]}
    got = analytic(pipeline.gradient(backend, gradient=grad), {"x0": direction["x0"]})
    assert_close_per_group(got, want, 1e-6, f"steady state {grad} {backend}")


def check_steady_state_parameters(form: str, grad: str) -> None:
    pipeline = steady_pipeline(form)
    tensors = {name: pipeline.tensors[name] for name in BLOCK}
    direction = directions(tensors)
    want = finite_differences(pipeline.loss, tensors, direction)
    got = analytic(pipeline.gradient("fused", gradient=grad), direction)
    assert_close_per_group(got, want, 1e-6, f"{form} steady state {grad}")


def test_steady_state_stop_gradient_of_the_parameters():
    check_steady_state_parameters("softmax", "direct")


@pytest.mark.slow
@pytest.mark.parametrize(
    "form",
    [
        pytest.param(
            "relu",
            marks=pytest.mark.xfail(
                strict=False,
                reason=(
                    "ReLU's kinks make an adaptive stopped solve only piecewise smooth in the parameters: 1e-3, not 1e-6 "
                    "(tests/solving/test_steady_state_gradients.py holds ReLU to 1e-3)"
                ),
            ),
        ),
        "softplus",
        "softmax",
    ],
)
@pytest.mark.parametrize("grad", ["direct", "adjoint"])
def test_steady_state_stop_gradient_of_the_parameters_every_form(form, grad):
    check_steady_state_parameters(form, grad)


# ------------------------------------------------------------------------------------------- at the attractor
def attractor_setting(form: str):
    """A masked 3-token model (eps 1e-3), its attractor certified to RMS |T dE/dg| < 1e-12 from the end of a solve,
    and the attractor map theta -> g*(theta) from that point (``find_attractor`` without the flow)."""
    x0, target, mask = problem()
    model = make_model(form, eps=1e-3)
    field = ETField(model, tau=TAU, backend="reference", mask=mask)
    with torch.no_grad():
        start = solve(field, x0, (0.0, 30.0), solver=Adaptive(rtol=1e-6, atol=1e-8), save="final").x
    found = find_attractor(field, start, tol=1e-12)
    assert bool(found.certified.all())
    x_star = found.x

    def attractor_loss() -> torch.Tensor:
        point = find_attractor(ETField(model, tau=TAU, backend="reference", mask=mask), x_star, tol=1e-12, flow=False)
        return weighted_loss(point.g, target)

    return model, mask, target, x_star, attractor_loss


def check_implicit_at_attractor(form: str) -> None:
    model, mask, target, x_star, attractor_loss = attractor_setting(form)
    tensors = dict(model.named_parameters())
    direction = directions(tensors)
    with torch.no_grad():
        want = finite_differences(attractor_loss, tensors, direction, h=1e-5)
    for backend in ("reference", "fused"):
        model.zero_grad()
        found = find_attractor(
            ETField(model, tau=TAU, backend=backend, mask=mask), x_star, tol=1e-12, flow=False, implicit=Implicit(tol=1e-12)
        )
        weighted_loss(found.g, target).backward()
        got = analytic({name: t.grad for name, t in tensors.items()}, direction)
        assert_close_per_group(got, want, 1e-6, f"{form} implicit {backend}")


def test_implicit_gradient_matches_finite_differences_of_the_attractor_map():
    """The implicit function theorem (CG on the Riemannian Hessian) at a certified attractor, every parameter
    group, both back ends, against central differences of the attractor map (measured: 5e-8 relative)."""
    check_implicit_at_attractor("softmax")


@pytest.mark.slow
@pytest.mark.parametrize("form", ["softplus", "relu"])
def test_implicit_gradient_matches_the_attractor_map_every_form(form):
    check_implicit_at_attractor(form)


@pytest.mark.slow
def test_solve_implicit_matches_finite_differences_of_the_stopped_and_polished_solve():
    """``solve(..., stop=SteadyState, gradient=Implicit())`` differentiates the map the user runs: stop the flow,
    polish the end state into a certified attractor (:func:`et_ode.find_attractor`, on the eps -> 0 limit spheres),
    read ``g`` there. Against central differences of that same pipeline (run without gradients), every parameter
    group: measured 6.7e-6 relative at worst (delta), 5e-7 to 2e-8 elsewhere. (The attractor map of
    ``find_fixed_point``, which keeps the state's own radius, differs from it by O(eps): 0.4% here at eps = 1e-3.)"""
    model, mask, target, _, _ = attractor_setting("softmax")
    x0, _, _ = problem()
    pipeline = Pipeline(
        model, x0, target, mask, t=(0.0, 1e6), solver=Adaptive(rtol=1e-10, atol=1e-12), stop=SteadyState(1e-6)
    )
    tensors = {name: pipeline.tensors[name] for name in BLOCK}
    direction = directions(tensors)

    def stopped_and_polished() -> torch.Tensor:
        with torch.no_grad():
            return pipeline.loss("fused", gradient=Implicit(tol=1e-12))

    want = finite_differences(stopped_and_polished, tensors, direction, h=1e-4)
    got = analytic(pipeline.gradient("fused", gradient=Implicit(tol=1e-12)), direction)
    assert_close_per_group(got, want, 1e-5, "solve(gradient=Implicit())")


# ------------------------------------------------------------------------------------------- image and graph models
INTEGRATIONS = {
    "et-direct": Integration(solver=EulerET(0.1, 6), gradient="direct"),
    "dopri5-adjoint": Integration(solver=Adaptive(rtol=1e-10, atol=1e-12), gradient="adjoint", t1=0.6),
}


def tiny_image_model(integration):
    from et_ode.models.image import ImageET

    torch.manual_seed(0)
    model = ImageET(
        (1, 4, 4), 2, 6, 2, 3, memories=5, cls_token=True, hopfield="softmax", tau=TAU, dynamics=integration
    ).double()
    block = model.block
    with torch.no_grad():  # non-default block settings, as in make_model
        block.attention.beta.copy_(torch.tensor([0.7, 1.9]))
        block.hopfield.beta = 3.0
        block.neuron.eps = 1e-2
        block.neuron.gamma_raw.fill_(1.5)
        block.neuron.delta.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("mode", ["et-direct", pytest.param("dopri5-adjoint", marks=pytest.mark.slow)])
def test_image_model_gradients_match_finite_differences(mode):
    """Every parameter of ImageET (encoder, decoder, positions, MASK and CLS tokens, the block) through the
    masked-patch loss, direct through the paper's Euler scheme and adjoint through dopri5."""
    from et_ode.models.image import masked_mse, patchify

    model = tiny_image_model(INTEGRATIONS[mode])
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(2, 1, 4, 4, dtype=torch.float64, generator=generator)
    hidden = torch.tensor([[True, False, True, False], [False, True, True, False]])
    scored = hidden | torch.tensor([[False, True, False, False], [False, False, False, True]])

    def loss() -> torch.Tensor:
        return masked_mse(model(images, hidden).patches, patchify(images, 2), scored)

    tensors = dict(model.named_parameters())
    direction = directions(tensors)
    model.zero_grad()
    loss().backward()
    got = analytic({name: t.grad for name, t in tensors.items()}, direction)
    want = finite_differences(loss, tensors, direction)  # dopri5 at rtol 1e-10 is smooth in theta to ~1e-9
    assert_close_per_group(got, want, 1e-7 if mode == "et-direct" else 1e-5, f"ImageET {mode}")


@pytest.mark.parametrize("mode", ["et-direct", pytest.param("dopri5-adjoint", marks=pytest.mark.slow)])
def test_graph_model_gradients_match_finite_differences(mode):
    """Every parameter of GraphET (node and eigenvector encoders, CLS token, block, read-out) through the
    cross-entropy of two graphs batched as one, attention on the edge list (the sparse GraphMask path)."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.data import Batch, Data

    from et_ode.data.graphs import add_laplacian_pe
    from et_ode.models.graph import GraphET

    graphs = []
    for seed, n in enumerate((4, 5)):
        generator = torch.Generator().manual_seed(seed)
        chain = torch.stack([torch.arange(n - 1), torch.arange(1, n)])
        edges = torch.cat([chain, chain.flip(0), torch.tensor([[0], [n - 1]])], dim=1)
        graphs.append(add_laplacian_pe(Data(x=torch.randn(n, 3, generator=generator), edge_index=edges), 2))
    batch = Batch.from_data_list(graphs)
    labels = torch.tensor([0, 1])
    torch.manual_seed(0)
    model = (
        GraphET(
            3,
            2,
            dim=6,
            heads=2,
            head_dim=3,
            memories=5,
            pe_dim=2,
            hopfield="softplus",
            tau=TAU,
            head_hidden=4,
            dynamics=INTEGRATIONS[mode],
        )
        .double()
        .eval()
    )
    with torch.no_grad():
        model.et.attention.beta.copy_(torch.tensor([0.7, 1.9]))
        model.et.hopfield.beta = 2.5
        model.et.neuron.eps = 1e-2
        model.et.neuron.gamma_raw.fill_(1.5)
        model.et.neuron.delta.normal_(0.0, 0.3)
        model.cls.normal_(0.0, 0.5)

    def loss() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch), labels)

    tensors = dict(model.named_parameters())
    direction = directions(tensors)
    model.zero_grad()
    loss().backward()
    got = analytic({name: t.grad for name, t in tensors.items()}, direction)
    want = finite_differences(loss, tensors, direction)
    assert_close_per_group(got, want, 1e-7 if mode == "et-direct" else 1e-5, f"GraphET {mode}")
