"""Image models read at the attractor against the same models read after their training integration.

For each ``train_image`` checkpoint given, the masked-patch MSE, forward evaluations per batch and seconds of:
its own integration (e.g. 12 Euler steps) and the certified attractor (``dynamics=AttractorReadout()``, float32
certificate RMS |T dE/dg| < 1e-4), on two fixed-mask sets: **validation**, the training-split images after
the run's ``--train-limit`` (never trained on; for choosing settings), and **test** (the run's test split and
masks, the ones ``train_image`` reports).

Run: ``.venv/bin/python benchmarks/attractor_training.py runs/a/checkpoint.safetensors [more ...] [--val-limit N]
[--test-limit N] [--threads 1]``. Times are from whatever the machine carries.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

from et_ode import AttractorReadout  # noqa: E402
from et_ode.data.images import load_images  # noqa: E402
from et_ode.models.image import fixed_mask_set  # noqa: E402
from et_ode.tasks.image import evaluate_model, load_trained  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--val-limit", type=int, default=None, help="validation images (default: all held out)")
    parser.add_argument("--test-limit", type=int, default=None, help="test images (default: the run's)")
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    _common.set_threads(args.threads)
    print(_common.environment())
    print("| run | readout | val MSE | test MSE | NFE per batch | seconds (val + test) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for checkpoint in args.checkpoints:
        model, run = load_trained(checkpoint)
        if run.train_limit is None:
            raise SystemExit(f"{checkpoint}: trained on the whole training split (no --train-limit): no validation set")
        train = load_images(run.data, run.data_path, "train")
        held_out = train.images[run.train_limit :][: args.val_limit]
        val = fixed_mask_set(held_out, model.num_patches, run.ratio, run.visible_fraction, seed=run.mask_seed + 1)
        test_images = load_images(run.data, run.data_path, "test").images[: args.test_limit or run.test_limit]
        test = fixed_mask_set(test_images, model.num_patches, run.ratio, run.visible_fraction, seed=run.mask_seed)
        own = run.integration
        for name, dynamics in (("trained integration: " + own.solver.name, own), ("attractor", AttractorReadout())):
            v = evaluate_model(model, val, batch_size=args.batch_size, dynamics=dynamics)
            t = evaluate_model(model, test, batch_size=args.batch_size, dynamics=dynamics)
            print(
                f"| {Path(checkpoint).parent.name} | {name} | {v['mse']:.4f} | {t['mse']:.4f} | {t['nfe']:.0f} | "
                f"{v['seconds']:.0f} + {t['seconds']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
