"""The fused field (et_ode.kernels.fused):
equal to the model's closed form, and its closed-form backward equal to autograd."""

import copy

import pytest
import torch
from torchdiffeq import odeint_adjoint

from et_ode import ETField
from et_ode.dynamics.manifold import riemannian_hessian
from et_ode.energy.masks import GraphMask
from et_ode.kernels import gemm as gemm_module
from et_ode.kernels.fused import FusedGrad
from et_ode.kernels.gemm import choose_gemm, onednn_available
from tests.conftest import random_model

FORMS = ["relu", "softplus", "softmax"]


def _mask(kind: str, n: int, seed: int = 3) -> torch.Tensor | None:
    generator = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "shared":
        return torch.rand(n, n, generator=generator) > 0.5
    mask = torch.rand(3, n, n, generator=generator) > 0.6
    mask[1, 2] = False  # a query with no key at all contributes nothing
    mask[0, :, 4] = False  # a key nobody may attend to
    return mask


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("hopfield", FORMS)
@pytest.mark.parametrize("self_attention", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "shared", "batched"])
def test_fused_equals_reference_and_its_vjp_equals_autograd(hopfield, self_attention, mask_kind):
    model = random_model(
        dim=10,
        heads=3,
        head_dim=4,
        memories=17,
        hopfield=hopfield,
        self_attention=self_attention,
        beta=[0.4, 0.5, 0.9] if self_attention else None,
    )
    mask = _mask(mask_kind, 7)
    g = model.neuron(torch.randn(2, 3, 7, 10, dtype=torch.float64))
    fused = FusedGrad(model, gemm="matmul")
    assert fused.supports(g, mask)
    reference = model._dE_dg(g, mask)
    assert _relative(fused(g, mask), reference) < 1e-10

    point = g.detach().requires_grad_(True)
    inputs = (point, model.attention.WK, model.attention.WQ, model.hopfield.xi)
    u = torch.randn_like(g)
    expected = torch.autograd.grad(model._dE_dg(point, mask), inputs, u)
    got = torch.autograd.grad(fused(point, mask), inputs, u)
    for name, a, b in zip(("g", "WK", "WQ", "xi"), got, expected, strict=True):
        assert _relative(a, b) < 1e-10, name


def test_vjp_in_g_is_the_hessian_of_the_energy():
    """The backward w.r.t. g is Hess_g(E) u, checked against a double backward of the energy itself."""
    model = random_model(hopfield="softplus")
    mask = _mask("shared", 6)
    point = model.neuron(torch.randn(2, 6, 8, dtype=torch.float64)).detach().requires_grad_(True)
    u = torch.randn_like(point)
    (grad_e,) = torch.autograd.grad(model._energy_g(point, mask).sum(), point, create_graph=True)
    (expected,) = torch.autograd.grad(grad_e, point, u)
    (got,) = torch.autograd.grad(FusedGrad(model, gemm="matmul")(point, mask), point, u)
    assert _relative(got, expected) < 1e-10


def test_single_token_and_unbatched_input():
    model = random_model()
    fused = FusedGrad(model, gemm="matmul")
    for shape in [(1, 8), (5, 8), (2, 1, 8)]:  # one token without self-attention: only the memories act
        g = model.neuron(torch.randn(*shape, dtype=torch.float64))
        assert _relative(fused(g), model._dE_dg(g, None)) < 1e-10


def test_weights_changed_in_place_are_picked_up():
    model = random_model()
    field = ETField(model, backend="fused")
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    before = field(0.0, x)
    with torch.no_grad():  # as an optimizer step does
        model.attention.WQ.mul_(1.5)
        model.hopfield.xi.add_(0.1)
    after = field(0.0, x)
    assert _relative(after, ETField(model, backend="reference")(0.0, x)) < 1e-10
    assert _relative(after, before) > 1e-3


def test_float32_within_round_off_of_float64():
    model64 = random_model(dim=32, heads=4, head_dim=8, memories=64, hopfield="softmax")
    model32 = copy.deepcopy(model64).float()
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    mask = _mask("shared", 9)
    exact = ETField(model64, mask=mask, backend="reference")(0.0, x)
    for gemm in ("matmul", "onednn"):
        field = ETField(model32, mask=mask, backend="fused")
        field.fused.gemm = gemm
        assert _relative(field(0.0, x.float()).double(), exact) < 2e-6, gemm
    # the backward too
    xg = x.float().requires_grad_(True)
    u = torch.randn_like(x)
    got = torch.autograd.grad(ETField(model32, backend="fused")(0.0, xg), (xg, model32.hopfield.xi), u.float())
    x64 = x.clone().requires_grad_(True)
    expected = torch.autograd.grad(ETField(model64, backend="reference")(0.0, x64), (x64, model64.hopfield.xi), u)
    for a, b in zip(got, expected, strict=True):
        assert _relative(a.double(), b) < 2e-5


@pytest.mark.parametrize("gemm", ["matmul", "onednn"])
def test_the_result_written_into_out_on_either_back_end(gemm):
    """Without gradients, ``out`` receives the same bits as a new result, on ``torch.matmul`` (whose product writes
    it) and on oneDNN (copied; where this CPU refuses float32 the field runs on matmul), and the stale-weights path
    of the back-projection writes it too; ``out`` with gradients is a ValueError."""
    model = copy.deepcopy(random_model(dim=32, heads=4, head_dim=8, memories=64)).float()
    g = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(3))
    fused = FusedGrad(model, gemm=gemm)
    with torch.no_grad():
        for negate in (False, True):
            expected = fused(g, negate=negate)
            out = torch.full_like(g, float("nan"))
            assert fused(g, negate=negate, out=out) is out
            assert torch.equal(out, expected), (gemm, negate)
        weights = fused._stacked().clone()  # not the cached weights: the stale path
        coefficient = torch.randn(27, weights.shape[0])
        into = torch.empty(27, 32)
        fused._back_project(coefficient, weights, gemm, True, into)
        assert torch.equal(into, -(coefficient @ weights))
    with pytest.raises(ValueError, match="without gradients"):
        fused(g.requires_grad_(True), out=torch.empty_like(g))


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
def test_gemm_choice_is_a_valid_back_end_and_float64_uses_matmul():
    assert choose_gemm(40, 16, 64, torch.float32, torch.device("cpu"), reps=1) in ("matmul", "onednn")
    assert choose_gemm(40, 16, 64, torch.float64, torch.device("cpu")) == "matmul"


class EdgeList:
    """A mask that is not a dense tensor (stands for sparse mask types the model may accept)."""


def test_falls_back_to_the_model_for_other_masks(monkeypatch):
    model = random_model()
    g = model.neuron(torch.randn(2, 4, 8, dtype=torch.float64))
    fused = FusedGrad(model)
    assert not fused.supports(g, EdgeList())
    assert not fused.supports(g, torch.ones(4, 4))  # not boolean
    assert not fused.supports(g, torch.ones(4, 4, dtype=torch.bool).to_sparse())
    assert not fused.supports(g.float(), None)  # dtype differs from the model's
    calls = []

    def recording(g, mask):
        calls.append(mask)
        return torch.zeros_like(g)

    monkeypatch.setattr(model, "_dE_dg", recording)
    edges = EdgeList()
    out = ETField(model, backend="fused", mask=edges).dE_dg(g)
    assert calls == [edges] and bool((out == 0).all())


def test_bad_arguments():
    model = random_model()
    with pytest.raises(ValueError, match="backend"):
        ETField(model, backend="fast")
    with pytest.raises(ValueError, match="derivative='analytic'"):
        ETField(model, derivative="autograd", backend="fused")
    with pytest.raises(ValueError, match="gemm"):
        FusedGrad(model, gemm="blas")


def test_adjoint_gradients_equal_the_reference_path():
    """odeint_adjoint through the fused field gives the reference field's gradients (gamma, delta, WK, WQ, xi, x0)."""
    model = random_model(hopfield="softplus")
    mask = _mask("shared", 5)
    x0 = torch.randn(2, 5, 8, dtype=torch.float64)
    t = torch.tensor([0.0, 0.3], dtype=torch.float64)
    weights = torch.randn(2, 5, 8, dtype=torch.float64)
    results = []
    for backend in ("fused", "reference"):
        field = ETField(model, mask=mask, backend=backend)
        start = x0.clone().requires_grad_(True)
        params = tuple(field.parameters())
        xs = odeint_adjoint(field, start, t, method="rk4", options=dict(step_size=0.05), adjoint_params=params)
        loss = (model.neuron(xs[-1]) * weights).sum()
        results.append(torch.autograd.grad(loss, (start, *params)))
    names = ["x0"] + [name for name, _ in model.named_parameters()]
    assert {"neuron.gamma_raw", "neuron.delta", "attention.WK", "attention.WQ", "hopfield.xi"} <= set(names)
    for name, a, b in zip(names, *results, strict=True):
        assert _relative(a, b) < 1e-10, name


def test_riemannian_hessian_through_the_fused_backward():
    model = random_model(hopfield="softmax")
    g = model.neuron(torch.randn(2, 6, 8, dtype=torch.float64))
    w = torch.randn_like(g)
    fused, _ = riemannian_hessian(ETField(model, backend="fused"), g)
    reference, _ = riemannian_hessian(ETField(model, backend="reference"), g)
    assert _relative(fused(w), reference(w)) < 1e-10


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_low_precision_matches_float64_reference(device, dtype, tol):
    model = random_model(dim=64, heads=4, head_dim=16, memories=256)
    mask = _mask("batched", 12)
    x = torch.randn(3, 12, 64, dtype=torch.float64)
    exact = ETField(model, mask=mask, backend="reference")(0.0, x)
    model_low = copy.deepcopy(model).to(device=device, dtype=dtype)
    field = ETField(model_low, mask=mask.to(device), backend="fused")
    assert field.fused.supports(x.to(device, dtype), mask.to(device))
    assert _relative(field(0.0, x.to(device, dtype)).double().cpu(), exact) < tol
    xg = x.to(device, dtype).requires_grad_(True)
    (grad_x,) = torch.autograd.grad(field(0.0, xg).float().square().sum(), xg)
    x64 = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(ETField(model, mask=mask, backend="reference")(0.0, x64).square().sum(), x64)
    assert _relative(grad_x.double().cpu(), expected) < 10 * tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_field_falls_back_to_matmul_where_onednn_refuses_the_dtype(monkeypatch, dtype, tol):
    """An AVX2-only CPU: oneDNN refuses to pack bfloat16 weights (a RuntimeError in PyTorch). The probe must
    catch that once, and the field must then use torch.matmul and still match the float64 reference."""

    def refuse(*args, **kwargs):
        raise RuntimeError(
            "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        )

    monkeypatch.setattr(gemm_module, "_ONEDNN_PROBES", {})
    monkeypatch.setattr(gemm_module, "_GEMM_CHOICE", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    assert not gemm_module.supports_onednn(dtype, torch.device("cpu"))
    assert choose_gemm(64, 64, 576, dtype, torch.device("cpu")) == "matmul"
    model = random_model(dim=64, heads=4, head_dim=16, memories=256)
    mask = _mask("batched", 12)
    x = torch.randn(3, 12, 64, dtype=torch.float64)
    exact = ETField(model, mask=mask, backend="reference")(0.0, x)
    for gemm in ("auto", "onednn"):  # an explicit request for oneDNN falls back too
        field = ETField(copy.deepcopy(model).to(dtype), mask=mask, backend="fused")
        field.fused.gemm = gemm
        assert _relative(field(0.0, x.to(dtype)).double(), exact) < tol
        xg = x.to(dtype).requires_grad_(True)
        (grad_x,) = torch.autograd.grad(field(0.0, xg).float().square().sum(), xg)
        assert torch.isfinite(grad_x).all()


def test_backward_uses_the_weights_of_its_forward_pass():
    model = random_model()
    reference = copy.deepcopy(model)
    point = model.neuron(torch.randn(2, 5, 8, dtype=torch.float64)).detach().requires_grad_(True)
    u = torch.randn_like(point)
    out = FusedGrad(model)(point, None)
    with torch.no_grad():
        model.hopfield.xi.mul_(2.0)  # changed between the forward and the backward pass
    (got,) = torch.autograd.grad(out, point, u)
    (expected,) = torch.autograd.grad(reference._dE_dg(point, None), point, u)
    assert _relative(got, expected) < 1e-10


def test_graph_mask_falls_back_to_the_edge_list_form():
    model = random_model()
    dense = _mask("shared", 6)
    edges = GraphMask(dense.nonzero().T.flip(0).contiguous(), 6)  # columns (key B, query C)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    field = ETField(model, mask=edges)
    assert not field.fused.supports(x, edges)
    torch.testing.assert_close(
        field(0.0, x), ETField(model, mask=dense, backend="reference")(0.0, x), rtol=1e-10, atol=1e-12
    )


def test_new_weight_tensors_are_picked_up():
    """Weights swapped for new tensors (functional style) are never served from the stale cache."""
    model = random_model()
    fused = FusedGrad(model, gemm="matmul")
    g = model.neuron(torch.randn(2, 5, 8, dtype=torch.float64)).detach()
    for scale in (1.0, 2.0, 3.0):
        new = torch.nn.Parameter(model.hopfield.xi.detach() * scale)
        del model.hopfield.xi
        model.hopfield.xi = new
        assert _relative(fused(g, None), model._dE_dg(g, None)) < 1e-10
