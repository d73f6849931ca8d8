"""The solve's one-pass input check: ``check_normalisable`` skips its exact variance test only where no overflow is
possible, and so rejects exactly the states whose LayerNorm variance overflows."""

import math

import pytest
import torch

from et_ode.energy.checks import check_normalisable


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [4, 64])
def test_rejects_exactly_the_states_whose_variance_overflows(dtype, dim):
    """Around the fast path's bound and around the true overflow: a token ``[s, -s, s, -s, ...]`` is rejected iff a
    centred square ``s^2`` or their sum ``D s^2`` exceeds the dtype's largest value (computed in float64)."""
    largest = torch.finfo(dtype).max
    fast_bound = math.sqrt(largest / (4 * dim)) / 2
    overflow = math.sqrt(largest)  # the square of the centred entry (~ s) overflows past this
    for scale in (fast_bound * 0.9, fast_bound * 1.1, overflow * 0.4, overflow * 0.9, overflow * 1.1, overflow * 3.0):
        x = torch.zeros(2, 3, dim, dtype=dtype)
        x[1, 2, 0::2], x[1, 2, 1::2] = scale, -scale
        spread = (x.double() - x.double().mean(dim=-1, keepdim=True)).square()  # float64: the squares themselves
        overflows = bool((spread > largest).any()) or bool((spread.sum(dim=-1) > largest).any())
        if overflows:
            with pytest.raises(ValueError, match=r"x0 is too large .* token \(1, 2\)"):
                check_normalisable("x0", x)
        else:
            assert check_normalisable("x0", x) is x


def test_empty_state_passes():
    assert check_normalisable("x0", torch.zeros(0, 3, 4)).shape == (0, 3, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_check_tokens_applies_the_same_bound_from_its_own_pass(dtype, monkeypatch):
    """``check_tokens(..., normalisable=True)`` (what ``solve`` runs on ``x0``) rejects exactly the states that
    ``check_normalisable`` rejects, reading ``x`` once for both the finiteness and the overflow checks."""

    from et_ode.energy import checks

    passes = []
    counted = checks.value_range
    monkeypatch.setattr(checks, "value_range", lambda x: passes.append(1) or counted(x))
    dim = 8
    largest = torch.finfo(dtype).max
    for scale in (1.0, math.sqrt(largest / (4 * dim)) / 2 * 1.1, math.sqrt(largest) * 0.9, math.sqrt(largest) * 1.1):
        x = torch.zeros(2, 3, dim, dtype=dtype)
        x[1, 2, 0::2], x[1, 2, 1::2] = scale, -scale
        try:
            check_normalisable("x0", x)
            expected = None
        except ValueError as error:
            expected = str(error)
        passes.clear()
        if expected is None:
            assert checks.check_tokens("x0", x, dim, normalisable=True) is x
        else:
            with pytest.raises(ValueError) as raised:
                checks.check_tokens("x0", x, dim, normalisable=True)
            assert str(raised.value) == expected
        assert len(passes) == 1


def test_solution_g_is_the_fields_activation_of_the_final_state():
    """``Solution.g`` is ``LayerNorm(x)`` as the field computes it (one ``layer_norm`` kernel on the fused path),
    bit for bit, and agrees with the neuron's own formula to float32 rounding."""
    import et_ode

    torch.manual_seed(0)
    model = et_ode.EnergyTransformer(16, 2, 4, 32)
    with torch.no_grad():
        model.neuron.delta.normal_(0.0, 0.3)
    field = et_ode.ETField(model)
    solution = et_ode.solve(field, torch.randn(3, 5, 16), solver=et_ode.EulerET(0.1, 4), save="final")
    assert torch.equal(solution.g, field.activation(solution.x))
    torch.testing.assert_close(solution.g, model.neuron(solution.x), rtol=1e-5, atol=1e-6)
