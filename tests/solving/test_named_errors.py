"""Bad values that used to pass silently or fail far from their cause: each is refused naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from et_ode import Adjoint, EnergyTransformer, ETField, Implicit, SteadyState, solve
from et_ode.models.image import ImageET


@pytest.mark.parametrize("tau", ["1", None, [1.0], True])
def test_tau_of_another_type_is_a_type_error_naming_tau(tau):
    model = EnergyTransformer(dim=8, heads=2, head_dim=4, memories=8)
    with pytest.raises(TypeError, match=r"^tau must be a real number"):
        ETField(model, tau=tau)
    with pytest.raises(TypeError, match=r"^tau must be a real number"):
        ImageET((1, 8, 8), 4, 8, 2, 4, tau=tau)
    assert ETField(model, tau=np.float32(0.5)).tau == 0.5


@pytest.mark.parametrize("gradient, stop", [("direct", None), (Adjoint(), None), (Implicit(), SteadyState(1e-3))])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_named_before_the_solve(gradient, stop, bad):
    model = EnergyTransformer(dim=8, heads=2, head_dim=4, memories=8)
    with torch.no_grad():
        model.attention.WQ[0, 0, 0] = bad
    field = ETField(model)
    with pytest.raises(ValueError, match=r"parameter 'attention.WQ' holds NaN or infinite values"):
        solve(field, torch.randn(2, 3, 8), (0.0, 1.0), gradient=gradient, stop=stop)
    assert field.nfe == 0


def test_image_model_sizes_are_checked_before_allocating():
    with pytest.raises(ValueError, match=r"memories must be a positive integer, got 0"):
        ImageET((1, 8, 8), 4, 8, 2, 4, 0)
    with pytest.raises(ValueError, match=r"dim=200000, heads=2, head_dim=4, memories=200000 make"):
        ImageET((1, 8, 8), 4, 200_000, 2, 4, 200_000)
    with pytest.raises(ValueError, match=r"the model description misses \['dim'\]"):
        ImageET.from_config({"image_shape": [1, 8, 8], "patch": 4, "heads": 2, "head_dim": 4})


def test_evaluation_masks_must_be_boolean_and_score_something(tmp_path):
    from et_ode.tasks.evaluation import _read_masks

    path = tmp_path / "completions.npz"
    np.savez(path, hidden=np.ones((3, 4), dtype=bool), scored=np.zeros((3, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"'scored' marks no patch"):
        _read_masks(path, 3, 4)
    np.savez(path, hidden=np.ones((3, 4), dtype=np.int64), scored=np.ones((3, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"'hidden' holds torch.int64 values; masks are boolean"):
        _read_masks(path, 3, 4)
    np.savez(path, hidden=np.ones((3, 4), dtype=bool), scored=np.ones((3, 5), dtype=bool))
    with pytest.raises(ValueError, match=r"'scored' has shape \(3, 5\)"):
        _read_masks(path, 3, 4)


@pytest.mark.parametrize("t", [("0", "1"), "ab", (0.0, None), {"a": 1}])
def test_times_that_are_not_numbers_are_a_type_error_naming_t(t):
    field = ETField(EnergyTransformer(dim=8, heads=2, head_dim=4, memories=8))
    with pytest.raises(TypeError, match=r"^t must"):
        solve(field, torch.randn(1, 3, 8), t)


@pytest.mark.parametrize(
    "setting, value",
    [("train_limit", 0), ("train_limit", -1), ("test_limit", 0), ("memories", 0), ("val_size", -1), ("tile", 0)],
)
def test_image_run_counts_have_ranges(setting, value):
    from et_ode.tasks.image import ImageRunConfig

    with pytest.raises(ValueError, match=rf"^{setting} must be a (positive|non-negative) integer"):
        ImageRunConfig(**{setting: value})


def test_graph_model_sizes_are_checked_before_allocating():
    from et_ode.models.graph import GraphET

    with pytest.raises(ValueError, match=r"dim=200000, heads=4, head_dim=16, memories=200000 make"):
        GraphET(3, 2, dim=200_000, memories=200_000)
    with pytest.raises(ValueError, match=r"memories must be a positive integer, got 0"):
        GraphET(3, 2, memories=0)
