"""Statistics that cannot lie: per-solve evaluation counts taken by the solve's own thread, ``nfe_backward`` fixed at
the end of the backward pass, and solvers that honour or refuse their time argument."""

from __future__ import annotations

import threading

import pytest
import torch

from et_ode import Adjoint, EnergyTransformer, ETField, EulerET, Fixed, solve


def _field() -> ETField:
    torch.manual_seed(0)
    return ETField(EnergyTransformer(dim=8, heads=2, head_dim=4, memories=8).double())


def _x0(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_threads_sharing_a_field_each_count_their_own_evaluations():
    field = _field()
    alone = solve(field, _x0(), (0.0, 1.0), solver=Fixed("rk4", step_size=0.1)).stats.nfe_forward
    assert alone == 40
    counts: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work() -> None:
        try:
            start.wait()
            for _ in range(3):
                counts.append(solve(field, _x0(), (0.0, 1.0), solver=Fixed("rk4", step_size=0.1)).stats.nfe_forward)
        except BaseException as error:  # noqa: B036 -- reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and counts == [alone] * 12
    assert field.nfe == alone * 13  # the field's own counter adds up every thread


def test_nfe_backward_is_fixed_when_the_backward_ends():
    field = _field()
    x0 = _x0()
    solution = solve(field, x0, (0.0, 0.5), gradient=Adjoint(), solver="dopri5")
    assert solution.stats.nfe_backward == 0  # no backward yet
    before = field.nfe
    solution.g.square().sum().backward()
    backward = solution.stats.nfe_backward
    assert backward == field.nfe - before > 0
    solve(field, x0, (0.0, 0.5))  # another solve, then a reset: the count stays
    field.reset_nfe()
    assert solution.stats.nfe_backward == backward and solution.stats.as_dict()["nfe_backward"] == backward


def test_nfe_backward_adds_each_backward_pass_and_ignores_other_solves_passes():
    field = _field()
    first = solve(field, _x0(1), (0.0, 0.2), gradient=Adjoint())
    second = solve(field, _x0(2), (0.0, 0.2), gradient=Adjoint())
    before = field.nfe
    first.x.sum().backward(retain_graph=True)
    once = first.stats.nfe_backward
    assert once == field.nfe - before > 0
    second.x.sum().backward()
    assert first.stats.nfe_backward == once and second.stats.nfe_backward > 0
    first.x.sum().backward()
    assert first.stats.nfe_backward == 2 * once


@pytest.mark.parametrize("t", [(0.0, 5.0), (1, 0), [0, 5, -3], torch.tensor([0.0]), (float("nan"),), ("0",)])
def test_euler_et_refuses_any_t_but_a_start_time(t):
    with pytest.raises(ValueError, match=r"\bt="):
        solve(_field(), _x0(), t, solver="et")


def test_euler_et_starts_at_t0_and_runs_its_own_horizon():
    solution = solve(_field(), _x0(), (2.0,), solver=EulerET(0.1, 5))
    assert solution.ts[0].item() == 2.0 and solution.stats.t_final == pytest.approx(2.5)
    assert solution.stats.nfe_forward == 5


def test_fixed_steps_refuse_a_span_below_the_step_resolution():
    with pytest.raises(ValueError, match=r"\bt spans"):
        solve(_field(), _x0(), (0.0, 1e-300), solver=Fixed("euler", step_size=0.1))
    tiny = solve(_field(), _x0(), (0.0, 1e-15), solver=Fixed("euler", step_size=0.1))
    assert tiny.stats.nfe_forward == 1 and tiny.stats.t_final == 1e-15


def test_threads_each_count_their_own_backward_evaluations():
    field = _field()
    x0 = _x0()

    def solve_and_backward() -> tuple[int, int]:
        solution = solve(field, x0, (0.0, 0.5), gradient=Adjoint())
        solution.g.square().sum().backward()
        return solution.stats.nfe_forward, solution.stats.nfe_backward

    alone = solve_and_backward()
    assert alone[1] > 0
    results: list[tuple[int, int]] = []
    start = threading.Barrier(4)

    def work() -> None:
        start.wait()
        for _ in range(2):
            results.append(solve_and_backward())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [alone] * 8
