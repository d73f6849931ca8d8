"""Training the image model at the attractor: ImageET(..., dynamics=AttractorReadout())."""

import json

import pytest
import torch

import et_ode
from et_ode import AttractorReadout, Integration
from et_ode.cli import build_parser
from et_ode.models.image import ImageET, masked_mse, patchify, random_masks
from et_ode.tasks.image import ImageRunConfig, initialise_from, load_trained, train_image
from et_ode.training.train import TrainConfig
from tests.fd_reference import directional_derivative

AT_ATTRACTOR = AttractorReadout(tol=1e-10)


def small_model(seed=0, dynamics=AT_ATTRACTOR):
    torch.manual_seed(seed)
    model = ImageET((1, 4, 4), 2, 6, 2, 3, 12, hopfield="softmax", tau=0.7, dynamics=dynamics).double()
    with torch.no_grad():
        model.block.neuron.gamma.fill_(1.3)
        model.block.attention.beta.mul_(0.8)
    return model


def batch(seed=0, size=3):
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(size, 1, 4, 4, generator=generator, dtype=torch.float64)
    hidden, scored = random_masks(size, 4, 0.5, generator=generator)
    return images, hidden, scored


def loss_of(model, images, hidden, scored):
    return masked_mse(model(images, hidden).patches, patchify(images, model.patch), scored)


def test_gradient_at_the_attractor_equals_finite_differences_of_the_whole_model():
    """The whole pipeline (tokens -> find_attractor -> decoder -> masked MSE) along a random direction of every
    parameter: autograd's implicit gradient (no gradient for encoder, positions, MASK token) against central
    differences of the loss, recomputing the attractor each time."""
    model = small_model()
    images, hidden, scored = batch()
    loss = loss_of(model, images, hidden, scored)
    loss.backward()
    for name in ("encoder.weight", "encoder.bias", "position", "mask_token"):
        assert dict(model.named_parameters())[name].grad is None, name
    generator = torch.Generator().manual_seed(5)
    analytic, reference = 0.0, 0.0
    for parameter in model.parameters():
        direction = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
        grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
        analytic += float((grad * direction).sum())
        reference += directional_derivative(lambda: loss_of(model, images, hidden, scored), parameter, direction, h=1e-5)
    assert abs(analytic - reference) < 1e-5 * max(abs(reference), 1e-3)
    # the energy and the decoder both learn
    assert float(model.block.attention.WK.grad.abs().max()) > 0 and float(model.decoder.weight.grad.abs().max()) > 0
    assert float(model.block.hopfield.xi.grad.abs().max()) > 0


def test_training_at_the_attractor_lowers_the_loss_and_reads_a_certified_point():
    model = small_model(seed=1, dynamics=AttractorReadout())
    images, hidden, scored = batch(seed=1, size=8)
    optimizer = torch.optim.Adam([p for p in model.parameters()], lr=2e-2)
    losses, all_certified = [], 0
    for _ in range(12):
        optimizer.zero_grad(set_to_none=True)
        out = model(images, hidden)
        # steady state: every sample certified; a sample whose flow creeps past a saddle may stay unsettled
        all_certified += out.solution.status is et_ode.Status.STEADY_STATE
        loss = masked_mse(out.patches, patchify(images, model.patch), scored)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert all_certified >= 10
    assert model.encoder.weight.grad is None  # fixed under this scheme: no gradient through an attractor


def test_uncertified_samples_give_no_gradient_instead_of_failing():
    model = small_model(dynamics=AttractorReadout(max_iter=1, tol=1e-14))
    images, hidden, scored = batch()
    out = model(images, hidden)
    assert out.solution.status is et_ode.Status.REACHED_END
    masked_mse(out.patches, patchify(images, model.patch), scored).backward()
    assert float(model.block.attention.WK.grad.abs().max()) == 0  # the attractor's path carries nothing
    assert float(model.decoder.weight.grad.abs().max()) > 0


def test_readout_settings_are_validated_and_saved_with_the_model():
    with pytest.raises(ValueError, match="AttractorReadout.handoff"):
        AttractorReadout(handoff=0)
    with pytest.raises(ValueError, match="AttractorReadout.max_iter"):
        AttractorReadout(max_iter=0)
    with pytest.raises(TypeError, match="^dynamics must be an et_ode.Integration or an et_ode.AttractorReadout"):
        ImageET((1, 4, 4), 2, 6, 2, 3, dynamics="attractor")
    with pytest.raises(TypeError, match="^attractor must be an et_ode.AttractorReadout or None"):
        ImageRunConfig(attractor="yes")
    model = small_model()
    config = model.config()
    assert config["dynamics"]["kind"] == "AttractorReadout" and config["dynamics"]["tol"] == 1e-10
    rebuilt = ImageET.from_config(json.loads(json.dumps(config)))
    assert rebuilt.dynamics == AT_ATTRACTOR
    euler = ImageET.from_config(ImageET((1, 4, 4), 2, 6, 2, 3, dynamics=Integration(et_ode.EulerET(0.1, 3))).config())
    assert euler.dynamics == Integration(et_ode.EulerET(0.1, 3))
    with pytest.raises(ValueError, match="'dynamics' cannot be rebuilt"):
        ImageET.from_config({**config, "dynamics": {"kind": "Magic"}})
    images, hidden, _ = batch()
    frames, solution = model.film(images, hidden, torch.linspace(0, 1, 3))  # a film follows the flow: Integration()
    assert frames.shape[0] == 3 and solution.stats.t_final == 1.0


def test_cli_flag_and_a_tiny_run_keep_the_setting_through_the_checkpoint(tmp_path):
    args = build_parser().parse_args(["train", "image", "--attractor", "--out", str(tmp_path / "x")])
    assert ImageRunConfig().attractor is None and ImageRunConfig().dynamics == ImageRunConfig().integration
    assert args.attractor is True
    config = ImageRunConfig(
        data="digits",
        train_limit=32,
        test_limit=16,
        val_size=8,
        patch=4,
        dim=8,
        heads=2,
        head_dim=4,
        integration=Integration(solver=et_ode.EulerET(0.1, 4)),
        attractor=AttractorReadout(),
        train=TrainConfig(epochs=1, batch_size=16, lr=1e-2, progress=False, device="cpu"),
        baselines=False,
        energy_check=True,
        tokens=2,
    )
    results = train_image(config, tmp_path / "run")
    assert results["model"]["t_final"] == float("inf") and results["energy_descent"]["exceptions"] == 0
    model, run = load_trained(tmp_path / "run" / "checkpoint.safetensors")
    assert model.dynamics == AttractorReadout() and run.integration == config.integration
    assert run.attractor == config.attractor and run.dynamics == model.dynamics
    assert ImageRunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    # a warm start copies the weights; a different architecture is refused, naming init
    fresh = ImageET((1, 8, 8), 4, 8, 2, 4)
    initialise_from(fresh, tmp_path / "run" / "checkpoint.safetensors")
    torch.testing.assert_close(fresh.encoder.weight, model.encoder.weight)
    with pytest.raises(ValueError, match="init: .*dim"):
        initialise_from(ImageET((1, 8, 8), 4, 16, 2, 4), tmp_path / "run" / "checkpoint.safetensors")
