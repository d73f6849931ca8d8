"""Photos with the official checkpoint, end to end: `et-ode complete --official` and `et-ode analyze --official`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from et_ode import Adaptive, Integration
from et_ode.cli import build_parser, main
from et_ode.cli.analyze import _official_states
from et_ode.data import read_photo
from et_ode.models import load_official, normalize_pixels, official_masks, unpatchify
from et_ode.tasks.photos import complete_photos, official_tokens

SHAPE, PATCH = (3, 32, 32), 8


@pytest.fixture
def checkpoint(fixtures):
    path = fixtures / "official-format" / "plaindict_ckpt.npz"
    return path


def _photos(folder, sizes):
    """Random RGB PNGs of other sizes than the model's (they get scaled and cropped)."""
    generator = np.random.default_rng(0)
    paths = []
    for k, (height, width) in enumerate(sizes):
        path = folder / f"photo{k}.png"
        Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_read_photo_scales_and_crops(tmp_path):
    wide = np.zeros((20, 60, 3), dtype=np.uint8)
    wide[:, 20:40] = (200, 100, 50)  # the middle third survives a center crop to a square
    Image.fromarray(wide).save(tmp_path / "wide.png")
    pixels = read_photo(tmp_path / "wide.png", (10, 10))
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 10, 10)
    assert pixels[:, :, 2:8].tolist() == torch.tensor([200, 100, 50])[:, None, None].expand(3, 10, 6).tolist()
    Image.fromarray(np.full((7, 9), 77, dtype=np.uint8)).save(tmp_path / "grey.png")
    assert torch.equal(read_photo(tmp_path / "grey.png", (7, 9)), torch.full((3, 7, 9), 77, dtype=torch.uint8))
    (tmp_path / "broken.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="broken.png"):
        read_photo(tmp_path / "broken.png", (4, 4))
    with pytest.raises(FileNotFoundError):
        read_photo(tmp_path / "missing.png", (4, 4))


def test_complete_official_cli_end_to_end(checkpoint, tmp_path, capsys):
    photos = _photos(tmp_path, [(45, 60), (50, 37)])
    out = tmp_path / "out"
    argv = [
        "complete",
        "--official",
        str(checkpoint),
        "--image",
        str(photos[0]),
        "--image",
        str(photos[1]),
        "--image-shape",
        "3",
        "32",
        "32",
        "--patch",
        "8",
        "--masked",
        "6",
        "--seed",
        "3",
        "--out",
        str(out),
        "--t1",
        "3",
        "--steady-state",
        "0.05",
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["photos"]) == {str(p) for p in photos}
    for name in ("report.md", "report.json", "completions.pt", "photo_0.png", "photo_1.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "![photo 1](photo_1.png)" in report and "12 Euler steps" in report and "steady state" in report
    assert "at most t = 3)" in report  # --t1: the steady-state solve's horizon

    # The CLI's reconstructions are the Python path's: same photos, masks and model
    saved = torch.load(out / "completions.pt", weights_only=True)
    model = load_official(checkpoint, SHAPE, PATCH)
    pixels = torch.stack([read_photo(p, (32, 32)) for p in photos])
    images = normalize_pixels(pixels).float()
    hidden = official_masks(2, 16, 6, seed=3)
    assert torch.equal(saved["pixels"], pixels) and torch.equal(saved["hidden"], hidden)
    assert hidden.sum(dim=1).tolist() == [6, 6]
    with torch.no_grad():
        official = unpatchify(model(images, hidden).patches, PATCH, SHAPE)
        dopri5 = Integration(solver=Adaptive(rtol=1e-5, atol=1e-7), gradient="direct", t1=1.2, max_steps=2000)
        adaptive = torch.cat(
            [
                unpatchify(model(images[k : k + 1], hidden[k : k + 1], dynamics=dopri5).patches, PATCH, SHAPE)
                for k in range(2)
            ]
        )  # one photo per solve: the CLI's step-size control is per photo
    # (float32 products may round differently for a batch of 1 and of 2: equal to float32 rounding, not bitwise)
    assert torch.allclose(saved["euler"], official, rtol=1e-5, atol=1e-5)
    assert torch.allclose(saved["dopri5"], adaptive, rtol=1e-5, atol=1e-5)

    summary = json.loads((out / "report.json").read_text())
    for record in summary["photos"]:
        euler, dopri5 = record["solves"]["euler"], record["solves"]["dopri5"]
        assert euler["nfe"] == 12 and abs(euler["t_final"] - 1.2) < 1e-12 and abs(dopri5["t_final"] - 1.2) < 1e-12
        for entry in record["solves"].values():  # the energy is a Lyapunov function along every solve
            assert entry["lyapunov_descends"]
            assert all(b <= a for a, b in zip(entry["energies"], entry["energies"][1:], strict=False))
        assert dopri5["lyapunov_follows_rate"]  # an accurate solve follows the exact dE/dt

    # A second run into the same folder is refused, and nothing is lost
    before = (out / "report.md").read_text()
    assert main(argv) == 2
    assert "not empty" in capsys.readouterr().err and "--overwrite" in before + "--overwrite"
    assert (out / "report.md").read_text() == before
    with pytest.raises(FileExistsError, match="overwrite"):
        complete_photos(checkpoint, photos, out, image_shape=SHAPE, patch=PATCH)


def test_complete_official_argument_errors(checkpoint, tmp_path, capsys):
    photo = _photos(tmp_path, [(8, 8)])[0]
    base = [
        "complete",
        "--official",
        str(checkpoint),
        "--image",
        str(photo),
        "--image-shape",
        "3",
        "32",
        "32",
        "--patch",
        "8",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*base, "--masked", "17"]) == 2
    assert "masked must be an integer in [1, 16]" in capsys.readouterr().err
    assert main(["complete", "--official", str(checkpoint), "--image", str(photo), "--out", str(tmp_path / "o")]) == 2
    assert "= (768, 48) for image_shape (3, 224, 224) and patch 16, found (192, 48)" in capsys.readouterr().err
    assert main(["complete", "--image", str(photo), "--out", str(tmp_path / "o")]) == 2
    assert "CHECKPOINT" in capsys.readouterr().err
    assert main([*base, "--solver", "rk4"]) == 2
    assert "--solver apply to trained checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_analyze_official_takes_the_tokens_of_photos(checkpoint, tmp_path):
    photos = _photos(tmp_path, [(40, 40), (33, 65)])
    args = build_parser().parse_args(
        [
            "analyze",
            "--official",
            str(checkpoint),
            "--image",
            str(photos[0]),
            "--image",
            str(photos[1]),
            "--image-shape",
            "3",
            "32",
            "32",
            "--patch",
            "8",
            "--mask-seed",
            "2",
            "--out",
            str(tmp_path / "a"),
        ]
    )
    resolved = _official_states(args)
    model, _, images, hidden = official_tokens(
        checkpoint, photos, image_shape=SHAPE, patch=PATCH, seed=2, dtype=torch.float64
    )
    assert resolved.model.attention.self_attention and resolved.model.dim == 48
    assert resolved.x0.dtype == torch.float64 and resolved.x0.shape == (2, 17, 48)
    with torch.no_grad():
        assert torch.equal(resolved.x0, model.tokens(images, hidden))
    for state_a, state_b in zip(resolved.model.state_dict().values(), model.block.state_dict().values(), strict=True):
        assert torch.equal(state_a, state_b)
    with pytest.raises(ValueError, match="--official needs at least one --image"):
        _official_states(build_parser().parse_args(["analyze", "--official", str(checkpoint)]))
    with pytest.raises(ValueError, match="--image needs --official"):
        _official_states(build_parser().parse_args(["analyze", "--image", str(photos[0])]))


@pytest.mark.slow
def test_analyze_official_cli_end_to_end(checkpoint, tmp_path):
    photos = _photos(tmp_path, [(40, 40)])
    out = tmp_path / "analysis"
    assert (
        main(
            [
                "analyze",
                "--official",
                str(checkpoint),
                "--image",
                str(photos[0]),
                "--image-shape",
                "3",
                "32",
                "32",
                "--patch",
                "8",
                "--t1",
                "2",
                "--points",
                "9",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    report = (out / "report.md").read_text()
    assert "D = 48, H = 3, Y = 16, K = 192" in report and "1 sample(s) of 17 tokens" in report
    assert (out / "convergence.png").is_file()
