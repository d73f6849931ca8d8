"""The per-head products of the fused field on oneDNN's matmul: float32-accurate wherever they are used, refused where
they round more than float32, and the global precision setting always restored."""

import contextlib
import copy

import pytest
import torch

from et_ode import ETField
from et_ode.kernels import fused as fused_module
from et_ode.kernels import gemm as gemm_module
from et_ode.kernels.gemm import choose_head_products, onednn_matmul_available
from tests.conftest import random_model

CPU = torch.device("cpu")


@pytest.fixture
def fresh_choices(monkeypatch):
    """Forget the choices other tests made, so that each test probes anew."""
    monkeypatch.setattr(gemm_module, "_HEAD_ACCURATE", {})
    monkeypatch.setattr(gemm_module, "_HEAD_CHOICE", {})


def _model64(**kwargs):
    return random_model(dim=24, heads=3, head_dim=8, memories=40, beta=[0.2, 0.35, 0.6], **kwargs)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


def _check_against_float64(model64, gemm: str, mask=None, tol: float = 2e-6) -> None:
    """The float32 fused field and its VJP (state and every weight) against the float64 closed form and autograd."""
    model32 = copy.deepcopy(model64).float()
    x = torch.randn(5, 11, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    u = torch.randn_like(x)
    field32 = ETField(model32, mask=mask, tau=0.7, backend="fused")
    field32.fused.gemm = gemm
    field64 = ETField(model64, mask=mask, tau=0.7, backend="reference")
    assert _relative(field32(0.0, x.float()), field64(0.0, x)) < tol
    x32 = x.float().requires_grad_(True)
    x64 = x.clone().requires_grad_(True)
    weights32 = (x32, model32.attention.WK, model32.attention.WQ, model32.hopfield.xi)
    weights64 = (x64, model64.attention.WK, model64.attention.WQ, model64.hopfield.xi)
    got = torch.autograd.grad(field32(0.0, x32), weights32, u.float())
    want = torch.autograd.grad(field64(0.0, x64), weights64, u)
    for name, a, b in zip(("x", "WK", "WQ", "xi"), got, want, strict=True):
        assert _relative(a, b) < 20 * tol, name


@pytest.mark.skipif(not onednn_matmul_available(), reason="this PyTorch cannot send products to oneDNN's matmul")
@pytest.mark.parametrize("self_attention,masked", [(False, False), (True, True)])
def test_head_products_on_onednn_match_float64(fresh_choices, monkeypatch, self_attention, masked):
    if choose_head_products(5 * 3, 11, 8, torch.float32, CPU, timed=False) != "onednn":
        pytest.skip("oneDNN's matmul is not within float32 rounding on this CPU (the field keeps MKL's)")
    real, entered = gemm_module.onednn_matmul, []

    def counted():
        entered.append(True)
        return real()

    monkeypatch.setattr(gemm_module, "onednn_matmul", counted)
    mask = torch.rand(11, 11, generator=torch.Generator().manual_seed(1)) > 0.4 if masked else None
    _check_against_float64(_model64(self_attention=self_attention), "onednn", mask)
    assert len(entered) == 6  # forward and backward of the float32 field: two blocks each, called three times


def test_products_rounded_to_bfloat16_are_refused(fresh_choices, monkeypatch):
    """A CPU on which the permission makes oneDNN round to bfloat16 (AMX) must keep MKL's products: planted here by
    rounding the operands inside the permission's block."""
    inside, entered = [], []

    @contextlib.contextmanager
    def permission():
        inside.append(True)
        entered.append(True)
        try:
            yield
        finally:
            inside.pop()

    exact_products = gemm_module._head_products

    def rounding_products(keys, queries, attn):
        if inside:
            keys, queries, attn = (t.bfloat16().float() for t in (keys, queries, attn))
        return exact_products(keys, queries, attn)

    monkeypatch.setattr(gemm_module, "onednn_matmul_available", lambda: True)
    monkeypatch.setattr(gemm_module, "onednn_matmul", permission)
    monkeypatch.setattr(gemm_module, "_head_products", rounding_products)
    for timed in (False, True):
        assert choose_head_products(15, 11, 8, torch.float32, CPU, timed=timed) == "matmul"
    entered.clear()
    _check_against_float64(_model64(), "onednn")  # an explicit request for oneDNN falls back too
    assert not entered


def test_float32_rounding_bound_separates_float32_from_bfloat16_products():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 30, 16, generator=generator), torch.randn(6, 16, 30, generator=generator)
    assert gemm_module._within_float_rounding((a @ b,), ((a, b),))
    rounded = a.bfloat16().float() @ b.bfloat16().float()
    assert not gemm_module._within_float_rounding((rounded,), ((a, b),))
    # an error of 1e-3 of the largest entry is far beyond float32 summation of 16 terms
    assert not gemm_module._within_float_rounding((a @ b + 1e-3 * (a @ b).abs().amax(),), ((a, b),))


@pytest.mark.parametrize("gemm", ["auto", "onednn"])
def test_fallback_where_onednn_matmul_is_missing(fresh_choices, monkeypatch, gemm):
    monkeypatch.setattr(gemm_module, "onednn_matmul_available", lambda: False)
    assert choose_head_products(15, 11, 8, torch.float32, CPU) == "matmul"
    _check_against_float64(_model64(), gemm)


def test_float64_never_leaves_matmul_and_stays_bitwise(fresh_choices):
    assert choose_head_products(15, 11, 8, torch.float64, CPU) == "matmul"
    model = _model64(hopfield="softmax")
    x = torch.randn(5, 11, 24, dtype=torch.float64)
    fields = {gemm: ETField(model, backend="fused") for gemm in ("matmul", "onednn", "auto")}
    for gemm, field in fields.items():
        field.fused.gemm = gemm
    values = {gemm: field(0.0, x) for gemm, field in fields.items()}
    assert torch.equal(values["onednn"], values["matmul"]) and torch.equal(values["auto"], values["matmul"])


@pytest.mark.skipif(not onednn_matmul_available(), reason="this PyTorch cannot send products to oneDNN's matmul")
def test_precision_setting_restored_and_random_stream_untouched(fresh_choices):
    setting = torch.backends.mkldnn.matmul.fp32_precision
    torch.manual_seed(0)
    state = torch.get_rng_state()
    choose_head_products(15, 11, 8, torch.float32, CPU, reps=1)
    assert torch.equal(torch.get_rng_state(), state)
    field = ETField(copy.deepcopy(_model64()).float(), backend="fused")
    field.fused.gemm = "onednn"
    x = torch.randn(5, 11, 24, requires_grad=True)
    field(0.0, x).square().sum().backward()
    assert torch.backends.mkldnn.matmul.fp32_precision == setting
    with pytest.raises(ZeroDivisionError), gemm_module.onednn_matmul():
        raise ZeroDivisionError  # restored after an exception too
    assert torch.backends.mkldnn.matmul.fp32_precision == setting


@pytest.mark.parametrize("n", [fused_module.QUERY_MAJOR_FROM - 1, fused_module.QUERY_MAJOR_FROM + 3])
@pytest.mark.parametrize(
    "hopfield,self_attention,mask_kind",
    [("relu", False, "batched"), ("softmax", True, "none"), ("softplus", False, "shared")],
)
@pytest.mark.parametrize("beta", [[0.3, 0.5, 1.1], 1.7], ids=["per-head", "scalar"])
def test_both_score_layouts_equal_the_closed_form_and_autograd(n, hopfield, self_attention, mask_kind, beta):
    """Either side of the token count where the scores switch to query-major storage: the fused field and its VJP
    (state and every weight) against the model's closed form and autograd in float64, with per-head betas and a
    scalar one (query-major with a scalar beta is the exp2 softmax with a shift per head's block), masks (a query
    without keys, a key nobody attends to) and each Hopfield form."""
    model = random_model(
        dim=12, heads=3, head_dim=4, memories=20, hopfield=hopfield, self_attention=self_attention, beta=beta, beta_hn=2.0
    )
    generator = torch.Generator().manual_seed(7)
    mask = None
    if mask_kind == "shared":
        mask = torch.rand(n, n, generator=generator) > 0.5
    elif mask_kind == "batched":
        mask = torch.rand(2, n, n, generator=generator) > 0.6
        mask[1, 3] = False
        mask[0, :, 5] = False
    g = model.neuron(torch.randn(2, n, 12, dtype=torch.float64, generator=generator))
    fused = fused_module.FusedGrad(model, gemm="matmul")
    assert _relative(fused(g, mask), model._dE_dg(g, mask)) < 1e-12
    point = g.detach().requires_grad_(True)
    inputs = (point, model.attention.WK, model.attention.WQ, model.hopfield.xi)
    u = torch.randn(g.shape, dtype=torch.float64, generator=generator)
    want = torch.autograd.grad(model._dE_dg(point, mask), inputs, u)
    got = torch.autograd.grad(fused(point, mask), inputs, u)
    for name, a, b in zip(("g", "WK", "WQ", "xi"), got, want, strict=True):
        assert _relative(a, b) < 1e-11, name


def _block_shift_declines(model, g: torch.Tensor) -> bool:
    """Whether the exp2 softmax with one shift per head's block declines these query-major scores (some row's sum
    underflows), computed here from the model's weights."""
    with torch.no_grad():
        keys = torch.einsum("hyd,bnd->bhny", model.attention.WK, g)
        queries = torch.einsum("hyd,bnd->bhny", model.attention.WQ, g)
        scores = fused_module._scores(keys, queries, query_major=True)
    return fused_module._key_softmax(scores, float(model.attention.beta[0]), query_major=True) is None


@pytest.mark.parametrize("dtype,beta,tol", [(torch.float64, 2000.0, 1e-12), (torch.float32, 60.0, 1e-5)])
def test_a_row_far_below_its_blocks_largest_score_gets_the_exact_softmax(dtype, beta, tol):
    """At a large beta one query's best score lies hundreds of nats (float64) or tens (float32) below another's in
    the same head, so one shift for the block would underflow that query's whole row: the shifted softmax declines
    (checked on these scores) and the field and its VJP equal the model's closed form in float64, with no NaN. At the
    default beta the same scores take the shifted path."""
    n = fused_module.QUERY_MAJOR_FROM + 3
    model64 = random_model(dim=12, heads=2, head_dim=4, memories=20, beta=beta)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(2, n, 12, dtype=torch.float64, generator=generator)
    model = copy.deepcopy(model64).to(dtype)
    g = model.neuron(x.to(dtype))
    assert _block_shift_declines(model, g)
    assert not _block_shift_declines(random_model(dim=12, heads=2, head_dim=4, memories=20).to(dtype), g)
    fused = fused_module.FusedGrad(model, gemm="matmul")
    g64 = model64.neuron(x)
    got = fused(g, None)
    assert bool(torch.isfinite(got).all())
    assert _relative(got.double(), model64._dE_dg(g64, None)) < tol
    point = g.detach().requires_grad_(True)
    u = torch.randn(g.shape, dtype=torch.float64, generator=generator)
    (got_vjp,) = torch.autograd.grad(fused(point, None), point, u.to(dtype))
    point64 = g64.detach().requires_grad_(True)
    (want_vjp,) = torch.autograd.grad(model64._dE_dg(point64, None), point64, u)
    assert _relative(got_vjp.double(), want_vjp) < 10 * tol


def test_query_major_float32_is_within_round_off_of_float64():
    """The exp2 softmax in float32 (query-major, scalar beta, every evaluation on the shifted path) against the
    float64 closed form, at a non-default beta with masks: the field and its VJP."""
    n = fused_module.QUERY_MAJOR_FROM + 8
    model64 = random_model(dim=24, heads=4, head_dim=6, memories=48, beta=0.9)
    model = copy.deepcopy(model64).float()
    generator = torch.Generator().manual_seed(5)
    mask = torch.rand(3, n, n, generator=generator) > 0.3
    mask[2, 7] = False  # a query without keys
    x = torch.randn(3, n, 24, dtype=torch.float64, generator=generator)
    assert not _block_shift_declines(model, model.neuron(x.float()))
    exact = ETField(model64, mask=mask, backend="reference")(0.0, x)
    field = ETField(model, mask=mask, backend="fused")
    assert _relative(field(0.0, x.float()).double(), exact) < 2e-6
    xg = x.float().requires_grad_(True)
    u = torch.randn(x.shape, dtype=torch.float64, generator=generator)
    (got,) = torch.autograd.grad(field(0.0, xg), xg, u.float())
    x64 = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(ETField(model64, mask=mask, backend="reference")(0.0, x64), x64, u)
    assert _relative(got.double(), want) < 2e-5


def test_untimed_choice_is_onednn_exactly_where_its_products_are_float32_exact(fresh_choices):
    """Without timing, the float32 CPU choice is oneDNN precisely where this PyTorch can route the products there and
    they come back within float32 rounding (judged here on other data, against float64 and the worst-case bound)."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    routable = torch.backends.mkldnn.is_available() and hasattr(matmul, "fp32_precision")
    exact = False
    if routable:
        generator = torch.Generator().manual_seed(7)
        a, b = torch.randn(12, 11, 8, generator=generator), torch.randn(12, 8, 11, generator=generator)
        previous = matmul.fp32_precision
        matmul.fp32_precision = "bf16"
        try:
            product = a @ b
        finally:
            matmul.fp32_precision = previous
        bound = 8 * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())
        exact = bool(((product.double() - a.double() @ b.double()).abs() <= bound).all())
    want = "onednn" if routable and exact else "matmul"
    assert choose_head_products(12, 11, 8, torch.float32, CPU, timed=False) == want


def test_gemm_matmul_keeps_every_product_off_onednn(fresh_choices, monkeypatch):
    """``gemm="matmul"`` is MKL everywhere: even where the probe would pick oneDNN, its block is never entered."""

    def refuse():
        raise AssertionError("gemm='matmul' entered oneDNN's matmul")

    monkeypatch.setattr(gemm_module, "choose_head_products", lambda *args, **kwargs: "onednn")
    monkeypatch.setattr(gemm_module, "onednn_matmul", refuse)
    _check_against_float64(_model64(), "matmul")
