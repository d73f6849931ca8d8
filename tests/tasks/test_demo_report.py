"""The demo's report says what its pictures show and where its claims were measured."""

from __future__ import annotations

import re

import pytest

from et_ode.cli import build_parser
from et_ode.tasks.demo import DEMO_TIME, _demo_report, demo_config

RESULTS = {
    "train_images": 1150,
    "test_images": 359,
    "patches": 4,
    "train_seconds": 120.0,
    "demo_seconds": 130.0,
    "model": {"mse": 0.0461, "nfe": 20},
    "model_tight_solver": {"mse": 0.0461, "nfe": 188},
    "mean_baseline": {"mse": 0.0719},
    "nearest_neighbour": {"mse": 0.0494},
    "biharmonic": {"mse": 0.255},
    "improvement_over_mean": 0.359,
    "energy_descent": {"images": 359, "saved_times": 13, "exceptions": 0, "largest_relative_change": 0.0, "tolerance": 1e-6},
}
PICTURES = ["completions.png", "mse.png", "convergence.png", "trajectories.png", "film/film_strip.png"]


def test_the_report_names_the_transient_not_an_attractor():
    report = _demo_report(RESULTS, demo_config(), PICTURES)
    assert "attractor picture" not in report and "to the attractor" not in report
    assert "horizon t=0.6" in report and "a transient, not an attractor" in report


def test_the_report_compares_with_the_nearest_neighbour_and_explains_biharmonic():
    report = _demo_report(RESULTS, demo_config(), PICTURES)
    assert "6.7% below" in report  # 0.0461 against 0.0494
    worse = dict(RESULTS, model={"mse": 0.0672, "nfe": 12})
    assert "36.0% above" in _demo_report(worse, demo_config(), PICTURES)
    assert re.search(r"Biharmonic inpainting .* scores 0\.2550 here, 3\.5x the per-position mean's error", report)
    assert "overshoots" in report
    assert "Biharmonic" not in _demo_report({k: v for k, v in RESULTS.items() if k != "biharmonic"}, demo_config(), PICTURES)


def test_the_demo_points_to_its_measured_time_without_figures(capsys):
    assert "performance page" in DEMO_TIME and not re.search(r"\d", DEMO_TIME)  # the figures live in the docs
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "about 2 minutes" not in text and "attractor picture" not in text
    assert DEMO_TIME in text
