"""Pictures a reader can read: log-axis tick labels that do not overlap, a film strip wrapped into rows, hidden
patches in a colour no grey level has."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from et_ode import ETField, solve
from et_ode.analysis.plots import plot_convergence, plot_film_strip
from et_ode.tasks.film import MASK_COLOUR, masked_picture
from tests.conftest import random_model


def _labels(figure, axis):
    FigureCanvasAgg(figure).draw()
    renderer = figure.canvas.get_renderer()
    ticks = [
        t for t in axis.get_major_ticks() + axis.get_minor_ticks() if t.label1.get_visible() and t.label1.get_text().strip()
    ]
    inside = [
        t for t in ticks if axis.axes.get_window_extent().expanded(1.5, 1.5).overlaps(t.label1.get_window_extent(renderer))
    ]
    return [t.label1.get_window_extent(renderer) for t in inside], [t.label1.get_text() for t in inside]


@pytest.mark.parametrize("t0,t1", [(0.025, 0.6), (0.01, 50.0), (1.0, 3.0)])
def test_log_axis_labels_of_the_convergence_picture_do_not_overlap(t0, t1):
    model = random_model(seed=1)
    x0 = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    times = torch.cat(
        [torch.zeros(1, dtype=torch.float64), torch.logspace(np.log10(t0), np.log10(t1), 24, dtype=torch.float64)]
    )
    figure = plot_convergence(solve(ETField(model), x0, times), figsize=(15.0, 4.5))
    log_axes = [ax for ax in figure.axes if ax.get_xscale() == "log"]
    assert log_axes
    for axis in (log_axes[0].xaxis, log_axes[0].yaxis):
        boxes, texts = _labels(figure, axis)
        assert 2 <= len(boxes) <= 8, texts
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), texts


def test_a_film_strip_of_eleven_panels_wraps_into_rows():
    figure = plot_film_strip(
        torch.rand(9, 8, 8), torch.linspace(0, 0.6, 9), target=torch.rand(8, 8), masked=torch.rand(8, 8)
    )
    width, height = figure.get_size_inches()
    assert width / height < 3.5  # 11 panels in one row were 8.7:1 (2520 x 290 pixels)
    shown = [ax for ax in figure.axes if ax.get_images()]
    assert len(shown) == 11
    assert len({round(ax.get_position().y0, 3) for ax in shown}) == 2
    with pytest.raises(ValueError, match="columns"):
        plot_film_strip(torch.rand(2, 8, 8), [0.0, 1.0], columns=0)


def test_hidden_patches_are_painted_in_a_colour_on_grey_images():
    images = torch.full((2, 1, 8, 8), 0.5)  # mid-grey: the old grey mask was invisible on it
    hidden = torch.tensor([[True, False, False, True], [False, True, False, False]])
    picture = masked_picture(images, hidden, 4)
    assert picture.shape == (2, 3, 8, 8)
    colour = torch.tensor(MASK_COLOUR)[:, None, None]
    assert torch.equal(picture[0, :, :4, :4], colour.expand(3, 4, 4))  # patch 0: hidden
    assert torch.equal(picture[0, :, :4, 4:], torch.full((3, 4, 4), 0.5))  # patch 1: the image, as grey RGB
    assert (picture[0, 0] - picture[0, 1]).abs().max() > 0.5  # the colour is far from any grey
