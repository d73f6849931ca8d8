"""The completion recipe of docs/guides/tasks.md: an ET that refines a classical fill, against the classical baselines.

Data (nothing downloaded):
    ``photos``: 22 photographs bundled with scikit-image, scikit-learn and matplotlib, cut into ``--tile`` x
        ``--tile`` tiles (16 or 32), grey (BT.601; ``--channels 1``, all 22) or RGB (``--channels 3``, the 11 colour
        ones), split by photograph (the split of ``et_ode.data.photographs``: grey 12 train, 4 validation, 6 test).
    ``fashion``: Fashion-MNIST (Debian's ``dataset-fashion-mnist``); validation = 2,000 training images held out
        (seed 0), test = the 10,000 test images.
Masks: 4x4 patches, half of them hidden, fixed per split (seed 99 validation, 1234 test).

    python examples/inpaint_recipe.py baselines --data photos
    python examples/inpaint_recipe.py train --data photos --out runs/photos --minutes 14 --planned-steps 1200
    python examples/inpaint_recipe.py evaluate --out runs/photos --split test
    python examples/inpaint_recipe.py train --data photos --channels 3 --out runs/photos_rgb    # RGB 16x16 tiles
    python examples/inpaint_recipe.py train --data photos --tile 32 --out runs/photos32          # grey 32x32 tiles
    python examples/inpaint_recipe.py train --data photos --method et --steps 12 --gradient direct --out runs/euler

``train`` resumes from ``OUT/checkpoint.pt`` when it exists (same settings), stops at ``--planned-steps`` or after
``--minutes`` of training, whichever comes first (the cosine schedule is planned for ``--planned-steps``), and
reports the validation MSE. ``evaluate`` scores the model as trained, with dopri5 at rtol 1e-3 and 1e-6 to the same
horizon, and with 12 Euler steps, next to the model's fill alone; on the photographs it also gives each photograph's
MSE, the model's against its fill's. ``--method et --steps S``: trained with S Euler steps of ``t1 / S`` instead of
an adaptive solver (``--gradient direct`` backpropagates through them). Fills: ``biharmonic``
(``ImageET(fill="biharmonic")``), ``none`` (the MASK token), ``knn`` (the mean of the ``--k`` training images nearest
on the visible patches, the image itself left out in training; ``KnnFillET``, an ``ImageET(fill=callable)``; kept
here, not in the library: it needs the training set at inference). With ``knn``, ``--context`` says what the tokens
see and how the answer is read (``KnnFillET``): ``retrieval`` gives each visible token the neighbours' errors on its
patch and reads the answer at a hidden patch as a blend of the neighbours' patches weighted from the final state;
``--weighting local`` starts that blend from ``local_knn_fill`` (the neighbours weighted by their errors around each
hidden patch) instead of the plain mean. The Fashion-MNIST recipe of docs/guides/tasks.md:

    python examples/inpaint_recipe.py baselines --data fashion
    python examples/inpaint_recipe.py train --data fashion --out runs/fashion_local --fill knn --context retrieval \
        --weighting local --augment 0 --minutes 32 --planned-steps 800
    python examples/inpaint_recipe.py evaluate --out runs/fashion_local --split test
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import Tensor

from et_ode import Adaptive, Direct, EulerET, Integration
from et_ode.models import ImageET, masked_mse, patchify, random_masks, unpatchify
from et_ode.models.fill import biharmonic_fill
from et_ode.models.image import Completion
from et_ode.solving.integration import Dynamics
from et_ode.tasks.baselines import MeanImage, NearestNeighbour

PATCH = 4
SPLITS = ("train", "val", "test")
MASK_SEEDS = {"val": 99, "test": 1234}


# ----------------------------------------------------------------------------------------------- data
def load(data: str, tile: int = 16, channels: int = 1) -> dict[str, Tensor]:
    """The ``train``, ``val`` and ``test`` images ``(n, C, H, W)``; ``tile`` and ``channels`` for the photographs."""
    if data == "photos":
        return {split: photo_split(split, tile, channels).images for split in SPLITS}
    from et_ode.data.images import load_idx_folder

    train = load_idx_folder(None, "train").images
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    return {"train": train[order[2000:]], "val": train[order[:2000]], "test": load_idx_folder(None, "test").images}


def photo_split(split: str, tile: int, channels: int):
    """One split of the photographs (the fixed split by photograph), with each tile's photograph in ``.sources``."""
    from et_ode.data import load_split

    return load_split("photos", None, "validation" if split == "val" else split, tile=tile, channels=channels)


def split_masks(split: str, n: int, num_patches: int) -> Tensor:
    hidden, _ = random_masks(n, num_patches, 0.5, generator=torch.Generator().manual_seed(MASK_SEEDS[split]))
    return hidden


def pixel_mask(hidden: Tensor, image_shape) -> Tensor:
    _, h, w = image_shape
    return hidden.reshape(-1, h // PATCH, w // PATCH).repeat_interleave(PATCH, 1).repeat_interleave(PATCH, 2)


# ----------------------------------------------------------------------------------------------- fills
def knn_neighbours(
    bank: Tensor,
    images: Tensor,
    hidden: Tensor,
    exclude: Tensor | None = None,
    k: int = 10,
    chunk: int = 20000,
    bank_energy: Tensor | None = None,
) -> Tensor:
    """Indices ``(B, k)`` of the ``k`` bank images (patches ``(n, N, P2)``) nearest to ``images`` on their visible
    patches (squared distance), nearest first; ``exclude (B,)``: a bank index to leave out per image (itself, in
    training); ``bank_energy (n, N)``: ``bank.square().sum(-1)``, when the caller keeps it."""
    target = patchify(images, PATCH)
    visible = (~hidden).to(target.dtype)  # (B, N)
    query = (visible[..., None] * target).flatten(1)  # (B, N P2)
    energy = bank.square().sum(-1) if bank_energy is None else bank_energy
    best_d = best_i = None
    for start in range(0, len(bank), chunk):
        part = bank[start : start + chunk].flatten(1)
        # |v (t - b)|^2 - |v t|^2 = -2 (v t).b + sum over visible patches of |b_patch|^2
        dist = -2 * query @ part.T + visible @ energy[start : start + chunk].T
        if exclude is not None:
            local = exclude - start
            inside = (local >= 0) & (local < len(part))
            dist[inside.nonzero().flatten(), local[inside]] = float("inf")
        d, i = dist.topk(min(k, len(part)), largest=False)
        i = i + start
        if best_d is not None:
            d, j = torch.cat([best_d, d], 1).topk(min(k, best_d.shape[1] + d.shape[1]), largest=False)
            i = torch.cat([best_i, i], 1).gather(1, j)
        best_d, best_i = d, i
    assert best_i is not None
    return best_i


def knn_fill(
    bank: Tensor,
    images: Tensor,
    hidden: Tensor,
    exclude: Tensor | None = None,
    k: int = 10,
    chunk: int = 20000,
    bank_energy: Tensor | None = None,
) -> Tensor:
    """``images`` with the hidden patches replaced by the mean of the ``k`` bank images (patches ``(n, N, P2)``)
    nearest on the visible patches; ``exclude (B,)``: a bank index to leave out per image (itself, in training);
    ``bank_energy`` as in :func:`knn_neighbours`."""
    neighbours = bank[knn_neighbours(bank, images, hidden, exclude, k, chunk, bank_energy)]  # (B, k, N, P2)
    guess = torch.where(hidden[..., None], neighbours.mean(1), patchify(images, PATCH))
    return unpatchify(guess, PATCH, images.shape[1:])


def local_logits(
    neighbours: Tensor, target: Tensor, hidden: Tensor, grid: tuple[int, int], temperature: float = 0.02
) -> Tensor:
    """``-e / temperature`` ``(B, k, N)``: ``e`` is each neighbour's mean squared error per pixel on the visible
    patches of the 3x3 patch window around each patch (0 where the window has no visible patch).
    ``neighbours (B, k, N, P2)``, ``target (B, N, P2)``, ``hidden (B, N)``, ``grid``: patches per column and row."""
    visible = (~hidden).to(target.dtype)  # (B, N)
    error = (neighbours - target[:, None]).square().mean(-1) * visible[:, None]  # (B, k, N)

    def window_sum(values: Tensor) -> Tensor:  # (..., N) summed over each 3x3 patch window
        summed = torch.nn.functional.conv2d(
            values.reshape(-1, 1, *grid), torch.ones(1, 1, 3, 3, dtype=values.dtype), padding=1
        )
        return summed.reshape(values.shape)

    return -window_sum(error) / window_sum(visible)[:, None].clamp_min(1) / temperature


def local_knn_fill(
    bank: Tensor,
    images: Tensor,
    hidden: Tensor,
    exclude: Tensor | None = None,
    k: int = 10,
    temperature: float = 0.02,
    bank_energy: Tensor | None = None,
) -> Tensor:
    """A classical rival of the plain mean: ``images`` with each hidden patch replaced by a blend of the ``k``
    nearest bank images' patches, weighted by ``softmax(local_logits)`` over the neighbours (the neighbours that
    match the visible patches around a hidden patch count more there). The 3x3 window and the temperature were
    chosen on the validation split. ``bank_energy`` as in :func:`knn_neighbours`."""
    neighbours = bank[knn_neighbours(bank, images, hidden, exclude, k, bank_energy=bank_energy)]  # (B, k, N, P2)
    target = patchify(images, PATCH)
    grid = (images.shape[2] // PATCH, images.shape[3] // PATCH)
    weights = torch.softmax(local_logits(neighbours, target, hidden, grid, temperature), 1)[..., None]
    guess = torch.where(hidden[..., None], (weights * neighbours).sum(1), target)
    return unpatchify(guess, PATCH, images.shape[1:])


ERROR_SCALE = 0.01  # a typical squared error per pixel of a neighbour's patch on Fashion-MNIST


class KnnFillET(ImageET):
    """``ImageET(fill=...)`` with the k-nearest-neighbour mean of ``bank`` as its fill (``weighting="mean"``) or the
    locally weighted neighbours of :func:`local_knn_fill` (``"local"``).

    ``context="fill"``: a token encodes its patch of the filled image (the image where visible, the neighbours'
    mean where hidden). ``context="residual"``: it encodes, besides, the neighbours' mean and per-pixel standard
    deviation at its position, so a visible token carries where the neighbours are wrong (image - mean) and every
    token how much they disagree. ``context="retrieval"``: as ``"residual"``, and a visible token also carries how
    well each of the ``k`` neighbours matches it (their squared errors on its patch, centred over the neighbours);
    a hidden token knows nothing of the kind at the start. The answer at a hidden patch is then a blend of the
    neighbours' patches, weighted by a softmax of logits read from the final state (``weigher``, zero at the
    start: the plain mean), plus the decoder's correction: the dynamics must carry the visible tokens' evidence
    about which neighbour to trust to the hidden tokens, an associative memory over retrieved candidates.
    """

    def __init__(self, *args, bank: Tensor, k: int = 10, context: str = "fill", weighting: str = "mean", **kwargs):
        super().__init__(*args, fill=self.fill_from_bank, **kwargs)
        if weighting not in ("mean", "local") or (weighting == "local" and context != "retrieval"):
            raise ValueError(f"weighting must be 'mean', or 'local' with context='retrieval', got {weighting!r}")
        self.weighting = weighting
        if context not in ("fill", "residual", "retrieval"):
            raise ValueError(f"context must be 'fill', 'residual' or 'retrieval', got {context!r}")
        self.bank = bank
        self.bank_energy = bank.square().sum(-1)  # (n, N)
        self.k = k
        self.context = context
        self.exclude: Tensor | None = None
        if context != "fill":
            self.encoder = torch.nn.Linear(3 * self.patch_dim + (k if context == "retrieval" else 0), self.dim)
        if context == "retrieval":
            self.weigher = torch.nn.Linear(self.dim, k)
            torch.nn.init.zeros_(self.weigher.weight)
            torch.nn.init.zeros_(self.weigher.bias)

    def fill_from_bank(self, images: Tensor, hidden: Tensor) -> Tensor:
        """The classical fill ``(B, C, H, W)`` of ``images`` whose ``hidden (B, N)`` patches are masked."""
        if self.weighting == "local":
            return local_knn_fill(self.bank, images, hidden, self.exclude, self.k, bank_energy=self.bank_energy)
        return knn_fill(self.bank, images, hidden, self.exclude, self.k, bank_energy=self.bank_energy)

    def forward(self, images: Tensor, hidden: Tensor, dynamics: Dynamics | None = None) -> Completion:
        if self.context == "fill":
            return super().forward(images, hidden, dynamics)
        index = knn_neighbours(self.bank, images, hidden, self.exclude, self.k, bank_energy=self.bank_energy)
        neighbours = self.bank[index]  # (B, k, N, P2)
        target = patchify(images, PATCH)
        mean = neighbours.mean(1)
        logits = torch.zeros(neighbours.shape[:3], dtype=mean.dtype)  # (B, k, N): the plain mean
        if self.weighting == "local":
            logits = local_logits(neighbours, target, hidden, (self.image_shape[1] // PATCH, self.image_shape[2] // PATCH))
        fill = torch.einsum("bkn,bknp->bnp", torch.softmax(logits, 1), neighbours)
        patches = torch.where(hidden[..., None], fill, target)  # the filled image's patches
        features = [patches, mean, neighbours.std(1)]
        if self.context == "retrieval":
            error = (neighbours - target[:, None]).square().mean(-1)  # (B, k, N)
            error = (error - error.mean(1, keepdim=True)) * (~hidden[:, None]).to(error.dtype)
            features.append(-error.transpose(1, 2) / ERROR_SCALE)
        encoded = self.encoder(torch.cat(features, -1))
        x0 = torch.where(hidden[..., None], encoded + self.mask_token, encoded) + self.position
        solution = (dynamics or self.dynamics).answer(self.field(), x0)
        if self.context == "retrieval":
            weights = torch.softmax(logits + self.weigher(solution.g).transpose(1, 2), 1)  # (B, k, N)
            blend = torch.einsum("bkn,bknp->bnp", weights, neighbours)
            patches = torch.where(hidden[..., None], blend, patches)
        return Completion(self.decode(solution.g) + patches, solution)


# ----------------------------------------------------------------------------------------------- runs
def squared_errors(predict, images: Tensor, hidden: Tensor, batch: int = 500) -> tuple[Tensor, Tensor]:
    """Per image ``(n,)``: the sum of squared errors over the hidden pixels of ``predict(x, h)`` (patches
    ``(B, N, C P P)``), and the number of those pixels (float64)."""
    squared, count = [], []
    for start in range(0, len(images), batch):
        x, h = images[start : start + batch], hidden[start : start + batch]
        pred = predict(x, h)
        weight = h.to(pred.dtype)[..., None]
        squared.append(((pred - patchify(x, PATCH)).square() * weight).sum((1, 2)).double())
        count.append(weight.sum((1, 2)).double() * pred.shape[-1])
    return torch.cat(squared), torch.cat(count)


def masked_patch_mse(predict, images: Tensor, hidden: Tensor, batch: int = 500) -> float:
    squared, count = squared_errors(predict, images, hidden, batch)
    return float(squared.sum() / count.sum())


def build(cfg: dict, data: dict[str, Tensor]) -> ImageET:
    euler = {"step": cfg["t1"] / cfg["steps"], "steps": cfg["steps"]} if cfg["method"] == "et" else {}
    adjoint_rtol = cfg["adjoint_rtol"]
    integration = Integration.from_options(
        cfg["method"],
        t1=cfg["t1"],
        rtol=cfg["rtol"],
        atol=cfg["atol"],
        gradient=cfg["gradient"],
        seminorm=cfg["seminorm"],
        max_steps=2000,
        adjoint_rtol=adjoint_rtol,
        adjoint_atol=adjoint_rtol and adjoint_rtol / 10,
        **euler,
    )
    torch.manual_seed(cfg["seed"])
    shape = tuple(data["train"].shape[1:])
    args = (shape, PATCH, cfg["dim"], cfg["heads"], cfg["head_dim"], cfg["memories"])
    if cfg["fill"] == "knn":
        return KnnFillET(
            *args,
            dynamics=integration,
            bank=patchify(data["train"], PATCH),
            k=cfg["k"],
            context=cfg["context"],
            weighting=cfg["weighting"],
        )
    return ImageET(*args, dynamics=integration, fill=None if cfg["fill"] == "none" else cfg["fill"])


def limited(data: dict[str, Tensor], limit: int) -> dict[str, Tensor]:
    return {k: v[:limit] for k, v in data.items()} if limit else data


# settings added after the first runs, with the values those runs had
LATER_SETTINGS = {
    "tile": 16,
    "channels": 1,
    "steps": 12,
    "adjoint_rtol": None,
    "k": 10,
    "context": "fill",
    "weighting": "mean",
}


def baselines(args) -> None:
    data = limited(load(args.data, args.tile, args.channels), args.limit)
    shape = tuple(data["train"].shape[1:])
    num_patches = (shape[1] // PATCH) * (shape[2] // PATCH)
    mean, nearest = MeanImage(data["train"], PATCH), NearestNeighbour(data["train"], PATCH)
    bank = patchify(data["train"], PATCH)
    bank_energy = bank.square().sum(-1)  # shared by the two k-NN predictors and both splits
    predictors = {
        "per-position mean": lambda x, h: mean(x, h).patches,
        "nearest neighbour": lambda x, h: nearest(x, h).patches,
        "biharmonic": lambda x, h: patchify(biharmonic_fill(x, pixel_mask(h, shape)), PATCH),
        "mean of 10 nearest": lambda x, h: patchify(knn_fill(bank, x, h, bank_energy=bank_energy), PATCH),
        "10 nearest, locally weighted": lambda x, h: patchify(local_knn_fill(bank, x, h, bank_energy=bank_energy), PATCH),
    }
    result = {"train": len(data["train"])}
    for split in ("val", "test"):
        x = data[split]
        h = split_masks(split, len(x), num_patches)
        result[split] = {"n": len(x), **{name: masked_patch_mse(p, x, h) for name, p in predictors.items()}}
    print(json.dumps(result, indent=1))


def train(args) -> None:
    out = Path(args.out)
    cfg = {
        k: getattr(args, k)
        for k in (
            "data",
            "dim",
            "heads",
            "head_dim",
            "memories",
            "method",
            "t1",
            "rtol",
            "atol",
            "gradient",
            "seminorm",
            "fill",
            "lr",
            "batch",
            "planned_steps",
            "seed",
            "augment",
            "limit",
            "tile",
            "channels",
            "steps",
            "adjoint_rtol",
            "k",
            "context",
            "weighting",
        )
    }
    checkpoint = out / "checkpoint.pt"
    if checkpoint.exists():
        saved = {**LATER_SETTINGS, **json.loads((out / "config.json").read_text())}
        if saved != cfg:
            raise SystemExit(f"{out} holds a run with other settings: {saved}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    data = limited(load(args.data, args.tile, args.channels), args.limit)
    model = build(cfg, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    state = {"step": 0, "elapsed": 0.0, "nfe_forward": 0, "nfe_backward": 0}
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)  # data only
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = json.loads(saved["state"])
        print(f"resumed at step {state['step']}")

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": json.dumps(state)}, tmp)
        tmp.replace(checkpoint)

    generator = torch.Generator().manual_seed(args.seed * 100_003 + state["step"])
    began = time.perf_counter() - state["elapsed"]
    model.train()
    while state["step"] < args.planned_steps and time.perf_counter() - began < args.minutes * 60:
        index = torch.randint(len(data["train"]), (args.batch,), generator=generator)
        images = data["train"][index]
        if args.augment:  # a random rotation by a multiple of 90 degrees and a random flip, per batch
            images = torch.rot90(images, int(torch.randint(4, (1,), generator=generator)), (2, 3))
            if bool(torch.randint(2, (1,), generator=generator)):
                images = images.flip(3)
        elif isinstance(model, KnnFillET):
            model.exclude = index
        hidden, _ = random_masks(args.batch, model.num_patches, 0.5, generator=generator)
        out_ = model(images, hidden)
        loss = masked_mse(out_.patches, patchify(images, PATCH), hidden)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        progress = state["step"] / args.planned_steps
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (state["step"] + 1) / 20) * 0.5 * (1 + math.cos(math.pi * progress))
        optimizer.step()
        state["step"] += 1
        state["nfe_forward"] += out_.solution.stats.nfe_forward
        state["nfe_backward"] += out_.solution.stats.nfe_backward
        if state["step"] % args.print_every == 0:
            print(f"step {state['step']}  loss {loss.item():.5f}  {time.perf_counter() - began:.0f} s", flush=True)
        if state["step"] % 50 == 0:
            state["elapsed"] = time.perf_counter() - began
            save()
    state["elapsed"] = time.perf_counter() - began
    save()
    if isinstance(model, KnnFillET):
        model.exclude = None
    model.eval()
    x = data["val"]
    h = split_masks("val", len(x), model.num_patches)
    with torch.no_grad():
        val = masked_patch_mse(lambda a, b: model(a, b).patches, x, h)
    steps = max(state["step"], 1)
    print(
        json.dumps(
            {
                "val_mse": val,
                "steps": state["step"],
                "train_seconds": round(state["elapsed"]),
                "nfe_per_step": [state["nfe_forward"] / steps, state["nfe_backward"] / steps],
            }
        )
    )


def per_source(squared: Tensor, fill_squared: Tensor, count: Tensor, sources) -> dict[str, dict]:
    """Per source (in order of appearance): its tiles, the model's and the fill's MSE over its hidden pixels, and
    the model's change against the fill in percent; ``squared``, ``fill_squared``, ``count``: ``(n,)`` per image."""
    result = {}
    for source in dict.fromkeys(sources):
        tiles = torch.tensor([s == source for s in sources])
        model_mse = float(squared[tiles].sum() / count[tiles].sum())
        fill_mse = float(fill_squared[tiles].sum() / count[tiles].sum())
        result[source] = {
            "tiles": int(tiles.sum()),
            "mse": model_mse,
            "fill mse": fill_mse,
            "change %": round(100 * (model_mse / fill_mse - 1), 2),
        }
    return result


def evaluate(args) -> None:
    out = Path(args.out)
    cfg = {**LATER_SETTINGS, **json.loads((out / "config.json").read_text())}
    data = limited(load(cfg["data"], cfg["tile"], cfg["channels"]), cfg["limit"])
    model = build(cfg, data)
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["model"])
    model.eval()
    x = data[args.split]
    h = split_masks(args.split, len(x), model.num_patches)
    trained = model.dynamics
    assert isinstance(trained, Integration)  # the recipe's models integrate to a horizon
    solvers = {"as trained": trained.replace(gradient=Direct())}
    for rtol in (1e-3, 1e-6):
        solvers[f"dopri5, rtol {rtol:g}"] = Integration(
            Adaptive("dopri5", rtol=rtol, atol=rtol / 10), Direct(), t1=cfg["t1"], max_steps=100_000
        )
    solvers["12 Euler steps"] = Integration(EulerET(alpha=cfg["t1"] / 12, steps=12), Direct())
    result: dict = {}
    began = time.perf_counter()
    fill_squared, count = squared_errors(lambda a, b: patchify(model.filled(a, b), PATCH), x, h)
    if cfg["fill"] != "none":  # (without a fill, filled() is the image itself)
        result["fill alone"] = {
            "mse": float(fill_squared.sum() / count.sum()),
            "seconds": round(time.perf_counter() - began, 1),
        }
        print("fill alone", result["fill alone"], flush=True)
    for name, integration in solvers.items():
        nfe: list[int] = []

        def predict(a, b, integration=integration, nfe=nfe):
            completion = model(a, b, dynamics=integration)
            nfe.append(completion.solution.stats.nfe_forward)
            return completion.patches

        began = time.perf_counter()
        with torch.no_grad():
            squared, _ = squared_errors(predict, x, h)
        result[name] = {
            "mse": float(squared.sum() / count.sum()),
            "nfe_per_batch": sum(nfe) / len(nfe),
            "seconds": round(time.perf_counter() - began, 1),
        }
        print(name, result[name], flush=True)
        if name == "as trained" and cfg["data"] == "photos" and cfg["fill"] != "none":  # the model against its fill
            sources = photo_split(args.split, cfg["tile"], cfg["channels"]).sources[: len(x)]
            result["per photograph"] = per_source(squared, fill_squared, count, sources)
            print("per photograph", json.dumps(result["per photograph"]), flush=True)
    (out / f"evaluate_{args.split}.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    base = sub.add_parser("baselines")
    base.add_argument("--data", choices=("photos", "fashion"), default="photos")
    base.add_argument("--limit", type=int, default=0, help="use only the first LIMIT images of each split")
    base.add_argument("--tile", type=int, choices=(16, 32), default=16, help="photographs: tile size")
    base.add_argument("--channels", type=int, choices=(1, 3), default=1, help="photographs: 1 grey, 3 RGB")
    run = sub.add_parser("train")
    run.add_argument("--data", choices=("photos", "fashion"), default="photos")
    run.add_argument("--out", required=True)
    run.add_argument("--fill", choices=("biharmonic", "none", "knn"), default="biharmonic")
    run.add_argument("--k", type=int, default=10, help="neighbours of the knn fill")
    run.add_argument(
        "--context",
        choices=("fill", "residual", "retrieval"),
        default="fill",
        help="what a token encodes with --fill knn (see KnnFillET)",
    )
    run.add_argument(
        "--weighting",
        choices=("mean", "local"),
        default="mean",
        help="with --context retrieval: start from the plain mean or the locally weighted neighbours",
    )
    run.add_argument("--dim", type=int, default=32)
    run.add_argument("--heads", type=int, default=4)
    run.add_argument("--head-dim", type=int, default=8)
    run.add_argument("--memories", type=int, default=None)
    run.add_argument("--tile", type=int, choices=(16, 32), default=16, help="photographs: tile size")
    run.add_argument("--channels", type=int, choices=(1, 3), default=1, help="photographs: 1 grey, 3 RGB")
    run.add_argument("--method", default="bosh3", help="a solver's name; 'et': --steps Euler steps of t1 / steps")
    run.add_argument("--steps", type=int, default=12, help="the number of Euler steps of --method et")
    run.add_argument("--t1", type=float, default=1.0)
    run.add_argument("--rtol", type=float, default=1e-2)
    run.add_argument("--atol", type=float, default=1e-3)
    run.add_argument("--gradient", default="adjoint")
    run.add_argument(
        "--adjoint-rtol",
        type=float,
        default=None,
        help="the adjoint's rtol (atol a tenth of it); default: the forward solve's",
    )
    run.add_argument("--seminorm", action="store_true")
    run.add_argument("--lr", type=float, default=3e-3)
    run.add_argument("--batch", type=int, default=64)
    run.add_argument("--planned-steps", type=int, default=1200)
    run.add_argument("--minutes", type=float, default=14.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--augment", type=int, choices=(0, 1), default=1)
    run.add_argument("--limit", type=int, default=0, help="use only the first LIMIT images of each split")
    run.add_argument("--print-every", type=int, default=100)
    ev = sub.add_parser("evaluate")
    ev.add_argument("--out", required=True)
    ev.add_argument("--split", choices=("val", "test"), default="val")
    args = parser.parse_args(argv)
    if getattr(args, "data", "photos") != "photos" and (args.tile, args.channels) != (16, 1):
        parser.error("--tile and --channels are for --data photos")
    torch.set_num_threads(1)
    {"baselines": baselines, "train": train, "evaluate": evaluate}[args.command](args)


if __name__ == "__main__":
    main()
