"""Shared test helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import et_ode
from et_ode.backend import runtime
from et_ode.kernels import native

# The test problems are tiny: one intra-op thread avoids OpenMP wake-up latency, which dominates them
# (and explodes when the cores are shared).
torch.set_num_threads(1)

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _solve_progress_off() -> Iterator[None]:
    """Each test starts with ``solve``'s progress bar off, the library's default: the command line turns it on for
    the process (:func:`et_ode.backend.runtime.show_solve_progress`), also in fixtures of a wider scope, and must not
    change the solves of the tests after it."""
    runtime.show_solve_progress(False)
    yield
    runtime.show_solve_progress(False)


@pytest.fixture
def fresh_library() -> Iterator[None]:
    """The native loop's library looked up again in the test (its environment patched) and after it."""
    native.library.cache_clear()
    yield
    native.library.cache_clear()


def random_model(
    dim: int = 8,
    heads: int = 2,
    head_dim: int = 4,
    memories: int = 12,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    **kwargs: object,
) -> et_ode.EnergyTransformer:
    """A small random model with a non-trivial gamma and delta."""
    torch.manual_seed(seed)
    model = et_ode.EnergyTransformer(dim, heads, head_dim, memories, **kwargs).to(dtype)
    with torch.no_grad():
        model.neuron.delta.normal_(0.0, 0.3)
        model.neuron.gamma_raw.add_(0.3)
    return model


def counted_backend() -> tuple[Callable[..., Callable[..., object]], list[torch.fx.GraphModule]]:
    """A ``torch.compile`` back end that runs each graph dynamo traces as it is (no C++ compiler), and the list of
    those graphs: one per compilation."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(graph)
        return graph.forward

    return backend, graphs


def hand_rk4(field: et_ode.ETField, x: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """torchdiffeq's ``rk4`` (the 3/8 rule) written out, on the float64 step times ``times``: the state at
    ``times[-1]``."""
    with torch.no_grad():
        for t0, t1 in zip(times[:-1], times[1:], strict=True):
            dt = t1 - t0
            k1 = field.velocity(x)
            k2 = field.velocity(x + dt * k1 * (1 / 3))
            k3 = field.velocity(x + dt * (k2 - k1 * (1 / 3)))
            k4 = field.velocity(x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt * 0.125
    return x


@pytest.fixture
def fixtures() -> Path:
    """The small data files the tests read (``tests/fixtures/``: MUTAG, an official-format checkpoint)."""
    return FIXTURES
