"""The training loop: schedule, checkpoints, exact resume, errors; and a short image run beating the mean."""

import json
import math
import os

import pytest
import torch
from torch import nn

from et_ode import EulerET, Integration
from et_ode.backend.devices import move_to
from et_ode.data import load_digits
from et_ode.models import CompletionTask, ImageET, evaluate_completion, fixed_mask_set
from et_ode.tasks.baselines import MeanImage
from et_ode.training.io import load_model, save_model
from et_ode.training.statefile import describe
from et_ode.training.train import (
    CHECKPOINT_NAME,
    METRICS_NAME,
    TrainConfig,
    fit,
    load_checkpoint,
    lr_factor,
    save_checkpoint,
)
from tests.conftest import random_model

EULER = Integration(solver=EulerET(0.1, 3), gradient="direct")


class NoisyRegression:
    """``y = w.x`` with input noise: the loss draws from the global RNG, as mask sampling does."""

    def loss(self, model, batch):
        x, y = batch
        prediction = model(x + 0.01 * torch.randn_like(x)).squeeze(-1)
        loss = (prediction - y).square().mean()
        return loss, {"mse": float(loss.detach())}

    def evaluate(self, model, batches):
        errors = [(model(x).squeeze(-1) - y).square() for x, y in batches]
        return {"mse": float(torch.cat(errors).mean())}


class Interrupt(Exception):
    pass


class InterruptAfter(NoisyRegression):
    def __init__(self, calls):
        self.calls = calls

    def loss(self, model, batch):
        self.calls -= 1
        if self.calls < 0:
            raise Interrupt
        return super().loss(model, batch)


def regression_data(n=100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0])
    return torch.utils.data.TensorDataset(x, y)


def linear():
    torch.manual_seed(0)
    return nn.Linear(5, 1)


def test_lr_schedule_closed_form():
    # warm-up: (step + 1) / warmup; then half a cosine from 1 to min_lr_ratio
    assert lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10) == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(32, 100, 10, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 22 / 90)))


def test_fit_learns_and_logs(tmp_path):
    model = linear()
    config = TrainConfig(epochs=4, batch_size=10, lr=0.3, warmup=2, out_dir=str(tmp_path), progress=False)
    history = fit(model, NoisyRegression(), regression_data(), regression_data(50, seed=1), config)
    assert len(history.records) == 4
    assert history.records[-1]["val_mse"] < 0.2 * history.records[0]["val_mse"]
    lines = [json.loads(line) for line in (tmp_path / METRICS_NAME).read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1, 2, 3, 4]
    assert lines[-1]["val_mse"] == pytest.approx(history.last("val_mse"))
    # the scheduler reached the end of its cosine: lr ~ 0 at the last step
    assert lines[-1]["lr"] == pytest.approx(0.0, abs=1e-12)
    state = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert state["epoch"] == 4 and state["step"] == 40
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("interrupt_at", [13, 20])  # mid-epoch (after the checkpoint at step 12) and at an epoch end
def test_resume_reproduces_the_uninterrupted_run(tmp_path, interrupt_at):
    data, val = regression_data(), regression_data(30, seed=1)

    def config(out):
        return TrainConfig(
            epochs=3,
            batch_size=8,
            lr=0.02,
            warmup=0.1,
            checkpoint_every=4,
            out_dir=str(out),
            resume=True,
            progress=False,
            seed=3,
        )

    full = linear()
    fit(full, NoisyRegression(), data, val, config(tmp_path / "full"))

    broken = linear()
    with pytest.raises(Interrupt):
        fit(broken, InterruptAfter(interrupt_at), data, val, config(tmp_path / "broken"))
    saved = load_checkpoint(tmp_path / "broken" / CHECKPOINT_NAME)
    assert 0 < saved["step"] < 39
    resumed = linear()
    torch.manual_seed(12345)  # the global RNG at restart must not matter
    history = fit(resumed, NoisyRegression(), data, val, config(tmp_path / "broken"))
    for name, value in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert history.records[-1]["epoch"] == 3


def test_resume_with_other_settings_is_refused(tmp_path):
    fit(
        linear(),
        NoisyRegression(),
        regression_data(),
        None,
        TrainConfig(epochs=1, batch_size=10, out_dir=str(tmp_path), progress=False),
    )
    with pytest.raises(ValueError, match="batch_size: checkpoint 10 vs now 20"):
        fit(
            linear(),
            NoisyRegression(),
            regression_data(),
            None,
            TrainConfig(epochs=2, batch_size=20, out_dir=str(tmp_path), resume=True, progress=False),
        )


def test_corrupt_and_truncated_checkpoints(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"model": {"w": torch.arange(1000.0)}})
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.arange(1000.0))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"c\.pt .*truncated or corrupt"):
        load_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_checkpoint(path)
    path.write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_checkpoint(path)
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match="refused: it is a pickle"):
        load_checkpoint(path)
    # cut inside its header, a checkpoint whose header length begins with the byte of a pickle's start is not one
    header = b'{"__metadata__": {"format": "et-ode/training-checkpoint/2", "state": "' + b"x" * 400 + b'"}}'
    header += b" " * (0x280 - len(header))
    assert header.startswith(b"{") and len(header).to_bytes(8, "little")[:1] == b"\x80"
    path.write_bytes((len(header).to_bytes(8, "little") + header)[:300])
    assert describe(path) == "a safetensors file whose header is truncated or corrupt"
    with pytest.raises(ValueError, match=r"c\.pt \(300 bytes\) is truncated or corrupt"):
        load_checkpoint(path)
    save_checkpoint(path, {"model": {}})
    with pytest.raises(ValueError, match=r"lacks the entries \['optimizer'\]"):
        load_checkpoint(path, required=("model", "optimizer"))
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")
    # a resume from a damaged file is refused, naming the file
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / CHECKPOINT_NAME).write_bytes(raw[:100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        fit(
            linear(),
            NoisyRegression(),
            regression_data(),
            None,
            TrainConfig(epochs=1, out_dir=str(tmp_path / "run"), resume=True, progress=False),
        )


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(3)}})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(TypeError, match=r"cannot store state\.model: Unpicklable is not data"):
        save_checkpoint(path, {"model": Unpicklable()})
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind


def test_model_files_and_checkpoints_reach_the_disk_before_they_replace_the_old_file(tmp_path, monkeypatch):
    """save_model and save_checkpoint share one writer: fsync of the new bytes while the old file is still in place,
    then the rename; a write that fails leaves the old file and no temporary file."""
    model_path, checkpoint_path = tmp_path / "m.pt", tmp_path / "c.safetensors"
    save_model(random_model(seed=0), model_path)
    save_checkpoint(checkpoint_path, {"model": {"w": torch.ones(3)}})
    old = {path.name: path.read_bytes() for path in (model_path, checkpoint_path)}
    seen, real_fsync = [], os.fsync

    def fsync(descriptor: int) -> None:
        seen.append({path.name: path.read_bytes() for path in (model_path, checkpoint_path)})
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    save_model(random_model(seed=1), model_path)
    save_checkpoint(checkpoint_path, {"model": {"w": torch.zeros(3)}})
    assert seen == [old, {**old, "m.pt": model_path.read_bytes()}]  # one fsync per write, each before its rename
    assert model_path.read_bytes() != old["m.pt"]
    assert torch.equal(load_checkpoint(checkpoint_path)["model"]["w"], torch.zeros(3))
    with pytest.raises(Exception, match="lambda"):  # torch.save cannot pickle a lambda: the write fails midway
        save_model(random_model(seed=2), model_path, note=lambda: None)
    assert load_model(model_path)[0].attention.WK.equal(random_model(seed=1).attention.WK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "m.pt"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("epochs", 0, "epochs must be a positive integer"),
        ("lr", -1.0, "lr must be a positive finite number"),
        ("warmup", -0.5, "warmup must be >= 0"),
        ("device", "tpu", "device must be"),
        ("grad_clip", -1.0, "grad_clip"),
    ],
)
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_bad_task_and_data():
    with pytest.raises(TypeError, match="task must have a callable loss"):
        fit(linear(), object(), regression_data(), None, TrainConfig(progress=False))
    with pytest.raises(TypeError, match="map-style Dataset"):
        fit(linear(), NoisyRegression(), iter([]), None, TrainConfig(progress=False))


def test_non_finite_loss_stops_with_a_clear_error():
    class Exploding(NoisyRegression):
        def loss(self, model, batch):
            return torch.tensor(float("nan"), requires_grad=True), {}

    with pytest.raises(FloatingPointError, match="training loss became nan"):
        fit(linear(), Exploding(), regression_data(), None, TrainConfig(progress=False))


def test_move_to_nested():
    batch = {"a": (torch.ones(1), [torch.zeros(2)]), "b": 3}
    moved = move_to(batch, torch.device("cpu"))
    assert moved["b"] == 3 and torch.equal(moved["a"][1][0], torch.zeros(2))


def test_short_image_run_beats_the_mean_baseline():
    """A few hundred digits, a small image ET, seeded: the held-out masked MSE ends below the mean image's."""
    torch.manual_seed(0)
    train, test = load_digits("train"), load_digits("test")
    train_images = train.images[:400]
    model = ImageET((1, 8, 8), 4, 32, 4, 8, dynamics=Integration(solver=EulerET(0.1, 12), gradient="direct"))
    val = fixed_mask_set(test.images, model.num_patches, 0.5, seed=0)
    config = TrainConfig(epochs=12, batch_size=16, lr=2e-3, warmup=0.05, seed=0, progress=False)
    history = fit(model, CompletionTask(0.5), train_images, val, config)
    mean = evaluate_completion(MeanImage(train_images, 4), [val.tensors])["mse"]
    first, last = history.records[0]["val_mse"], history.records[-1]["val_mse"]
    assert last < mean, (first, last, mean)
    assert last < first


def test_image_run_resumes_exactly(tmp_path):
    """The same with an image ET: random masks drawn during training, a mid-epoch interruption."""
    images = load_digits("train").images[:48]

    def model():
        torch.manual_seed(5)
        return ImageET((1, 8, 8), 4, 8, 2, 4, dynamics=EULER)

    def config(out):
        return TrainConfig(
            epochs=2, batch_size=8, lr=1e-2, checkpoint_every=4, out_dir=str(out), resume=True, progress=False, seed=1
        )

    class InterruptedCompletion(CompletionTask):
        calls = 0

        def loss(self, model, batch):
            InterruptedCompletion.calls += 1
            if InterruptedCompletion.calls > 9:
                raise Interrupt
            return super().loss(model, batch)

    # et_ode.kernels.gemm times its GEMM back ends on the first call of each size with torch.randn on the *global*
    # generator (reported to its owner); make that first call here, so it cannot shift the RNG stream below.
    with torch.no_grad():
        model()(images[:8], torch.zeros(8, 4, dtype=torch.bool))
    full = model()
    fit(full, CompletionTask(0.5), images, None, config(tmp_path / "full"))
    with pytest.raises(Interrupt):
        fit(model(), InterruptedCompletion(0.5), images, None, config(tmp_path / "cut"))
    assert load_checkpoint(tmp_path / "cut" / CHECKPOINT_NAME)["step"] == 8
    resumed = model()
    fit(resumed, CompletionTask(0.5), images, None, config(tmp_path / "cut"))
    for name, value in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
