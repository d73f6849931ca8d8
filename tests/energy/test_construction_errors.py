"""Bad models and states are refused at the door with an error that names the argument, never a raw one."""

from __future__ import annotations

import pytest
import torch

from et_ode import EnergyTransformer, ETField, find_attractor, solve


def test_a_model_needs_a_floating_dtype_and_a_device_this_machine_has() -> None:
    with pytest.raises(TypeError, match="dtype"):
        EnergyTransformer(dim=8, heads=2, head_dim=4, memories=16, dtype=torch.int64)
    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has eight CUDA devices")
    with pytest.raises(ValueError, match="device='cuda:7'"):
        EnergyTransformer(dim=8, heads=2, head_dim=4, memories=16, device="cuda:7")


def test_sparse_and_empty_states_are_refused_by_name() -> None:
    field = ETField(EnergyTransformer(dim=8, heads=2, head_dim=4, memories=16))
    sparse = torch.randn(1, 3, 8).to_sparse()
    refused = "x0 must be a dense floating tensor .* got a torch.sparse_coo tensor, not a dense one"
    with pytest.raises(TypeError, match=refused):
        solve(field, sparse, (0.0, 1.0))
    with pytest.raises(TypeError, match=refused):
        find_attractor(field, sparse)
    with pytest.raises(ValueError, match="x0 has an empty batch"):
        find_attractor(field, torch.randn(0, 3, 8))
