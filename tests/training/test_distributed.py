"""Data-parallel training (et_ode.training.distributed with et_ode.training.train.fit) on 2 CPU processes with gloo.

The multi-process tests start this file as a torchrun worker (``python -m torch.distributed.run ... this_file
SCENARIO OUT``) on loopback with a free port, under a hard timeout that kills the whole process group, and
compare against :func:`fit` in one process on the same global batches (float64, fixed-step solver, masks fixed
per example, so the only differences are summation orders).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from et_ode import Adaptive, Fixed, Integration, SteadyState
from et_ode.models.image import (
    CompletionTask,
    ImageET,
    evaluate_completion,
    masked_mse,
    patchify,
    random_masks,
)
from et_ode.training import distributed
from et_ode.training.train import CHECKPOINT_NAME, METRICS_NAME, TrainConfig, fit, load_checkpoint

torch.set_num_threads(1)

HERE = Path(__file__).resolve()
IMAGE_SHAPE = (1, 4, 4)
PATCH = 2
# (name, gradient mode, gradient clip): clipping off compares raw averaged gradients (AdamW and clipping are
# blind to a common scale of the gradients); clipping on checks that clipping sees the same gradients everywhere.
STEP_CASES = [
    ("direct", "direct", None),
    ("direct-clipped", "direct", 1e-3),
    ("adjoint", "adjoint", None),
    ("adjoint-clipped", "adjoint", 1e-3),
    ("implicit", "implicit", None),
]
WORKER_TIMEOUT = 150  # seconds: a hard limit for every torchrun launch (the whole process group is killed)
STALL_TIMEOUT = 10  # seconds a rank waits for a stalled peer in the "stall" scenario


# ----------------------------------------------------------------------------------------------- the problem
class FixedMaskTask:
    """Masked completion with masks fixed per example: batches are ``(images, hidden, scored)``."""

    def __init__(self, fail_rank: int | None = None, fail_at: int | None = None, stall: bool = False):
        self.fail_rank, self.fail_at, self.stall, self.calls = fail_rank, fail_at, stall, 0

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        if self.fail_at is not None and self.calls == self.fail_at and self.fail_rank in (None, distributed.rank()):
            if self.stall:
                print(f"rank {distributed.rank()} stalls at step {self.calls}", flush=True)
                time.sleep(3600)  # a rank that hangs: its peers' collectives must time out
            raise _Interrupted(f"rank {distributed.rank()} failed on purpose at step {self.calls}")
        self.calls += 1
        images, hidden, scored = batch
        out = model(images, hidden)
        loss = masked_mse(out.patches, patchify(images, PATCH), scored)
        return loss, {"mse": float(loss.detach())}

    def evaluate(self, model: torch.nn.Module, batches: Any) -> dict[str, float]:
        return evaluate_completion(model, batches)


class _Interrupted(RuntimeError):
    pass


def make_data(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """Random float64 images with masks that score 2 of 4 patches each (hide 1 or 2)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(count, *IMAGE_SHAPE, generator=generator, dtype=torch.float64)
    hidden, scored = random_masks(count, 4, 0.5, visible_fraction=0.5 if seed % 2 else 0.0, generator=generator)
    return torch.utils.data.TensorDataset(images, hidden, scored)


def make_images(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """Random float64 images alone: CompletionTask draws their masks while training."""
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.rand(count, *IMAGE_SHAPE, generator=generator, dtype=torch.float64))


def random_mask_run() -> dict[str, torch.Tensor]:
    """Two steps of CompletionTask (masks drawn per step from the global RNG) on 8 images."""
    model = make_model("direct")
    fit(model, CompletionTask(0.5), make_images(8, seed=5), config=step_config(None))
    return model.state_dict()


def make_model(grad: str) -> ImageET:
    if grad == "implicit":
        integration = Integration(
            solver=Adaptive(rtol=1e-7, atol=1e-8), gradient="implicit", stop=SteadyState(2e-3), t1=200.0, max_steps=2000
        )
    else:
        integration = Integration(solver=Fixed("rk4", step_size=0.1), gradient=grad, t1=0.3, max_steps=2000)
    torch.manual_seed(0)
    return ImageET(IMAGE_SHAPE, PATCH, dim=8, heads=2, head_dim=4, memories=16, dynamics=integration).double()


def _steps(grad: str) -> dict[str, int]:
    return {"max_train_batches": 1} if grad == "implicit" else {}


def step_config(clip: float | None, **changes: Any) -> TrainConfig:
    values = dict(
        epochs=1, batch_size=4, lr=1e-2, warmup=0, grad_clip=clip, device="cpu", progress=False, max_train_batches=2
    )
    return TrainConfig(**{**values, **changes})


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def resume_config(out: Path, **changes: Any) -> TrainConfig:
    # min_lr_ratio=1: a constant learning rate, so the interrupted and the uninterrupted runs share a schedule
    values = dict(
        epochs=2,
        batch_size=4,
        lr=1e-2,
        warmup=0,
        min_lr_ratio=1.0,
        grad_clip=1e-2,
        device="cpu",
        progress=False,
        out_dir=str(out),
        resume=True,
        eval_batch_size=3,
    )
    return TrainConfig(**{**values, **changes})


# ----------------------------------------------------------------------------------------------- the worker
def worker(scenario: str, out: Path) -> None:
    """One rank of a torchrun launch (this file run as a script)."""
    timeout = datetime.timedelta(seconds=STALL_TIMEOUT if scenario == "stall" else 30)
    with distributed.session(True, device="cuda" if scenario == "cuda" else "cpu", timeout=timeout) as device:
        if scenario == "cuda":  # NCCL, one GPU per rank
            torch.save(_step_results(STEP_CASES[:4], device), out / f"rank{distributed.rank()}.pt")
        elif scenario == "train":  # one launch for two tests (each launch costs seconds of start-up)
            torch.save(_step_results(STEP_CASES, device), out / f"rank{distributed.rank()}.pt")
            torch.save(random_mask_run(), out / f"masks_rank{distributed.rank()}.pt")
            try:  # a crash of every rank at the first step of epoch 2
                fit(
                    make_model("direct"),
                    FixedMaskTask(fail_at=3),
                    make_data(12, seed=2),
                    make_data(5, seed=3),
                    resume_config(out / "interrupted"),
                )
            except _Interrupted:
                pass
        elif scenario in ("fail", "stall"):  # rank 1 raises (or hangs) at its second step
            fit(
                make_model("direct"),
                FixedMaskTask(fail_rank=1, fail_at=1, stall=scenario == "stall"),
                make_data(16, seed=4),
                config=step_config(None, max_train_batches=None),
            )
        else:
            raise ValueError(f"unknown scenario {scenario!r}")


def _step_results(cases: list[tuple[str, str, float | None]], device: torch.device) -> dict[str, Any]:
    results = {}
    for name, grad, clip in cases:
        model = make_model(grad)
        fit(model, FixedMaskTask(), make_data(8, seed=1), config=step_config(clip, device=str(device), **_steps(grad)))
        model.cpu()
        results[name] = {"params": model.state_dict(), "grads": grads_of(model)}
    return results


def torchrun(scenario: str, out: Path, nproc: int = 2, program: list[str] | None = None) -> subprocess.CompletedProcess:
    """Launch ``nproc`` workers on 127.0.0.1; kill the process group if it outlives ``WORKER_TIMEOUT``.

    The workers run this file with ``scenario out``, or ``program`` (the arguments after torchrun's own).
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={distributed.free_port()}",
        *(program or [str(HERE), scenario, str(out)]),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun {scenario} did not finish within {WORKER_TIMEOUT} s (killed):\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def _mean_of_shard_gradients(data: torch.utils.data.TensorDataset) -> dict[str, torch.Tensor | None]:
    """The mean over 2 ranks of the implicit gradient of each rank's first batch, computed in this process."""
    from et_ode.training.train import _EpochSampler

    total: dict[str, torch.Tensor | None] = {}
    for r in range(2):
        model = make_model("implicit")
        indices = _EpochSampler(len(data), seed=0, rank=r, world=2).indices()[:2]
        FixedMaskTask().loss(model, data[indices])[0].backward()
        for key, grad in grads_of(model).items():
            total[key] = None if grad is None else grad / 2 + (total.get(key) if r else 0)
    assert total["encoder.weight"] is None and total["block.attention.WK"] is not None
    return total


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> float:
    """Largest relative difference (scaled by the largest entry of ``expected``)."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


# ----------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a 2-process launch of the "train" scenario."""
    out = tmp_path_factory.mktemp("ddp")
    run = torchrun("train", out)
    assert run.returncode == 0, run.stdout[-4000:]
    return out


def test_two_processes_step_like_one_process_on_the_global_batch(trained: Path) -> None:
    ranks = [torch.load(trained / f"rank{r}.pt", weights_only=False) for r in range(2)]
    data = make_data(8, seed=1)
    for name, grad, clip in STEP_CASES:
        model = make_model(grad)
        fit(model, FixedMaskTask(), data, config=step_config(clip, **_steps(grad)))
        expected, expected_grads = model.state_dict(), grads_of(model)
        if grad == "implicit":  # the steady state is reached when every sample of a batch converged: compare with
            expected_grads = _mean_of_shard_gradients(data)  # the mean of the ranks' own batches' gradients
        for r, result in enumerate(ranks):
            for key, value in expected.items():
                assert torch.equal(result[name]["params"][key], ranks[0][name]["params"][key]), (name, key, r)
                if grad != "implicit":
                    assert _close(result[name]["params"][key], value, 1e-10) < 1e-10, (name, key, r)
            for key, value in expected_grads.items():
                got = result[name]["grads"][key]
                assert (got is None) == (value is None), (name, key, r)  # implicit: x0 makers get no gradient
                if value is not None:
                    assert _close(got, value, 1e-10) < 1e-10, (name, key, r)
    # the comparison can fail: one process on half of each global batch takes another step
    half = make_model("direct")
    fit(half, FixedMaskTask(), torch.utils.data.Subset(data, range(0, 8, 2)), config=step_config(None, batch_size=2))
    assert _close(grads_of(half)["block.hopfield.xi"], ranks[0]["direct"]["grads"]["block.hopfield.xi"], 0) > 1e-3


def test_random_masks_of_two_processes_are_those_of_one_process(trained: Path) -> None:
    expected = random_mask_run()  # one process on the same global batches
    for r in range(2):
        result = torch.load(trained / f"masks_rank{r}.pt", weights_only=False)
        for key, value in expected.items():
            assert _close(result[key], value, 1e-10) < 1e-10, (key, r)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL data parallelism needs 2 GPUs")
def test_two_gpus_with_nccl_step_like_one_cpu_process(tmp_path: Path) -> None:
    run = torchrun("cuda", tmp_path)
    assert run.returncode == 0, run.stdout[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, grad, clip in STEP_CASES[:4]:
        model = make_model(grad)
        fit(model, FixedMaskTask(), make_data(8, seed=1), config=step_config(clip))
        for r, result in enumerate(ranks):
            for key, value in model.state_dict().items():
                assert torch.equal(result[name]["params"][key], ranks[0][name]["params"][key]), (name, key, r)
                assert _close(result[name]["params"][key], value, 1e-9) < 1e-9, (name, key, r)
            for key, value in grads_of(model).items():
                assert _close(result[name]["grads"][key], value, 1e-9) < 1e-9, (name, key, r)


def test_interrupted_two_process_run_resumes_on_one_process(trained: Path, tmp_path: Path) -> None:
    shutil.copytree(trained / "interrupted", tmp_path, dirs_exist_ok=True)
    state = load_checkpoint(tmp_path / CHECKPOINT_NAME, required=("model", "epoch", "world_size"))
    assert (state["epoch"], state["batch"], state["step"], state["world_size"]) == (1, 0, 3, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME, METRICS_NAME]  # rank 0 wrote, once
    assert len((tmp_path / METRICS_NAME).read_text().splitlines()) == 1

    train, val = make_data(12, seed=2), make_data(5, seed=3)
    resumed = make_model("direct")
    history = fit(resumed, FixedMaskTask(), train, val, resume_config(tmp_path))
    reference = make_model("direct")
    expected = fit(reference, FixedMaskTask(), train, val, resume_config(tmp_path / "reference"))
    for key, value in reference.state_dict().items():
        assert _close(resumed.state_dict()[key], value, 1e-10) < 1e-10, key
    assert [r["epoch"] for r in history.records] == [1, 2]
    for got, want in zip(history.records, expected.records):  # epoch 1: metrics averaged over the 2 ranks
        for key in ("train_loss", "train_mse", "val_mse", "step"):
            assert got[key] == pytest.approx(want[key], rel=1e-10), key


def test_a_failing_rank_stops_the_run_with_its_error(tmp_path: Path) -> None:
    run = torchrun("fail", tmp_path)
    assert run.returncode != 0
    assert "rank 1 failed on purpose at step 1" in run.stdout, run.stdout[-4000:]


@pytest.mark.slow
def test_a_stalled_rank_stops_the_run_after_the_timeout(tmp_path: Path) -> None:
    run = torchrun("stall", tmp_path)  # rank 0's gradient averaging times out and its error ends the launch
    assert run.returncode != 0
    assert "rank 1 stalls at step 1" in run.stdout, run.stdout[-4000:]
    assert "timed out" in run.stdout.lower() or "timeout" in run.stdout.lower(), run.stdout[-4000:]


@pytest.mark.slow
def test_cli_trains_under_torchrun_and_resumes_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from et_ode.cli import main

    out = tmp_path / "run"
    options = [
        "train",
        "image",
        "--data",
        "digits",
        "--train-limit",
        "64",
        "--test-limit",
        "16",
        "--val-size",
        "8",
        "--batch-size",
        "16",
        "--solver",
        "rk4",
        "--step",
        "0.2",
        "--t1",
        "0.4",
        "--gradient",
        "adjoint",
        "--no-baselines",
        "--no-progress",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    run = torchrun("cli", out, program=["-m", "et_ode.cli", *options, "--epochs", "1", "--distributed"])
    assert run.returncode == 0, run.stdout[-4000:]
    assert run.stdout.count('"train_seconds"') == 1  # the summary is printed by rank 0 alone
    state = load_checkpoint(out / CHECKPOINT_NAME, required=("world_size",))
    assert (state["epoch"], state["step"], state["world_size"]) == (1, 4, 2)  # 64 images, global batch 16
    with pytest.warns(UserWarning, match="stretched"):  # one more epoch than the checkpoint's run planned
        assert main([*options, "--epochs", "2", "--resume"]) == 0
    records = [json.loads(line) for line in (out / METRICS_NAME).read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 4), (2, 8)]
    for name in distributed.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert main([*options, "--epochs", "1", "--distributed"]) == 2  # without torchrun: an error, not one process
    assert "torchrun --nproc_per_node" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- in one process
def test_detect_reads_the_torchrun_environment() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
    assert distributed.detect(env) == distributed.DistributedEnv(1, 4, 1, "10.0.0.2", 29500)
    assert distributed.detect({}) is None
    with pytest.raises(ValueError, match="MASTER_PORT missing"):
        distributed.detect({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(ValueError, match="RANK=4, WORLD_SIZE=4"):
        distributed.detect({**env, "RANK": "4"})
    with pytest.raises(ValueError, match="must be integers"):
        distributed.detect({**env, "WORLD_SIZE": "two"})


def test_session_requires_the_environment_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in distributed.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node"):
        with distributed.session(True):
            pass
    with distributed.session(None, device="cpu") as device:  # no environment: one process
        assert device == torch.device("cpu") and distributed.world_size() == 1


def test_fit_refuses_a_torchrun_environment_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="rank 1 of 2 .*distributed.session"):  # not two independent runs
        fit(make_model("direct"), FixedMaskTask(), make_data(4, seed=1), config=step_config(None))


def test_single_process_group_and_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(distributed.free_port()),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with distributed.session(None, device="cpu", timeout=datetime.timedelta(seconds=20)) as device:
        assert torch.distributed.is_initialized() and distributed.world_size() == 1 and distributed.is_main()
        assert device == torch.device("cpu")
        assert distributed.reduce_mean({"a": 2.0}, weight=3) == {"a": 2.0}
        assert distributed.broadcast_object({"x": 1}) == {"x": 1}
    assert not torch.distributed.is_initialized()


def test_shard_splits_without_padding() -> None:
    for size in (0, 1, 5, 12):
        for world in (1, 2, 3, 5):
            parts = [distributed.shard(size, r, world) for r in range(world)]
            assert [i for part in parts for i in part] == list(range(size))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="rank=2, world=2"):
        distributed.shard(4, 2, 2)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
