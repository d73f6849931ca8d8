"""find_attractor: certified critical points, exact implicit gradients, saddles refused, fixed points in x."""

import copy
import math

import pytest
import torch

import et_ode
from et_ode import ETField, find_attractor
from et_ode.dynamics.manifold import radial_direction, tangent_projection
from et_ode.equilibrium.attractor import AttractorError
from tests.conftest import random_model


def rms_tangent_gradient(model, g, mask=None):
    s, _ = radial_direction(g, model.neuron.delta.detach())
    return tangent_projection(model.dE_dg(g, mask), s).square().mean(dim=(-1, -2)).sqrt().detach()


def test_certifies_a_critical_point_on_the_limit_spheres_that_the_flow_reaches():
    model = random_model(12, 2, 3, 24, hopfield="softmax", seed=0, eps=1e-12)  # eps: see the comparison below
    field = ETField(model)
    x0 = torch.randn(2, 6, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    found = find_attractor(field, x0)
    assert found.kind == ("stable", "stable") and found.geometry == ("spheres", "spheres")
    assert bool(found.certified.all())
    g = found.g.detach()
    assert found.g.requires_grad
    # an independent check of the certificate: the closed-form gradient at the returned g
    assert float(rms_tangent_gradient(model, g).max()) < 1e-8
    gamma = float(model.neuron.gamma.detach())
    radius = (g - model.neuron.delta.detach()).norm(dim=-1)
    torch.testing.assert_close(radius, torch.full_like(radius, gamma * math.sqrt(12)), rtol=1e-13, atol=0)
    # the flow ends there: it converges in g only like a power of t (the radial drift slows it), so check that
    # it closes in, and that plain Riemannian gradient descent (analysis.find_fixed_point) from where the flow
    # got after t = 1e4 lands on the same point
    from analysis.stability import find_fixed_point

    ends = et_ode.solve(
        field, x0, torch.tensor([0.0, 1e2, 1e4], dtype=torch.float64), solver=et_ode.Adaptive(rtol=1e-9, atol=1e-9)
    )
    distance = (model.neuron(ends.xs[1:]) - g).flatten(2).norm(dim=-1)
    assert bool((distance[1] < distance[0]).all()) and bool((found.energy < ends.energies[-1]).all())
    descended = find_fixed_point(field, ends.xs[-1], tol=1e-10)
    direction = torch.nn.functional.normalize(descended.x - descended.x.mean(dim=-1, keepdim=True), dim=-1)
    found_direction = torch.nn.functional.normalize(g - model.neuron.delta.detach(), dim=-1)  # radii: O(eps) apart
    assert float((direction - found_direction).abs().max()) < 1e-8


def test_an_unbatched_state_gives_the_attractor_of_a_batch_of_one():
    """``x0`` of shape ``(N, D)`` (no batch: ``*batch`` empty) finds what ``x0[None]`` finds, with per-sample entries
    of shape ``()``."""
    field = ETField(random_model(8, 2, 4, 16, hopfield="softmax", seed=1))
    x0 = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    alone, batched = find_attractor(field, x0), find_attractor(field, x0[None])
    assert alone.status == batched.status == ("certified",)
    assert alone.energy.shape == alone.gradient.shape == alone.certified.shape == ()
    torch.testing.assert_close(alone.g, batched.g[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(alone.energy, batched.energy[0], rtol=1e-14, atol=0)


def test_smallest_eigenvalue_matches_the_dense_riemannian_hessian():
    from analysis.stability import riemannian_hessian_matrix

    model = random_model(6, 2, 3, 10, hopfield="softplus", beta_hn=2.0, seed=3)
    field = ETField(model)
    x0 = torch.randn(3, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    found = find_attractor(field, x0)
    matrix, _ = riemannian_hessian_matrix(field, found.x)
    eigenvalues = torch.linalg.eigvalsh((matrix + matrix.transpose(1, 2)) / 2)
    torch.testing.assert_close(found.smallest_eigenvalue, eigenvalues[:, 0], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(found.largest_eigenvalue, eigenvalues[:, -1], rtol=1e-8, atol=1e-10)


def perturbed(model, direction, h):
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p, d in zip(out.parameters(), direction):
            p.add_(h * d)
    return out


@pytest.mark.parametrize("hopfield", ["softmax", "softplus"])
def test_implicit_gradient_equals_finite_differences_of_the_attractor_map(hopfield):
    """d/dh loss(find_attractor(theta + h u).g) by central differences, against the implicit backward, along
    random directions u of all parameters, with a per-sample mask, tau, eps, beta and beta_hn off their defaults."""
    model = random_model(8, 2, 4, 12, hopfield=hopfield, beta=0.7, beta_hn=2.0, eps=1e-3, seed=4)
    tau = 2.0
    x0 = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 4, 4, dtype=torch.bool)
    mask[0, 0, 1] = mask[0, 1, 0] = mask[1, 2, 3] = False
    weights = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def loss(m):
        found = find_attractor(ETField(m, tau=tau, mask=mask), x0, tol=1e-13)
        assert bool(found.certified.all())
        return (weights * found.g).sum() + found.g.square().sum()

    model.zero_grad()
    loss(model).backward()
    gradient = [p.grad.clone() for p in model.parameters()]
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        direction = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in model.parameters()]
        implicit = sum(float((gr * d).sum()) for gr, d in zip(gradient, direction))
        h = 1e-4
        with torch.no_grad():
            fd = (loss(perturbed(model, direction, h)) - loss(perturbed(model, direction, -h))) / (2 * h)
        assert abs(implicit - float(fd)) <= 1e-6 * abs(float(fd)), (implicit, float(fd))


def saddle_model():
    """One token, two orthogonal memories: the point between them is a critical point with one descent direction."""
    xi = torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 1.0, -1.0]], dtype=torch.float64) * 2.0
    model = et_ode.EnergyTransformer.from_tensors(
        torch.zeros(1, 2, 4, dtype=torch.float64),
        torch.zeros(1, 2, 4, dtype=torch.float64),
        xi,
        1.0,
        torch.zeros(4, dtype=torch.float64),
        hopfield="softmax",
    )
    x_saddle = (xi[0] + xi[1]).reshape(1, 1, 4)
    return model, x_saddle


def test_a_saddle_start_is_reported_as_a_saddle_and_refuses_gradients():
    model, x_saddle = saddle_model()
    found = find_attractor(ETField(model), x_saddle)
    assert found.kind == ("saddle",) and bool(found.converged.all()) and not bool(found.certified.any())
    assert float(found.smallest_eigenvalue) < 0
    with pytest.raises(AttractorError, match="sample"):
        found.g.sum().backward()


def test_newton_never_climbs_to_the_saddle_it_starts_next_to():
    model, x_saddle = saddle_model()
    field = ETField(model)
    saddle_energy = float(model.energy(x_saddle))
    nudge = torch.tensor([[[1e-6, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    for x0 in (x_saddle + nudge, x_saddle - nudge):
        found = find_attractor(field, x0, flow=False)
        assert found.kind == ("stable",) and float(found.energy) < saddle_energy - 0.1


def convex_one_token_model(hopfield="relu"):
    """One token, self-attention, WQ = -WK: E_ATT = sum_h |WK_h g|^2 is convex; small ReLU memories keep the sum
    convex near g = 0, which a centred delta with |delta| < gamma sqrt(D) puts inside the ball: there x stops."""
    generator = torch.Generator().manual_seed(0)
    wk = torch.randn(3, 4, 8, dtype=torch.float64, generator=generator) * 0.5
    xi = torch.randn(6, 8, dtype=torch.float64, generator=generator) * 0.1
    delta = torch.randn(8, dtype=torch.float64, generator=generator)
    delta = (delta - delta.mean()) / (delta - delta.mean()).norm()
    model = et_ode.EnergyTransformer.from_tensors(wk, -wk, xi, 1.0, delta, self_attention=True, hopfield=hopfield)
    return model, torch.randn(2, 1, 8, dtype=torch.float64, generator=generator)


def test_the_convex_one_token_attractor_is_a_fixed_point_in_x():
    model, x0 = convex_one_token_model()
    found = find_attractor(ETField(model), x0)
    assert found.geometry == ("x", "x") and found.kind == ("stable", "stable") and bool(found.certified.all())
    # the analytic attractor: g = 0, E = 0, dE/dg = 0, reached within the certificate's RMS gradient of 1e-8
    assert float(found.g.detach().abs().max()) < 1e-8 and float(found.gradient.max()) < 1e-8
    assert float(found.energy.abs().max()) < 1e-18
    xt = found.x - found.x.mean(dim=-1, keepdim=True)
    assert 1e-4 < float(xt.norm(dim=-1).min())  # a finite x, off the spheres
    for x in found.x:  # the flow's own Jacobian there: one zero mode (all-ones), the rest decay
        jacobian = torch.func.jacrev(lambda y: ETField(model, backend="reference")(None, y))(x).reshape(8, 8)
        rates = torch.linalg.eigvals(jacobian).real.sort().values
        assert float(rates[-2]) < -1.0 and abs(float(rates[-1])) < 1e-8


def test_implicit_gradient_at_a_fixed_point_in_x_equals_finite_differences():
    """Softmax memories: their pull moves the fixed point off g = 0, where ReLU's kinks sit (E is C^1 there only)."""
    model, x0 = convex_one_token_model("softmax")
    weights = torch.randn(2, 1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(m):
        found = find_attractor(ETField(m, tau=0.5), x0, tol=1e-12)
        assert found.geometry == ("x", "x") and bool(found.certified.all())
        return (weights * found.g).sum() + found.g.square().sum()

    model.zero_grad()
    loss(model).backward()
    gradient = [p.grad.clone() for p in model.parameters()]
    direction = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=p.dtype)
        for i, p in enumerate(model.parameters())
    ]
    implicit = sum(float((gr * d).sum()) for gr, d in zip(gradient, direction))
    h = 1e-5
    with torch.no_grad():
        fd = (loss(perturbed(model, direction, h)) - loss(perturbed(model, direction, -h))) / (2 * h)
    assert abs(float(fd)) > 1e-3
    assert abs(implicit - float(fd)) <= 1e-6 * abs(float(fd)), (implicit, float(fd))


def test_float32_default_tolerance_and_bad_arguments():
    model = random_model(8, 2, 4, 12, hopfield="softmax", seed=6, dtype=torch.float32)
    x0 = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    found = find_attractor(ETField(model), x0)
    assert found.tol == 1e-4 and bool(found.certified.all())
    assert float(rms_tangent_gradient(model.double(), found.g.detach().double()).max()) < 1e-4
    field = ETField(model)
    for kwargs, name in (
        (dict(tol=0.0), "tol"),
        (dict(method="lbfgs"), "method"),
        (dict(max_iter=0), "max_iter"),
        (dict(handoff=float("nan")), "handoff"),
    ):
        with pytest.raises(ValueError, match=name):
            find_attractor(field, x0, **kwargs)
    with pytest.raises(ValueError, match="x0"):
        find_attractor(field, x0[..., :5])


def test_a_flow_too_stiff_to_follow_stops_that_sample_uncertified_and_leaves_the_others(monkeypatch):
    """A segment that needs more than the flow phase's step budget stops the samples it cannot follow where they
    are: they are examined there and not flowed on, and never certified at a point other than the flow's own;
    the other samples of the batch get what they get alone."""
    from et_ode.equilibrium import certify

    field = ETField(random_model(8, 2, 4, 16, hopfield="softmax", seed=3))
    x0 = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    reference = find_attractor(field, x0)
    assert reference.status == ("certified",) * 3
    real_segment, calls, budget = certify._flow_segment, [], certify.FLOW_MAX_STEPS

    def stiff_first_sample(field_, x, grid, solver, stop):  # the first sample's flow "needs" more than the budget
        calls.append(x.shape[0])
        if len(calls) <= 2:  # the batch's first segment, then the first sample alone (the batch is split)
            monkeypatch.setattr(certify, "FLOW_MAX_STEPS", 1)
        try:
            return real_segment(field_, x, grid, solver, stop)
        finally:
            monkeypatch.setattr(certify, "FLOW_MAX_STEPS", budget)

    monkeypatch.setattr(certify, "_flow_segment", stiff_first_sample)
    found = find_attractor(field, x0)  # returns: no SolveError for an exhausted budget
    assert calls[:4] == [3, 1, 1, 1] and found.status[1:] == ("certified", "certified")
    torch.testing.assert_close(found.g[1:], reference.g[1:], rtol=0, atol=1e-9)
    if found.certified[0]:  # certified only where the basin test ties it to the flow: the flow's own point
        torch.testing.assert_close(found.g[0], reference.g[0], rtol=0, atol=1e-6)
    else:
        assert found.status[0] in ("unsettled", "not_converged", "saddle", "degenerate", "mixed")


@pytest.mark.parametrize("flow", [True, False])
def test_a_token_with_all_entries_equal_is_a_state_like_any_other(flow):
    """A token whose entries are all equal has no direction (``g = delta``): its placement on the limit spheres
    keeps it at 0 instead of dividing 0 by 0, and ``find_attractor`` from it answers with finite results; a
    certified answer is the flow's own (what the flow finds from the same start)."""
    from et_ode.dynamics.manifold import to_limit_spheres

    x0 = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x0[0, 1] = 0.7
    placed = to_limit_spheres(x0, 1e-5)
    assert bool(torch.isfinite(placed).all()) and float(placed[0, 1].abs().max()) == 0.0
    field = ETField(random_model(8, 2, 4, 12, seed=0))
    found = find_attractor(field, x0, flow=flow)
    assert bool(torch.isfinite(found.g).all()) and bool(torch.isfinite(found.energy).all())
    reference = find_attractor(field, x0) if not flow else found
    for i in torch.nonzero(found.certified).flatten().tolist():
        assert reference.certified[i]
        torch.testing.assert_close(found.g[i], reference.g[i], rtol=0, atol=1e-6)
