"""Every picture function writes a PNG of figsize * dpi pixels, for batched and single inputs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import torch

from et_ode import Adaptive, ETField, solve
from et_ode.analysis.plots import (
    dense_trajectory,
    energy_slice,
    plot_attention,
    plot_convergence,
    plot_energy_slice,
    plot_film_strip,
    plot_trajectories,
)
from et_ode.analysis.stability import find_fixed_point
from tests.conftest import random_model


@pytest.fixture(scope="module")
def solved():
    model = random_model(seed=5)
    field = ETField(model)
    x0 = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    batched = solve(field, x0, torch.linspace(0, 10, 21))
    single = solve(field, x0[0], torch.linspace(0, 10, 21))  # no batch dimension
    return field, batched, single


def check_png(path: Path, figure, dpi: int = 100) -> None:
    assert path.is_file() and path.stat().st_size > 5000
    image = matplotlib.image.imread(path)
    width, height = figure.get_size_inches() * dpi
    assert image.shape[:2] == (round(height), round(width))
    assert float(image[..., :3].std()) > 0.05  # not a blank canvas


@pytest.mark.parametrize("which", ["batched", "single"])
def test_solution_pictures(solved, tmp_path: Path, which: str):
    field, batched, single = solved
    solution = batched if which == "batched" else single
    figure = plot_convergence(solution, path=tmp_path / "c.png", figsize=(12, 4))
    check_png(tmp_path / "c.png", figure)
    assert tuple(figure.get_size_inches()) == (12, 4)
    for dims, color in ((2, "time"), (3, "energy")):
        figure = plot_trajectories(solution, sample=0, dims=dims, color_by=color, path=tmp_path / f"t{dims}.png")
        check_png(tmp_path / f"t{dims}.png", figure)
    figure = plot_attention(solution, t=[0.0, 5.0], path=tmp_path / "a.png", dpi=80)
    check_png(tmp_path / "a.png", figure, dpi=80)
    x_fixed = solution.x.detach()
    figure = plot_energy_slice(field, x_fixed, trajectories=solution, resolution=15, path=tmp_path / "s.png")
    check_png(tmp_path / "s.png", figure)
    figure = plot_energy_slice(field, x_fixed, resolution=9, span=0.5, path=tmp_path / "s2.png")
    check_png(tmp_path / "s2.png", figure)


def test_energy_slice_values_are_the_energy_at_the_centre(solved):
    field, batched, _ = solved
    x_fixed = batched.x.detach()
    figure = plot_energy_slice(field, x_fixed, sample=1, resolution=5, span=0.3)
    title = figure.axes[0].get_legend().get_texts()[-1].get_text()
    expected = float(field.model.energy(x_fixed[1]).detach())
    assert f"{expected:.4g}" in title


@pytest.mark.parametrize("shape", [(4, 8, 8), (4, 1, 8, 8), (4, 3, 8, 8), (1, 8, 8)])
def test_film_strip(tmp_path: Path, shape: tuple[int, ...]):
    frames = torch.rand(shape)
    image_shape = shape[1:] if len(shape) == 4 else shape[1:]
    figure = plot_film_strip(
        frames,
        torch.linspace(0, 1, shape[0]),
        target=torch.rand(image_shape),
        masked=torch.rand(image_shape),
        path=tmp_path / "f.png",
    )
    check_png(tmp_path / "f.png", figure)
    assert len([ax for ax in figure.axes if ax.get_title()]) == shape[0] + 2
    assert figure.axes[0].get_title() == "masked input" and figure.axes[shape[0] + 1].get_title() == "ground truth"


def test_bad_inputs(solved, tmp_path: Path):
    field, batched, _ = solved
    with pytest.raises(ValueError, match="dims"):
        plot_trajectories(batched, dims=4)
    with pytest.raises(ValueError, match="sample"):
        plot_trajectories(batched, sample=5)
    with pytest.raises(ValueError, match="^ts must have one time per frame"):
        plot_film_strip(torch.rand(3, 8, 8), [0.0, 1.0])
    with pytest.raises(ValueError, match="channels"):
        plot_film_strip(torch.rand(3, 2, 8, 8), [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="head"):
        plot_attention(batched, head=7)
    with pytest.raises(ValueError, match="png"):
        plot_convergence(batched, path=tmp_path / "c.jpg")
    with pytest.raises(ValueError, match="x_fixed"):
        plot_energy_slice(field, torch.zeros(3, 4))


def test_energy_slice_holds_the_start_and_the_end(solved):
    """The plane passes through g*, the trajectory's start and its end: the slice's energy under the start and
    the end is the true energy there (a plane of principal directions through g* missed 62-84% of g - g*)."""
    field, batched, _ = solved
    x_fixed = find_fixed_point(field, batched.x.detach(), tol=1e-8).x
    states = batched.xs[:, 1]
    plane = energy_slice(field, x_fixed[1], trajectory=states)
    assert torch.allclose((plane.u * plane.v).sum(), torch.zeros((), dtype=torch.float64), atol=1e-12)
    model = field.model
    for k in (0, -1):
        a, b = plane.coords[k]
        assert float(plane.off_plane[k]) < 1e-10 * float(plane.distance[k])
        # the retraction keeps g*'s per-token radius, which differs from the state's by O(eps / sigma^2)
        expected = model.energy(states[k]).detach()
        assert float(plane.energy(a, b)) == pytest.approx(float(expected), rel=1e-4)
        assert torch.allclose(plane.points(a, b), model.neuron(states[k]), atol=1e-4)
    assert float(plane.off_plane.max()) > 0  # the middle leaves the plane ...
    figure = plot_energy_slice(field, x_fixed, trajectories=batched, sample=1, resolution=7)
    texts = " ".join(t.get_text() for t in figure.axes[0].texts)
    assert "leaves it by at most" in texts  # ... and the picture says by how much
    assert f"{float(plane.off_plane.max()):.3g}" in texts


def test_dense_trajectory_starts_at_t0_and_resolves_the_early_motion(solved):
    field, batched, _ = solved
    times, states = dense_trajectory(batched, points=60)
    assert float(times[0]) == 0.0 and float(times[-1]) == pytest.approx(10.0) and len(times) == 60
    assert torch.equal(states[0], batched.xs[0])
    # an independent tight solve to the same times agrees (the dense path is the ODE's, not an interpolation)
    reference = solve(field, batched.xs[0], times, solver=Adaptive(rtol=1e-11, atol=1e-13))
    neuron = field.model.neuron
    assert torch.allclose(neuron(states), neuron(reference.xs.detach()), atol=1e-5)  # ReLU kinks: ~2e-6
    # the first saved interval (0 to 0.5) holds many dense points: the early motion is no longer one chord
    assert int((times <= float(batched.ts[1])).sum()) >= 30
    figure = plot_trajectories(batched, dense=60)
    segments = figure.axes[0].collections[0].get_segments()
    assert len(segments) == 59
