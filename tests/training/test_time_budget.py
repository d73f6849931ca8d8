"""--max-time: a wall-clock budget the schedule is planned for; the cost of a training step (seconds, evaluations)."""

import time

import pytest
import torch
from torch import nn

from et_ode import Adaptive, Integration
from et_ode.data import load_digits
from et_ode.models import CompletionTask, ImageET
from et_ode.training.train import CHECKPOINT_NAME, TrainConfig, fit, load_checkpoint, training_cost

STEP_SECONDS = 0.01


class SlowRegression:
    """``y = w.x`` whose every loss takes at least STEP_SECONDS: a step time the budget can plan for."""

    def loss(self, model, batch):
        time.sleep(STEP_SECONDS)
        x, y = batch
        loss = (model(x).squeeze(-1) - y).square().mean()
        return loss, {"mse": float(loss.detach())}

    def evaluate(self, model, batches):
        return {"mse": float(torch.cat([(model(x).squeeze(-1) - y).square() for x, y in batches]).mean())}


def regression_data(n=100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=generator)
    return torch.utils.data.TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]))


def test_max_time_plans_the_cosine_and_stops_with_a_checkpoint(tmp_path):
    budget, lr = 1.5, 0.05
    config = TrainConfig(
        epochs=10_000, batch_size=10, lr=lr, warmup=0.1, out_dir=str(tmp_path), progress=False, max_time=budget
    )
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    history = fit(model, SlowRegression(), regression_data(), regression_data(20, seed=1), config)
    last = history.records[-1]
    assert last["stopped"] in ("planned_steps", "max_time") and "val_mse" in last
    assert last["time"] <= budget + 0.5  # the loop's clock: the final evaluation may run past the budget
    state = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    # far fewer steps than the 100,000 the epochs allow, as many as fit (each step sleeps 0.01 s)
    assert state["step"] == last["step"] and 30 <= state["step"] <= budget / STEP_SECONDS
    assert state["planned_steps"] >= state["step"] - 1
    # the schedule was planned for the budget: the learning rate has come most of the way down its cosine
    assert last["lr"] <= 0.25 * lr
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    cost = training_cost(history)
    assert cost["steps"] == state["step"] and STEP_SECONDS <= cost["seconds_per_step"] < 10 * STEP_SECONDS + 0.05
    # a resume with the budget spent takes no step and changes nothing
    resumed = fit(
        model,
        SlowRegression(),
        regression_data(),
        regression_data(20, seed=1),
        TrainConfig(**{**config.to_dict(), "resume": True}),
    )
    assert load_checkpoint(tmp_path / CHECKPOINT_NAME)["step"] == state["step"]
    assert len(resumed.records) == len(history.records)
    with pytest.raises(ValueError, match=r"TrainConfig.max_time must be a positive finite number or None, got 0"):
        TrainConfig(max_time=0)


@pytest.mark.parametrize("gradient, backward", [("adjoint", True), ("direct", False)])
def test_training_records_evaluations_per_step(gradient, backward):
    """The adjoint's backward solve evaluates the field; backpropagating through the steps does not."""
    torch.manual_seed(0)
    integration = Integration(solver=Adaptive("bosh3", rtol=1e-2, atol=1e-3), gradient=gradient, t1=0.3)
    model = ImageET((1, 8, 8), 4, 8, 2, 4, dynamics=integration)
    history = fit(
        model,
        CompletionTask(0.5),
        load_digits("train").images[:16],
        None,
        TrainConfig(epochs=1, batch_size=8, progress=False),
    )
    record = history.records[-1]
    assert record["batches"] == 2 and record["train_nfe"] >= 4  # bosh3: at least one step of 3 stages + the first
    assert (record["train_nfe_backward"] > 0) == backward
    cost = training_cost(history)
    assert cost["nfe_forward_per_step"] == record["train_nfe"] and cost["seconds_per_step"] > 0


def test_the_demo_report_states_the_cost_of_a_step():
    from et_ode.tasks.demo import _cost_line

    line = _cost_line(
        {
            "train_cost": {
                "steps": 1575,
                "seconds_per_step": 0.0612,
                "nfe_forward_per_step": 20.25,
                "nfe_backward_per_step": 38.5,
            }
        }
    )
    assert line == "1575 steps of 0.061 s, with 20.2 forward and 38.5 backward field evaluations per step."
    assert _cost_line({}) == ""
