"""The native solve's C field and its build (et_ode.kernels.native): the velocity against autograd of the energy at
every setting it takes, float64 and float32; what it declines; the build, its cache and the fallbacks."""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import pytest
import torch

import et_ode
from et_ode.integrators import adaptive_loop
from et_ode.kernels import native
from tests.conftest import random_model

F64 = torch.float64
CONTROL = (0.0, 1.0, 0.0, 0.9, 0.2, 10.0)


def _settings(tau: float, event: tuple[int, ...]) -> dict[str, object]:
    """A native solve's settings of one group of shape ``event`` (its loop unused: a velocity's tests)."""
    tableau = (torch.zeros(3, 2, dtype=F64), torch.zeros(2, 2, dtype=F64), 2)
    return dict(tau=tau, groups=1, event=event, tableau=tableau, t_end=1.0, rtol=1e-6, atol=1e-6, control=CONTROL, logged=1)


def _needs_library(dtype: torch.dtype = F64) -> None:
    """Skip where this machine has no C compiler or PyTorch no Fortran BLAS; elsewhere the library must be there."""
    if not native.can_build():
        pytest.skip("the native solve cannot be built here (no C compiler or no BLAS in PyTorch)")
    assert native.library(dtype) is not None, "a compiler and a BLAS are here: the build or its probe failed"


def _native_velocity(model: et_ode.EnergyModel, tau: float, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """The C field's velocity at the samples ``x`` ``(B, N, D)``, as the native solve evaluates it (its passes
    between the products on ``threads`` threads)."""
    _needs_library(x.dtype)
    solve = native.NativeSolve.create(model, None, x.dtype, x.device, **_settings(tau, tuple(x.shape)))
    assert solve is not None
    fields, alive = solve._field(threads)
    out = torch.empty_like(x)
    solve.lib.et_velocity(ctypes.byref(fields[0]), x.shape[0], x.contiguous().data_ptr(), out.data_ptr())
    del alive
    return out


def _model(
    neuron: str, hopfield: str, self_attention: bool, beta: float | list[float], dtype: torch.dtype, tokens_dim: int = 8
) -> et_ode.EnergyModel:
    """An ET of two heads (per-head ``beta``) and 12 memories of ``hopfield`` form, on a LayerNorm neuron of
    non-default gamma, delta and eps, or on the identity neuron."""
    model = random_model(tokens_dim, hopfield=hopfield, self_attention=self_attention, beta=beta, eps=1e-3, dtype=dtype)
    if neuron == "layer_norm":
        return model
    return et_ode.EnergyModel(et_ode.IdentityNeuron(tokens_dim), {"attention": model.attention, "hopfield": model.hopfield})


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("neuron", ["layer_norm", "identity"])
@pytest.mark.parametrize("hopfield", ["relu", "softplus", "softmax"])
@pytest.mark.parametrize("self_attention", [False, True])
def test_the_c_field_is_the_energy_s_gradient_flow(
    dtype: torch.dtype, neuron: str, hopfield: str, self_attention: bool
) -> None:
    """``-(1/tau) dE/dg`` at tau = 0.7, one beta per head, three samples of five tokens: the C field against autograd
    of the energy (``derivative="autograd"``) to 1e-12 of its size in float64, 2e-6 in float32."""
    model = _model(neuron, hopfield, self_attention, [0.3, 0.9], dtype)
    x = torch.randn(3, 5, 8, dtype=dtype, generator=torch.Generator().manual_seed(1)) * 2
    expected = et_ode.ETField(model, tau=0.7, derivative="autograd").velocity(x).detach()
    got = _native_velocity(model, 0.7, x)
    tolerance = 1e-12 if dtype == F64 else 2e-6
    assert float((got - expected).norm() / expected.norm()) < tolerance


@pytest.mark.parametrize("dim", [16, 40])
def test_the_c_field_at_a_token_size_of_whole_and_partial_vectors(dim: int) -> None:
    """Token sizes of whole blocks of 16 numbers and of two blocks and a rest (the C field's sums over a token run in
    blocks of 16): autograd's velocity to 1e-12, three heads of size 5, 20 memories, 7 tokens, tau 1.3."""
    model = random_model(dim, heads=3, head_dim=5, memories=20, eps=1e-4, beta=[0.2, 0.5, 1.1])
    x = torch.randn(2, 7, dim, dtype=F64, generator=torch.Generator().manual_seed(5)) * 3 + 1
    expected = et_ode.ETField(model, tau=1.3, derivative="autograd").velocity(x).detach()
    got = _native_velocity(model, 1.3, x)
    assert float((got - expected).norm() / expected.norm()) < 1e-12


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("hopfield", ["softplus", "softmax"])
def test_the_c_field_s_passes_on_several_threads_give_the_same_bits(dtype: torch.dtype, hopfield: str) -> None:
    """The passes between the products (LayerNorm, the attention's softmax, the memories) split over 2, 3 and 4
    threads, in parts of unequal size (14 rows, 28 softmax columns): the same bits as on one, which match autograd's
    velocity."""
    model = _model("layer_norm", hopfield, False, [0.4, 1.2], dtype)
    x = torch.randn(2, 7, 8, dtype=dtype, generator=torch.Generator().manual_seed(4)) * 2
    alone = _native_velocity(model, 0.8, x)
    for threads in (2, 3, 4):
        assert torch.equal(_native_velocity(model, 0.8, x, threads), alone)
    expected = et_ode.ETField(model, tau=0.8, derivative="autograd").velocity(x).detach()
    assert float((alone - expected).norm() / expected.norm()) < (1e-12 if dtype == F64 else 2e-6)


def test_the_c_field_keeps_the_softmax_exact_where_its_terms_underflow() -> None:
    """Scores spread over thousands (beta 40 and 25 on large states): most terms of each softmax fall below e^-707,
    which the C field's exp makes 0 (PyTorch's: subnormal or 0), and the few that count give autograd's velocity to
    1e-12."""
    model = _model("identity", "softmax", False, [40.0, 25.0], F64)
    with torch.no_grad():
        model.hopfield.beta = 30.0
    x = torch.randn(2, 6, 8, dtype=F64, generator=torch.Generator().manual_seed(2)) * 6
    expected = et_ode.ETField(model, derivative="autograd").velocity(x).detach()
    got = _native_velocity(model, 1.0, x)
    assert float((got - expected).norm() / expected.norm()) < 1e-12


def test_a_lone_token_without_self_attention_has_no_attention() -> None:
    """One token that may not attend to itself: no key, so the attention adds nothing (the velocity is the memories'
    alone), as in the closed form."""
    model = _model("layer_norm", "relu", False, 0.5, F64)
    x = torch.randn(2, 1, 8, dtype=F64, generator=torch.Generator().manual_seed(3))
    expected = et_ode.ETField(model, backend="reference").velocity(x).detach()
    got = _native_velocity(model, 1.0, x)
    assert torch.isfinite(got).all() and float((got - expected).abs().max()) < 1e-12


def test_what_the_native_solve_declines() -> None:
    """A mask, a state of another dtype or precision than float32/float64, another device, another neuron or another
    interaction: :func:`~et_ode.kernels.native.supports` says no (the solve is then compiled by ``torch.compile``),
    and the native solve itself, made for such a model, raises a ValueError naming it."""
    model = random_model()
    cpu = torch.device("cpu")
    assert native.supports(model, None, F64, cpu)
    assert not native.supports(model, torch.ones(5, 5, dtype=torch.bool), F64, cpu)
    assert not native.supports(model, None, torch.float32, cpu)
    assert not native.supports(random_model(dtype=torch.bfloat16), None, torch.bfloat16, cpu)
    assert not native.supports(model, None, F64, torch.device("meta"))
    extra = et_ode.EnergyModel(
        model.neuron, {"attention": model.attention, "hopfield": model.hopfield, "again": model.hopfield}
    )
    assert not native.supports(extra, None, F64, cpu)
    alone = et_ode.EnergyModel(model.neuron, {"hopfield": model.hopfield})
    assert not native.supports(alone, None, F64, cpu)
    with pytest.raises(ValueError, match="model: the native loop computes"):
        native.NativeSolve(alone, lib=(ctypes.CDLL(None), (0, 0)), **_settings(1.0, (1, 5, 8)))  # type: ignore[arg-type]

    class Scaled(et_ode.LayerNormNeuron):
        pass

    assert not native.supports(et_ode.EnergyModel(Scaled(8).double(), model.interactions), None, F64, cpu)


def test_the_library_is_built_once_into_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Built into ``$ET_ODE_CACHE`` under a name that hashes the source, the command and the CPU; a second build of
    the same finds it there and runs no compiler."""
    _needs_library()
    monkeypatch.setenv("ET_ODE_CACHE", str(tmp_path))
    built = native._build("double")
    assert built is not None and built.parent == tmp_path / "native" and built.exists()

    def no_compiler(*arguments: object, **settings: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native._build("double") == built


@pytest.mark.usefixtures("fresh_library")
@pytest.mark.parametrize("compiler", ["/nowhere/cc", "false"])
def test_without_a_working_compiler_the_solve_is_compiled_by_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, compiler: str
) -> None:
    """No C compiler (``$CC`` not found), or one that fails (logged): no library, and ``compile=True`` hands the
    solve to ``torch.compile`` (here run as it is), with the plain loop's steps."""
    monkeypatch.setenv("ET_ODE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(native.__name__)
    monkeypatch.setattr(logger, "level", logging.INFO)
    logger.addHandler(handler)
    try:
        assert native.library(F64) is None
    finally:
        logger.removeHandler(handler)
    assert (compiler == "false") == any("not built" in message for message in logged)
    handed: list[object] = []

    def as_it_is(loop: object, *arguments: object) -> object:
        handed.append(loop)
        return adaptive_loop._whole_solve(loop, *arguments)  # type: ignore[arg-type]

    monkeypatch.setattr(adaptive_loop, "_compiled_solve", lambda device_type: as_it_is)
    field, x0 = et_ode.ETField(random_model()), torch.randn(2, 5, 8, dtype=F64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        compiled, plain = (
            et_ode.solve(field, x0, (0.0, 2.0), solver=et_ode.Adaptive(compile=on), save="final") for on in (True, False)
        )
    assert handed and compiled.stats.nfe_forward == plain.stats.nfe_forward
    assert float((compiled.x - plain.x).abs().max()) < 1e-12


@pytest.mark.parametrize("batched", [True, False])
def test_the_probe_rejects_a_blas_that_computes_other_numbers(batched: bool) -> None:
    """The float64 library handed PyTorch's float32 products (which read the doubles' bytes as floats: other
    numbers, inside the same buffers) fails the probe that the real products pass; with or without the batched
    product."""
    _needs_library()
    found = native.library(F64)
    assert found is not None
    lib, (product, batch) = found
    single, single_batch = native._blas_symbol("sgemm_"), native._blas_symbol("sgemm_batch_")
    assert native._probe(lib, (product, batch if batched else 0), F64)
    assert not native._probe(lib, (single, single_batch if batched else 0), F64)


def test_an_unwritable_cache_folder_leaves_the_native_solve_unused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``$ET_ODE_CACHE`` naming a file, where no folder can be made: no library (logged), no error."""
    _needs_library()
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("ET_ODE_CACHE", str(blocked))
    assert native._build("double") is None


@pytest.mark.usefixtures("fresh_library")
def test_a_damaged_library_in_the_cache_is_removed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cached library that does not load (here overwritten with text): the solve goes on without it, and the file
    is removed, so that the next process builds it again."""
    _needs_library()
    monkeypatch.setenv("ET_ODE_CACHE", str(tmp_path))
    built = native._build("double")
    assert built is not None
    built.write_text("not a library")
    native.library.cache_clear()  # (_needs_library looked it up in the usual cache)
    assert native.library(F64) is None and not built.exists()
    native.library.cache_clear()
    assert native.library(F64) is not None and built.exists()
