"""Masked completion of held-out photographs: train on tiles of bundled photographs within a time budget, then score
the model beside the classical baselines on photographs it never saw (what `et-ode train image --data photos` and
`et-ode evaluate` do).

    python examples/complete_photos.py [--out runs/photos] [--minutes 8] [--channels 1|3] [--tile 16]

The 22 photographs ship with scikit-image, scikit-learn and matplotlib (nothing is downloaded; needs
`pip install et-ode[images]`); each belongs to one split (`et_ode.data.photographs.PHOTOGRAPHS`), so no tile of a
test photograph is seen in training. Writes --out/ (the run) and --out/evaluation/ (table, grid, arrays).
"""

import argparse

from et_ode import EulerET, Integration
from et_ode.tasks.evaluation import evaluate_checkpoint
from et_ode.tasks.image import ImageRunConfig, train_image
from et_ode.training.train import TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/photos")
    parser.add_argument("--minutes", type=float, default=8.0, help="training budget (the schedule is planned for it)")
    parser.add_argument("--channels", type=int, choices=(1, 3), default=1)
    parser.add_argument("--tile", type=int, default=16)
    parser.add_argument("--train-limit", type=int, default=None, help="only the first N training tiles (smoke runs)")
    parser.add_argument("--test-limit", type=int, default=None, help="only the first N test tiles (smoke runs)")
    args = parser.parse_args()

    config = ImageRunConfig(
        data="photos",
        tile=args.tile,
        channels=args.channels,
        train_limit=args.train_limit,
        test_limit=args.test_limit,
        val_size=500,
        patch=4,
        dim=64,
        heads=4,
        head_dim=16,
        ratio=0.5,
        integration=Integration(solver=EulerET(0.1, 12), gradient="direct"),  # the paper's 12 Euler steps
        train=TrainConfig(
            epochs=1000, batch_size=64, lr=2e-3, out_dir=args.out, overwrite=True, progress=False, max_time=60 * args.minutes
        ),
        energy_check=False,
        threads=1,
    )
    results = train_image(config)
    cost = results["train_cost"]
    print(
        f"trained {cost['steps']} steps in {results['train_seconds']:.0f} s ({cost['seconds_per_step']:.3f} s and "
        f"{cost['nfe_forward_per_step']:.0f} + {cost.get('nfe_backward_per_step', 0):.0f} field evaluations per step)"
    )
    evaluation = evaluate_checkpoint(
        f"{args.out}/checkpoint.safetensors", f"{args.out}/evaluation", limit=args.test_limit, overwrite=True, progress=False
    )
    print(f"test masked-patch MSE on {evaluation['images']} tiles of held-out photographs:")
    for name, entry in evaluation["predictors"].items():
        print(f"  {name:<11} {entry['mse']:.4f}")


if __name__ == "__main__":
    main()
