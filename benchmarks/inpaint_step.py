"""Cost of one training step of the image-completion ET: adaptive solver + adjoint against 12 Euler steps.

The model of the photo-completion recipe (16x16 grey tiles, 4x4 patches, half hidden, ``fill="biharmonic"``,
D=32, 4 heads of 8, 128 memories), a batch of 64 random tiles. Each candidate is one full step: forward solve,
masked MSE, backward, AdamW update; timed interleaved (``_common.interleaved``, minimum over repetitions), with the
forward and backward field evaluations of its last call.

    python benchmarks/inpaint_step.py [--reps 10] [--threads 1]
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
    "bosh3 to t=1, rtol 1e-2, adjoint (the recipe)": Integration(Adaptive("bosh3", rtol=1e-2, atol=1e-3), Adjoint(),
                                                                 t1=1.0),
    "bosh3 to t=1, rtol 1e-2, adjoint, seminorm": Integration(Adaptive("bosh3", rtol=1e-2, atol=1e-3),
                                                              Adjoint(seminorm=True), t1=1.0),
    "dopri5 to t=1, rtol 1e-3, adjoint": Integration(Adaptive("dopri5", rtol=1e-3, atol=1e-4), Adjoint(), t1=1.0),
    "12 Euler steps of 1/12, backprop (direct)": Integration(EulerET(alpha=1 / 12, steps=12), Direct()),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(64, 1, 16, 16, generator=generator)
    hidden, _ = random_masks(64, 16, 0.5, generator=generator)
    target = patchify(images, 4)
    last: dict[str, tuple[int, int]] = {}

    def step(name: str, integration: Integration):
        torch.manual_seed(0)
        model = ImageET((1, 16, 16), 4, 32, 4, 8, fill="biharmonic", integration=integration)
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
    print(table(("training step (batch 64)", "ms", "x Euler-12", "NFE forward", "NFE backward"), rows))


if __name__ == "__main__":
    main()
