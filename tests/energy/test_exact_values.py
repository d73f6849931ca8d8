"""Values the library must return exactly, at non-default settings: constructor arguments that become numbers.

These pin down what a changed constant or a swapped branch in a constructor would alter (found by mutation
testing, ``make mutate``): each asserts a value against its definition, not against another of our code paths.
"""

import math
import platform

import pytest
import torch

from et_ode import EnergyTransformer, LayerNormNeuron
from et_ode.energy import energies
from et_ode.energy.neurons import inverse_softplus


@pytest.mark.parametrize("y", [1e-3, 0.5, 1.7, 30.0])
def test_inverse_softplus_inverts_softplus(y):
    assert math.log1p(math.exp(inverse_softplus(y))) == pytest.approx(y, rel=1e-12)


def test_neuron_stores_the_gamma_and_eps_it_is_given():
    neuron = LayerNormNeuron(5, gamma=1.7, eps=3e-3).double()
    assert float(neuron.gamma) == pytest.approx(1.7, rel=1e-6)  # gamma_raw is created in the default dtype
    assert neuron.eps == 3e-3 and neuron.dim == 5
    assert torch.equal(neuron.delta, torch.zeros(5, dtype=torch.float64))
    free = LayerNormNeuron(5, gamma=-0.4, positive_gamma=False)
    assert float(free.gamma) == pytest.approx(-0.4, rel=1e-6)
    assert LayerNormNeuron(2).dim == 2  # the smallest token size


def test_model_passes_its_settings_to_the_parts():
    model = EnergyTransformer(6, 2, 3, 5, hopfield="softmax", beta=[0.7, 1.9], beta_hn=3.0, eps=1e-2, self_attention=True)
    assert model.neuron.eps == 1e-2 and model.hopfield.beta == 3.0 and model.attention.self_attention
    assert model.attention.beta.tolist() == pytest.approx([0.7, 1.9])
    assert EnergyTransformer(6, 2, 4, 5).attention.beta.tolist() == pytest.approx([0.5, 0.5])  # 1/sqrt(Y)
    assert EnergyTransformer(6, 2, 3, 5, hopfield="softplus").hopfield.beta == 4.0


def test_a_graph_of_one_node_is_a_valid_mask():
    from et_ode.energy.masks import GraphMask

    mask = GraphMask(torch.zeros(2, 0, dtype=torch.long), 1)
    assert mask.num_nodes == 1 and mask.edge_index.shape == (2, 0)
    with pytest.raises(ValueError, match="num_nodes"):
        GraphMask(torch.zeros(2, 0, dtype=torch.long), 0)


def test_onednn_packs_float32_where_it_is_available():
    """float32 packing is what oneDNN does on every x86 CPU; a broken probe would silently fall back to matmul."""
    from et_ode.kernels import gemm

    if not (torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")):
        pytest.skip("oneDNN is not built into this PyTorch, or this is not an x86 CPU")
    assert gemm.onednn_available() and gemm.probe_onednn(torch.float32)
    weight = torch.randn(6, 8)
    x = torch.randn(4, 8)
    torch.testing.assert_close(gemm.onednn_linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_onednn_backward_of_every_weight_matches_float64():
    """The oneDNN branch of the fused backward (float32), every weight, against the float64 reference field."""
    import copy

    from et_ode import ETField
    from et_ode.kernels import gemm
    from tests.conftest import random_model

    if not gemm.supports_onednn(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN does not pack float32 here")
    model64 = random_model(dim=16, heads=2, head_dim=8, memories=24, hopfield="softmax", beta_hn=3.0)
    model32 = copy.deepcopy(model64).float()
    field = ETField(model32, backend="fused")
    field.fused.gemm = "onednn"
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    u = torch.randn_like(x)
    weights32 = (model32.attention.WK, model32.attention.WQ, model32.hopfield.xi)
    weights64 = (model64.attention.WK, model64.attention.WQ, model64.hopfield.xi)
    got = torch.autograd.grad(field(0.0, x.float()), weights32, u.float())
    want = torch.autograd.grad(ETField(model64, backend="reference")(0.0, x), weights64, u)
    for a, b in zip(got, want, strict=True):
        assert float((a.double() - b).norm() / b.norm()) < 1e-5


def test_timing_the_gemm_back_ends_leaves_the_global_random_stream_alone():
    from et_ode.kernels import gemm

    if not gemm.supports_onednn(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN does not pack float32 here")
    torch.manual_seed(0)
    state = torch.get_rng_state()
    gemm.choose_gemm(37, 11, 29, torch.float32, torch.device("cpu"), reps=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_subclassed_energies_are_not_taken_for_the_fused_closed_form():
    """A model whose attention is a subclass (another energy) must be evaluated by its own gradient."""
    from et_ode import ETField
    from et_ode.energy.energies import EnergyAttention
    from tests.conftest import random_model

    class Doubled(EnergyAttention):
        def energy(self, g, mask=None):
            return 2 * super().energy(g, mask)

        def dE_dg(self, g, mask=None):
            return 2 * super().dE_dg(g, mask)

    model = random_model()
    doubled = random_model()
    doubled.attention.__class__ = Doubled
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    want = -(2 * model.attention.dE_dg(model.neuron(x)) + model.hopfield.dE_dg(model.neuron(x)))
    torch.testing.assert_close(ETField(doubled)(0.0, x), want, rtol=1e-10, atol=1e-12)


def test_conjugate_gradients_solve_n_distinct_eigenvalues_in_n_steps():
    """CG's defining property (exact arithmetic: n steps for n distinct eigenvalues; steepest descent needs ~50 here)."""
    from et_ode.equilibrium.implicit import conjugate_gradient

    diagonal = torch.tensor([1.0, 2.0, 5.0, 10.0], dtype=torch.float64)
    b = torch.tensor([[[1.0, -2.0, 0.5, 3.0]]], dtype=torch.float64)
    w, iterations, residual = conjugate_gradient(lambda v: v * diagonal, b, tol=1e-10, max_iter=4)
    torch.testing.assert_close(w, b / diagonal, rtol=1e-12, atol=1e-14)
    assert float(residual.max()) < 1e-10
    _, iterations, _ = conjugate_gradient(lambda v: v * diagonal, b, tol=1e-10, max_iter=50)
    assert iterations == 4


def test_conjugate_gradients_return_their_best_iterate_and_its_true_residual():
    """Where the operator is symmetric positive definite only approximately (here a skew part of 1% of its largest
    eigenvalue; in float32, a Hessian-vector product's rounding), CG's residual falls and then grows: the solver
    returns each sample's iterate of smallest residual, and reports the true ``|b - A w| / |b|`` of that iterate."""
    from et_ode.equilibrium.implicit import conjugate_gradient

    generator = torch.Generator().manual_seed(0)
    n = 48
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    skew = torch.randn(n, n, dtype=torch.float64, generator=generator)
    matrix = (q * torch.logspace(0, -2, n, dtype=torch.float64)) @ q.T + 0.01 * (skew - skew.T) / n**0.5
    b = torch.randn(2, n, 1, dtype=torch.float64, generator=generator)

    def apply(v):
        return torch.einsum("ij,bjk->bik", matrix, v)

    w, iterations, residual = conjugate_gradient(apply, b, tol=1e-12, max_iter=200)
    true = (b - apply(w)).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)
    torch.testing.assert_close(residual, true, rtol=1e-12, atol=0)
    assert iterations == 200
    for sample in range(2):  # the textbook iteration, every iterate's true residual
        x, r = torch.zeros(n, 1, dtype=torch.float64), b[sample].clone()
        p, rr, history = r.clone(), float((r * r).sum()), []
        for _ in range(200):
            ap = matrix @ p
            alpha = rr / float((p * ap).sum())
            x, r = x + alpha * p, r - alpha * ap
            rr, rr_old = float((r * r).sum()), rr
            p = r + rr / rr_old * p
            history.append(float((b[sample] - matrix @ x).norm() / b[sample].norm()))
        assert float(residual[sample]) <= min(history) * (1 + 1e-9)
        assert history[-1] > 10 * float(residual[sample])  # the last iterate, returned before, is far worse

    # float32, positive definite but for one eigenvalue of -1e-5: the recurrence's residual falls below tol (7e-11:
    # a false convergence) while the true one stays near 5e-4; the report is the true one (to float32 rounding)
    lam = torch.logspace(0, -2, n, dtype=torch.float64)
    lam[-1] = -1e-5
    matrix32 = ((q * lam) @ q.T).float()
    b32 = b[:1].float()
    w, _, residual = conjugate_gradient(lambda v: torch.einsum("ij,bjk->bik", matrix32, v), b32, tol=1e-10, max_iter=300)
    true = float((b32.double() - matrix32.double() @ w.double()).norm() / b32.double().norm())
    assert true > 1e-4
    assert float(residual) == pytest.approx(true, rel=0.05)


def test_error_messages_name_the_argument():
    from et_ode import ETField
    from et_ode.energy.masks import GraphMask
    from tests.conftest import random_model

    model = random_model()
    with pytest.raises(ValueError, match=r"^g must have shape"):
        model.energy_g(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"^g must have shape"):
        model.dE_dg(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"^x has 1 non-finite entries"):
        ETField(model).dg_dt(torch.tensor([[float("nan")] + [0.0] * 7], dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^model must be an et_ode.EnergyModel \(such as an EnergyTransformer\), got int"):
        ETField(3)
    x = torch.zeros(2, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"mask=GraphMask\(edge_index, num_nodes\)$"):
        model.energy(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^mask batch shape \(3,\) does not broadcast"):
        model.energy(x, torch.ones(3, 4, 4, dtype=torch.bool))
    assert GraphMask(torch.tensor([[0], [1]]), 2).num_nodes == 2


def test_initial_weights_have_the_documented_scale():
    """WK, WQ and xi start with standard deviation 1/sqrt(D) (the init_std default)."""
    torch.manual_seed(0)
    model = EnergyTransformer(64, 4, 16, 256)
    for weight in (model.attention.WK, model.attention.WQ, model.hopfield.xi):
        assert float(weight.std()) == pytest.approx(1 / 8, rel=0.05)


def test_zero_inverse_temperatures_are_refused():
    with pytest.raises(ValueError, match="beta_hn"):
        EnergyTransformer(6, 2, 3, 5, hopfield="softmax", beta_hn=0.0)
    with pytest.raises(ValueError, match="beta"):
        EnergyTransformer(6, 2, 3, 5, beta=0.0)


# the SPEC's definitions of energy attention, written out: beta per head (H,), the attention's weights, g (..., N, D)
BETA = torch.tensor([0.7, 1.9], dtype=torch.float64)


def _logits_by_definition(attention, g, allowed):
    """``beta_h K_B . Q_C`` ``(..., H, B, C)``, -inf where ``allowed`` ``(..., B, C)`` is False."""
    keys = torch.einsum("hyd,...bd->...hby", attention.WK, g)
    queries = torch.einsum("hyd,...cd->...hcy", attention.WQ, g)
    logits = BETA[:, None, None] * keys @ queries.transpose(-1, -2)
    return logits.masked_fill(~allowed.unsqueeze(-3), -torch.inf)


def _attention_by_definition(attention, g):
    """Without a mask: the weights ``(..., H, B, C)``, the energy ``(...)`` and, by autograd, ``dE/dg``."""
    g = g.detach().requires_grad_()
    logits = _logits_by_definition(attention, g, ~torch.eye(g.shape[-2], dtype=torch.bool))
    energy = -(torch.logsumexp(logits, dim=-2) / BETA[:, None]).sum(dim=(-1, -2))
    (grad,) = torch.autograd.grad(energy.sum(), g)
    return torch.softmax(logits, dim=-2).detach(), energy.detach(), grad


def test_attention_weights_are_the_softmax_over_allowed_keys():
    """``attention(g)[h, B, C]`` = softmax over keys B of beta_h K_B . Q_C, masked pairs 0, from the SPEC."""
    from tests.conftest import random_model

    model = random_model(6, 2, 3, 5, beta=BETA.tolist())
    g = torch.randn(2, 4, 6, dtype=torch.float64)
    mask = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(0)) > 0.3
    allowed = mask.transpose(-1, -2) & ~torch.eye(4, dtype=torch.bool)
    weights = torch.softmax(_logits_by_definition(model.attention, g, allowed), dim=-2).nan_to_num(0.0)
    torch.testing.assert_close(model.attention.attention(g, mask), weights, rtol=1e-12, atol=1e-14)


def _spied_diagonal(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes the attention's additive diagonal constant is built for, from here on (built without a mask)."""
    built: list[int] = []
    original = energies._without_diagonal

    def spy(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        built.append(n)
        return original(n, dtype, device)

    monkeypatch.setattr(energies, "_without_diagonal", spy)
    return built


def test_compiled_attention_leaves_each_token_out_of_its_own_keys(monkeypatch: pytest.MonkeyPatch):
    """Under ``torch.compile`` (dynamo; its eager back end needs no C++ compiler) the logits take the diagonal from an
    additive constant: the weights, the energy and ``dE/dg`` follow the SPEC's definition."""
    from tests.conftest import random_model

    attention = random_model(6, 2, 3, 5, beta=BETA.tolist()).attention
    g = torch.randn(2, 4, 6, dtype=torch.float64)
    expected = _attention_by_definition(attention, g)
    built = _spied_diagonal(monkeypatch)
    with torch.no_grad():
        for method, value in zip((attention.attention, attention.energy, attention.dE_dg), expected, strict=True):
            compiled = torch.compile(method, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(g), value, rtol=1e-12, atol=1e-13)
    assert built and set(built) == {4}  # (the constant's branch ran)


def test_compiled_attention_compiles_once_for_every_state_of_a_shape():
    """A second and third call with new states of the same shape reuse the first compilation: nothing the attention
    does while compiled changes what dynamo's guards check (a cache filled on the first call would)."""
    from tests.conftest import counted_backend, random_model

    attention = random_model(6, 2, 3, 5, beta=BETA.tolist()).attention
    counted, graphs = counted_backend()
    compiled = torch.compile(attention.dE_dg, backend=counted, fullgraph=True)
    g = torch.randn(2, 4, 6, dtype=torch.float64)
    for state in (g, g + 0.5, g - 1.0):
        with torch.no_grad():
            gradient = compiled(state)
        torch.testing.assert_close(gradient, _attention_by_definition(attention, state)[2], rtol=1e-12, atol=1e-13)
    assert len(graphs) == 1


def test_a_torch_func_transform_inside_compiled_code_gives_dE_dg(monkeypatch: pytest.MonkeyPatch):
    """``torch.func.grad`` of the energy inside ``torch.compile`` (dynamo and AOT autograd, no C++ compiler) gives
    ``dE/dg``, with the diagonal's constant built inside the transform."""
    from tests.conftest import random_model

    attention = random_model(6, 2, 3, 5, beta=BETA.tolist()).attention
    g = torch.randn(2, 4, 6, dtype=torch.float64)
    built = _spied_diagonal(monkeypatch)
    gradient = torch.compile(torch.func.grad(lambda g: attention.energy(g).sum()), backend="aot_eager", fullgraph=True)
    for state in (g, g + 0.5):
        torch.testing.assert_close(gradient(state), _attention_by_definition(attention, state)[2], rtol=1e-12, atol=1e-13)
    assert built and set(built) == {4}  # (the constant's branch ran, inside the transform)
