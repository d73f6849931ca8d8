"""The solve's one-pass input check: ``check_normalisable`` skips its exact variance test only where no overflow is
possible, and so rejects exactly the states whose LayerNorm variance overflows."""

import math

import pytest
import torch

from et_ode._checks import check_normalisable


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
