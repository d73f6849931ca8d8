"""Every picture function writes a PNG of figsize * dpi pixels, for batched and single inputs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import torch

from et_ode import ETField, solve
from et_ode.analysis.plots import (
    plot_attention,
    plot_convergence,
    plot_energy_slice,
    plot_film_strip,
    plot_trajectories,
)

from .conftest import random_model


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
    figure = plot_convergence(solution, field, path=tmp_path / "c.png", figsize=(12, 4))
    check_png(tmp_path / "c.png", figure)
    assert tuple(figure.get_size_inches()) == (12, 4)
    for dims, color in ((2, "time"), (3, "energy")):
        figure = plot_trajectories(solution, sample=0, dims=dims, color_by=color, path=tmp_path / f"t{dims}.png")
        check_png(tmp_path / f"t{dims}.png", figure)
    figure = plot_attention(field, solution, times=[0.0, 5.0], path=tmp_path / "a.png", dpi=80)
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
    figure = plot_film_strip(frames, torch.linspace(0, 1, shape[0]), target=torch.rand(image_shape),
                             masked=torch.rand(image_shape), path=tmp_path / "f.png")
    check_png(tmp_path / "f.png", figure)
    assert len([ax for ax in figure.axes if ax.get_title()]) == shape[0] + 2
    assert figure.axes[0].get_title() == "masked input" and figure.axes[shape[0] + 1].get_title() == "ground truth"


def test_bad_inputs(solved, tmp_path: Path):
    field, batched, _ = solved
    with pytest.raises(ValueError, match="dims"):
        plot_trajectories(batched, dims=4)
    with pytest.raises(ValueError, match="sample"):
        plot_trajectories(batched, sample=5)
    with pytest.raises(ValueError, match="times"):
        plot_film_strip(torch.rand(3, 8, 8), [0.0, 1.0])
    with pytest.raises(ValueError, match="channels"):
        plot_film_strip(torch.rand(3, 2, 8, 8), [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="head"):
        plot_attention(field, batched, head=7)
    with pytest.raises(ValueError, match="png"):
        plot_convergence(batched, field, path=tmp_path / "c.jpg")
    with pytest.raises(ValueError, match="x_fixed"):
        plot_energy_slice(field, torch.zeros(3, 4))
