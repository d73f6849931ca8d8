"""The image ET: patches, masks, tokens, decoding, gradient modes, and the baselines."""

import pytest
import torch

from et_ode import Adaptive, EulerET, Integration
from et_ode.models import (
    CompletionTask,
    ImageET,
    evaluate_completion,
    fixed_mask_set,
    masked_mse,
    patchify,
    random_masks,
    unpatchify,
)
from et_ode.tasks.baselines import MeanImage, NearestNeighbour

EULER = Integration(solver=EulerET(0.1, 4), gradient="direct")


def test_patchify_matches_slicing_and_inverts():
    images = torch.randn(2, 3, 6, 9)
    patches = patchify(images, 3)
    assert patches.shape == (2, 6, 27)
    # patch (row 1, column 2) is the slice [3:6, 6:9], flattened channel first
    assert torch.equal(patches[1, 1 * 3 + 2], images[1, :, 3:6, 6:9].reshape(-1))
    assert torch.equal(unpatchify(patches, 3, (3, 6, 9)), images)


def test_patchify_rejects_indivisible_size():
    with pytest.raises(ValueError, match="not divisible by the patch size 4"):
        patchify(torch.zeros(1, 1, 6, 8), 4)


@pytest.mark.parametrize("ratio, visible", [(0.5, 0.0), (100 / 196, 0.1), (0.25, 0.5)])
def test_random_masks_counts(ratio, visible):
    n = 196 if ratio == 100 / 196 else 16
    hidden, scored = random_masks(50, n, ratio, visible_fraction=visible, generator=torch.Generator().manual_seed(0))
    n_scored = round(ratio * n)
    n_visible = round(visible * n_scored)
    assert (scored.sum(1) == n_scored).all()
    assert (hidden.sum(1) == n_scored - n_visible).all()
    assert not (hidden & ~scored).any()  # hidden patches are scored
    assert hidden.float().mean(0).min() > 0  # every position gets hidden sometimes
    if ratio == 100 / 196:
        assert n_scored == 100 and n_visible == 10  # the paper's scheme


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.2, 1.5])
def test_mask_ratio_outside_unit_interval(ratio):
    with pytest.raises(ValueError, match=r"mask ratio must be in \(0, 1\)"):
        random_masks(2, 16, ratio)
    with pytest.raises(ValueError, match=r"mask ratio must be in \(0, 1\)"):
        CompletionTask(ratio)


def test_tokens_mask_position_and_cls():
    torch.manual_seed(0)
    model = ImageET((2, 4, 4), 2, 8, 2, 4, cls_token=True, dynamics=EULER)
    images = torch.rand(3, 2, 4, 4)
    hidden = torch.tensor([[True, False, False, True]] * 3)
    x0 = model.tokens(images, hidden)
    assert x0.shape == (3, 5, 8)
    assert torch.allclose(x0[:, 0], model.cls.expand(3, 8))
    expected_visible = model.encoder(patchify(images, 2)[:, 1]) + model.position[1]
    assert torch.allclose(x0[:, 2], expected_visible)
    assert torch.allclose(x0[:, 1], (model.mask_token + model.position[0]).expand(3, 8))
    # the CLS token is not decoded
    assert model.decode(torch.randn(3, 5, 8)).shape == (3, 4, 8)


def test_wrong_image_size_and_mask_shape():
    model = ImageET((1, 8, 8), 2, 8, 2, 4, dynamics=EULER)
    hidden = torch.zeros(2, 16, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"images must have shape \(B, 1, 8, 8\).*got \(2, 1, 8, 6\)"):
        model(torch.rand(2, 1, 8, 6), hidden)
    with pytest.raises(ValueError, match=r"hidden must have shape \(2, 16\)"):
        model(torch.rand(2, 1, 8, 8), hidden[:, :15])
    with pytest.raises(TypeError, match="hidden must be a boolean"):
        model(torch.rand(2, 1, 8, 8), hidden.float())
    with pytest.raises(ValueError, match="patch must be a positive integer dividing"):
        ImageET((1, 8, 8), 3, 8, 2, 4)


def test_forward_runs_the_solver_and_decodes_g():
    torch.manual_seed(1)
    model = ImageET((1, 4, 4), 2, 8, 2, 4, dynamics=EULER)
    images, (hidden, _) = torch.rand(2, 1, 4, 4), random_masks(2, 4, 0.5)
    out = model(images, hidden)
    assert out.solution.stats.nfe_forward == 4
    # independent re-computation: four explicit Euler steps x <- x - alpha dE/dg
    x = model.tokens(images, hidden)
    for _ in range(4):
        g = model.block.neuron(x)
        x = x - 0.1 * model.block.dE_dg(g)
    assert torch.allclose(out.patches, model.decoder(model.block.neuron(x)), atol=1e-5)


def test_masked_mse_counts_only_scored_pixels():
    pred, target = torch.zeros(2, 3, 4), torch.ones(2, 3, 4)
    target[0, 1] = 3.0
    scored = torch.tensor([[False, True, False], [True, False, False]])
    expected = (4 * 9 + 4 * 1) / 8
    assert masked_mse(pred, target, scored).item() == pytest.approx(expected)


def test_adjoint_gradient_matches_direct():
    torch.manual_seed(2)
    model = ImageET((1, 4, 4), 2, 8, 2, 4, hopfield="softplus").double()
    images, (hidden, scored) = torch.rand(3, 1, 4, 4, dtype=torch.float64), random_masks(3, 4, 0.5)
    grads = []
    for grad in ("direct", "adjoint"):
        integration = Integration(solver=Adaptive(rtol=1e-7, atol=1e-8), gradient=grad, t1=0.1)
        model.zero_grad()
        loss = masked_mse(model(images, hidden, dynamics=integration).patches, patchify(images, 2), scored)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_config_round_trip():
    model = ImageET((3, 8, 8), 4, 16, 2, 4, memories=20, cls_token=True, tau=2.0, dynamics=EULER)
    rebuilt = ImageET.from_config(model.config())
    rebuilt.load_state_dict(model.state_dict())
    assert rebuilt.config() == model.config()


def test_film_starts_at_mask_tokens_and_ends_at_forward():
    torch.manual_seed(3)
    model = ImageET((1, 4, 4), 2, 8, 2, 4, tau=5.0, dynamics=Integration(solver=Adaptive(rtol=1e-6, atol=1e-7), t1=0.6))
    images, (hidden, _) = torch.rand(2, 1, 4, 4), random_masks(2, 4, 0.5)
    frames, solution = model.film(images, hidden, t=[0.0, 0.3, 0.6], keep_visible=False)
    assert solution.stats.nfe_forward < 200
    assert frames.shape == (3, 2, 1, 4, 4)
    first = unpatchify(model.decode(model.block.neuron(model.tokens(images, hidden))), 2, (1, 4, 4)).clamp(0, 1)
    assert torch.allclose(frames[0], first, atol=1e-6)
    last = unpatchify(model(images, hidden).patches, 2, (1, 4, 4)).clamp(0, 1)
    assert torch.allclose(frames[-1], last, atol=1e-4)
    assert (solution.energies[1:] <= solution.energies[:-1]).all()
    pasted, _ = model.film(images, hidden, t=[0.0, 0.3, 0.6])
    visible = unpatchify((~hidden)[..., None].expand(-1, -1, 4).float(), 2, (1, 4, 4)).bool()
    assert torch.equal(pasted[:, visible], images[None].expand(3, -1, -1, -1, -1)[:, visible])
    assert torch.equal(pasted[:, ~visible], frames[:, ~visible])


def test_mean_baseline_is_the_training_mean():
    train = torch.rand(10, 1, 4, 4)
    test = fixed_mask_set(torch.rand(6, 1, 4, 4), 4, 0.5, seed=0)
    images, hidden, scored = test.tensors
    metrics = evaluate_completion(MeanImage(train, 2), [test.tensors])
    mean = train.mean(0)
    # loop over the scored patches one by one, with explicit slices
    errors = []
    for i in range(6):
        for p in range(4):
            if scored[i, p]:
                r, c = divmod(p, 2)
                errors.append(
                    (images[i, :, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2] - mean[:, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2])
                    .square()
                    .flatten()
                )
    assert metrics["mse"] == pytest.approx(torch.cat(errors).mean().item(), rel=1e-6)


def test_nearest_neighbour_matches_brute_force():
    torch.manual_seed(4)
    train = torch.rand(40, 1, 4, 4)
    images = torch.rand(7, 1, 4, 4)
    hidden, _ = random_masks(7, 4, 0.5, generator=torch.Generator().manual_seed(1))
    guess = NearestNeighbour(train, 2, chunk=16)(images, hidden)
    for i in range(7):
        visible = (~hidden[i]).repeat_interleave(4)
        distances = [
            (patchify(images[i : i + 1], 2) - patchify(train[j : j + 1], 2)).flatten()[visible].square().sum()
            for j in range(40)
        ]
        best = int(torch.stack(distances).argmin())
        assert int(guess.extra["index"][i]) == best
        assert torch.equal(guess.patches[i], patchify(train[best : best + 1], 2)[0])
