"""Cost of one training step of the image-completion ET: adaptive solver + adjoint against 12 Euler steps.

The model of the photo-completion recipe (16x16 grey tiles, 4x4 patches, half hidden, ``fill="biharmonic"``,
D=32, 4 heads of 8, 128 memories), a batch of 64 random tiles (``--tile 32``, ``--channels 3``, ``--batch``: the
recipe's other tiles). Each candidate is one full step: forward solve,
masked MSE, backward, AdamW update; timed interleaved (``_common.interleaved``, minimum over repetitions), with the
forward and backward field evaluations of its last call.

    python benchmarks/inpaint_step.py [--reps 10] [--threads 1] [--tile 16|32] [--channels 1|3] [--batch 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, interleaved, ms, set_threads, table  # noqa: E402

from et_ode import Adaptive, Adjoint, Direct, EulerET, Integration  # noqa: E402
from et_ode.models import ImageET, masked_mse, patchify, random_masks  # noqa: E402

CANDIDATES = {
    "bosh3 to t=1, rtol 1e-2, adjoint (the recipe)": Integration(Adaptive("bosh3", rtol=1e-2, atol=1e-3), Adjoint(), t1=1.0),
    "bosh3 to t=1, rtol 1e-2, adjoint, seminorm": Integration(
        Adaptive("bosh3", rtol=1e-2, atol=1e-3), Adjoint(seminorm=True), t1=1.0
    ),
    "dopri5 to t=1, rtol 1e-3, adjoint": Integration(Adaptive("dopri5", rtol=1e-3, atol=1e-4), Adjoint(), t1=1.0),
    "12 Euler steps of 1/12, backprop (direct)": Integration(EulerET(alpha=1 / 12, steps=12), Direct()),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tile", type=int, choices=(16, 32), default=16)
    parser.add_argument("--channels", type=int, choices=(1, 3), default=1)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    set_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shape = (args.channels, args.tile, args.tile)
    images = torch.rand(args.batch, *shape, generator=generator)
    hidden, _ = random_masks(args.batch, (args.tile // 4) ** 2, 0.5, generator=generator)
    target = patchify(images, 4)
    last: dict[str, tuple[int, int]] = {}

    def step(name: str, integration: Integration):
        torch.manual_seed(0)
        model = ImageET(shape, 4, 32, 4, 8, fill="biharmonic", dynamics=integration)
        torch.nn.init.normal_(model.decoder.weight, std=0.1)  # a trained model's decoder is not zero
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def run() -> None:
            out = model(images, hidden)
            loss = masked_mse(out.patches, target, hidden)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            last[name] = (out.solution.stats.nfe_forward, out.solution.stats.nfe_backward)

        return run

    seconds = interleaved({name: step(name, integration) for name, integration in CANDIDATES.items()}, args.reps)
    euler = seconds["12 Euler steps of 1/12, backprop (direct)"]
    rows = [(name, f"{ms(s):.0f}", f"{s / euler:.2f}", last[name][0], last[name][1]) for name, s in seconds.items()]
    print(environment())
    print(f"{args.batch} tiles of {args.channels}x{args.tile}x{args.tile}")
    print(table((f"training step (batch {args.batch})", "ms", "x Euler-12", "NFE forward", "NFE backward"), rows))


if __name__ == "__main__":
    main()
