"""Masked image completion with an Energy Transformer.

An image ``(C, H, W)`` is cut into ``N = (H/P)(W/P)`` patches of ``C P P`` pixels (:func:`patchify`). Each patch is
encoded linearly into ``R^D`` and gets a learned positional embedding; a hidden patch is replaced by a learned MASK
token plus its position; an optional CLS token comes first. The ET block evolves the tokens by
``tau dx/dt = -dE/dg`` with :func:`et_ode.solve` (any solver, a time horizon or a steady state, any gradient mode),
and a linear decoder maps each final normalised token ``g`` back to a patch (:class:`ImageET`).

Masks are two boolean tensors ``(B, N)``: ``hidden`` (replaced by MASK) and ``scored`` (counted in the loss,
:func:`masked_mse`). Random masks score a fraction of the patches and hide them all; the paper's scheme leaves some
of the scored patches visible (ImageNet: 100 of 196 scored, 90 hidden, 10 visible): :func:`random_masks`.
:class:`CompletionTask` is the task that :func:`et_ode.training.train.fit` trains.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from et_ode.backend import devices
from et_ode.backend.validation import check_positive
from et_ode.dynamics.field import ETField
from et_ode.energy.energies import HopfieldForm
from et_ode.energy.model import EnergyTransformer
from et_ode.integrators.solution import Solution
from et_ode.integrators.solvers import Adaptive, EulerET
from et_ode.models.fill import biharmonic_fill
from et_ode.solving.gradients import Adjoint, Direct
from et_ode.solving.integration import Dynamics, Integration, check_dynamics, settings_from_dict, settings_to_dict

FILLS = (None, "biharmonic")  # by name; a callable (images, hidden) -> filled images is the third kind
Fill = Callable[[Tensor, Tensor], Tensor]
# the image model's default integration: dopri5 at loose tolerances to t = 1.2 tau, trained with the adjoint
MAX_PARAMETERS = 2**28  # parameters of one model (1 GiB in float32): a larger description is refused unallocated


def check_model_size(dim: object, heads: object, head_dim: object, memories: object, extra: int = 0) -> int:
    """The parameter count of an ET block of these sizes plus ``extra``, checked before anything is allocated.

    Raises:
        ValueError: a size that is not a positive integer (``memories`` may be None: ``4 dim``), or more than
            ``MAX_PARAMETERS`` parameters in all, naming the sizes.
    """
    sizes = {
        "dim": dim,
        "heads": heads,
        "head_dim": head_dim,
        "memories": 4 * dim if memories is None and isinstance(dim, int) else memories,
    }
    for name, value in sizes.items():
        check_positive(name, value, integer=True)
    d, h, y, k = (int(v) for v in sizes.values())  # type: ignore[call-overload]
    count = 2 * h * y * d + k * d + 2 * d + h + extra
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"dim={d}, heads={h}, head_dim={y}, memories={k} make {count} parameters, more than the "
            f"{MAX_PARAMETERS} et-ode builds"
        )
    return count


DEFAULT_INTEGRATION = Integration(solver=Adaptive(rtol=1e-3, atol=1e-4), gradient=Adjoint(), t1=1.2, max_steps=2000)


@dataclass
class Completion:
    """The decoded patches ``(B, N, C P P)`` and the solve that produced them (None for baselines)."""

    patches: Tensor
    solution: Solution | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- patches
def _check_images(images: object, shape: Sequence[int] | None = None) -> Tensor:
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a torch.Tensor of shape (B, C, H, W), got {type(images).__name__}")
    if images.dim() != 4:
        raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
    if shape is not None and tuple(images.shape[1:]) != tuple(shape):
        raise ValueError(
            f"images must have shape (B, {', '.join(map(str, shape))}) (C, H, W) for this model, got {tuple(images.shape)}"
        )
    if not images.is_floating_point():
        raise TypeError(f"images must be floating point (values in [0, 1]), got {images.dtype}")
    return images


def patchify(images: Tensor, patch: int) -> Tensor:
    """Cut images into patches, in row-major order, each flattened channel-first.

    Args:
        images: ``(B, C, H, W)``.
        patch: the patch side ``P``, dividing ``H`` and ``W``.

    Returns:
        The patches, ``(B, N, C P P)``.

    Raises:
        TypeError: ``images`` is not a tensor.
        ValueError: ``images`` is not ``(B, C, H, W)``, or ``P`` does not divide ``H`` and ``W``.
    """
    b, c, h, w = _check_images(images).shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not divisible by the patch size {patch}")
    grid = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpatchify(patches: Tensor, patch: int, image_shape: Sequence[int]) -> Tensor:
    """Inverse of :func:`patchify`.

    Args:
        patches: ``(..., N, C P P)``.
        patch: the patch side ``P``.
        image_shape: ``(C, H, W)``.

    Returns:
        The images, ``(..., C, H, W)``.
    """
    c, h, w = image_shape
    lead = patches.shape[:-2]
    grid = patches.reshape(-1, h // patch, w // patch, c, patch, patch)
    return grid.permute(0, 3, 1, 4, 2, 5).reshape(*lead, c, h, w)


def random_masks(
    batch: int,
    num_patches: int,
    ratio: float,
    *,
    visible_fraction: float = 0.0,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Random patch masks ``(hidden, scored)``, boolean ``(batch, num_patches)``.

    Each image scores ``round(ratio * num_patches)`` patches drawn uniformly; of those,
    ``round(visible_fraction * scored)`` stay visible (the paper's scheme: ``ratio=100/196``,
    ``visible_fraction=0.1``) and the rest are hidden behind the MASK token.

    Args:
        batch: the number of images.
        num_patches: patches per image ``N``.
        ratio: the scored share of the patches.
        visible_fraction: the share of the scored patches left visible.
        generator: the random generator, or None (the global one).
        device: the masks' device.

    Returns:
        ``(hidden, scored)``, each boolean ``(batch, N)``.
    """
    if not (isinstance(ratio, (int, float)) and 0 < ratio < 1):
        raise ValueError(f"mask ratio must be in (0, 1) (the fraction of patches scored), got {ratio!r}")
    if not 0 <= visible_fraction < 1:
        raise ValueError(f"visible_fraction must be in [0, 1), got {visible_fraction!r}")
    n_scored = round(ratio * num_patches)
    if not 1 <= n_scored <= num_patches:
        raise ValueError(f"mask ratio {ratio} scores {n_scored} of {num_patches} patches; need at least 1")
    n_visible = round(visible_fraction * n_scored)
    if n_visible >= n_scored:
        raise ValueError(f"visible_fraction {visible_fraction} leaves no hidden patch among {n_scored} scored")
    noise = torch.rand(batch, num_patches, generator=generator)
    order = noise.argsort(dim=1)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(num_patches).expand(batch, -1))
    scored = rank < n_scored
    hidden = rank < n_scored - n_visible
    return hidden.to(device), scored.to(device)


def masked_mse(pred: Tensor, target: Tensor, scored: Tensor) -> Tensor:
    """Mean squared error over the pixels of scored patches.

    Args:
        pred, target: patches ``(B, N, P2)``.
        scored: boolean ``(B, N)``, the patches counted.

    Returns:
        The mean, a 0-d tensor (0 when no patch is scored).
    """
    weight = scored.to(pred.dtype)[..., None]
    return ((pred - target).square() * weight).sum() / (weight.sum() * pred.shape[-1]).clamp_min(1)


# ----------------------------------------------------------------------------------------------- the model
DESCRIPTION_REQUIRED = ("image_shape", "patch", "dim", "heads", "head_dim")
DESCRIPTION_OPTIONAL = (
    "memories",
    "hopfield",
    "self_attention",
    "cls_token",
    "tau",
    "dynamics",
    "cls_position",
    "renormalize",
    "fill",
)


class ImageET(nn.Module):
    """Patch encoder, positional embedding, MASK (and CLS) token, ET block, linear decoder.

    Args:
        image_shape: ``(C, H, W)``; ``H`` and ``W`` multiples of ``patch``.
        patch: patch side ``P``.
        dim, heads, head_dim, memories: the ET block (``memories`` default ``4 * dim``).
        cls_token: prepend a learned CLS token (it is not decoded).
        hopfield, self_attention: passed to :class:`et_ode.EnergyTransformer`.
        tau: time constant of the dynamics.
        dynamics: how the block runs: an :class:`~et_ode.Integration` (solver, gradient, stop, horizon ``t1``, step
            budget; the answer is read at its end) or an :class:`~et_ode.AttractorReadout` (the answer is read at the
            certified attractor of the flow); ``forward(..., dynamics=...)`` overrides it.
        cls_position: the positional embedding has a row for the CLS token too, ``(1 + N, D)``, added after the CLS
            token is put in front (the official release's order); needs ``cls_token``. Default: ``(N, D)``, added to
            the patch tokens only.
        renormalize: the decoder reads ``LayerNorm(g)`` instead of ``g`` (the official release applies its energy
            LayerNorm twice before the decoder: once after the dynamics, once more inside its ``decode``).
        fill: ``None`` (default): a hidden patch starts as the MASK token and the decoder's output is the answer.
            ``"biharmonic"``: the hidden patches are first filled by biharmonic inpainting of the visible pixels
            (:func:`et_ode.models.fill.biharmonic_fill`, scikit-image's system, batched); a hidden token starts as the
            encoded fill plus the MASK token (which marks it as hidden) plus its position, and the answer is the
            fill plus the decoder's output, a correction computed from the final state. The decoder starts at zero,
            so the untrained model returns the fill and training teaches the dynamics to refine it.
            A callable ``fill(images (B, C, H, W), hidden (B, N)) -> (B, C, H, W)`` is any other classical fill (a
            nearest-neighbour mean, a learned-elsewhere inpainter), used the same way; its output must keep the
            visible patches (checked: a ``ValueError`` naming ``fill`` otherwise). It is not differentiated, and a
            model with one has no :meth:`config` (a function is not data): rebuild it with the same callable.
    """

    def __init__(
        self,
        image_shape: Sequence[int],
        patch: int,
        dim: int,
        heads: int,
        head_dim: int,
        memories: int | None = None,
        *,
        cls_token: bool = False,
        hopfield: HopfieldForm = "relu",
        self_attention: bool = False,
        tau: float = 1.0,
        dynamics: Dynamics = DEFAULT_INTEGRATION,
        cls_position: bool = False,
        renormalize: bool = False,
        fill: Literal["biharmonic"] | Fill | None = None,
    ):
        super().__init__()
        if not callable(fill) and fill not in FILLS:
            raise ValueError(f"fill must be one of {FILLS} or a callable (images, hidden) -> filled images, got {fill!r}")
        if len(image_shape) != 3 or not all(isinstance(s, int) and s >= 1 for s in image_shape):
            raise ValueError(f"image_shape must be (C, H, W) of positive integers, got {tuple(image_shape)}")
        c, h, w = image_shape
        if not (isinstance(patch, int) and patch >= 1) or h % patch or w % patch:
            raise ValueError(f"patch must be a positive integer dividing H={h} and W={w}, got {patch!r}")
        if isinstance(tau, bool) or not isinstance(tau, (int, float, numbers.Real)):
            raise TypeError(f"tau must be a real number, got {type(tau).__name__} {tau!r}")
        check_positive("tau", float(tau))
        if cls_position and not cls_token:
            raise ValueError("cls_position=True puts a position on the CLS token: it needs cls_token=True")
        self.image_shape = (c, h, w)
        self.patch = patch
        self.num_patches = (h // patch) * (w // patch)
        self.patch_dim = c * patch * patch
        if isinstance(dim, int) and not isinstance(dim, bool):
            extra = (2 * self.patch_dim + self.num_patches + 3) * dim + self.patch_dim
        else:
            extra = 0
        check_model_size(dim, heads, head_dim, memories, extra)
        self.dim = dim
        self.tau = float(tau)
        self.dynamics = check_dynamics("dynamics", dynamics)
        self.cls_position = bool(cls_position)
        self.renormalize = bool(renormalize)
        self.fill = fill
        self._block_args = dict(
            heads=heads, head_dim=head_dim, memories=memories or 4 * dim, hopfield=hopfield, self_attention=self_attention
        )
        self.block = EnergyTransformer(
            dim, heads, head_dim, memories or 4 * dim, hopfield=hopfield, self_attention=self_attention
        )
        self.encoder = nn.Linear(self.patch_dim, dim)
        self.decoder = nn.Linear(dim, self.patch_dim)
        if fill is not None:  # start from the classical fill: the decoder's correction is zero
            nn.init.zeros_(self.decoder.weight)
            nn.init.zeros_(self.decoder.bias)
        # Unit-scale tokens: the LayerNorm's rate gamma/sigma sets the speed of the dynamics, and a tiny token
        # (sigma ~ 0.02) would rotate fifty times faster than the others.
        self.position = nn.Parameter(torch.randn(self.num_patches + self.cls_position, dim) * 0.5)
        self.mask_token = nn.Parameter(torch.randn(dim) * 0.5)
        self.cls = nn.Parameter(torch.randn(1, dim) * 0.5) if cls_token else None

    @property
    def num_tokens(self) -> int:
        return self.num_patches + (self.cls is not None)

    def config(self) -> dict[str, Any]:
        """Constructor arguments, JSON-friendly: ``ImageET.from_config(model.config())`` rebuilds it (a
        ``TypeError`` for a callable ``fill``, which a config cannot hold)."""
        if callable(self.fill):
            raise TypeError(
                f"config(): fill={self.fill!r} is a callable, which a config cannot hold; build the model "
                "with ImageET(..., fill=...) again and load its state_dict"
            )
        return dict(
            image_shape=list(self.image_shape),
            patch=self.patch,
            dim=self.dim,
            **self._block_args,
            cls_token=self.cls is not None,
            tau=self.tau,
            dynamics=settings_to_dict(self.dynamics),
            cls_position=self.cls_position,
            renormalize=self.renormalize,
            fill=self.fill,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageET:
        """The model :meth:`config` describes (untrained weights).

        Args:
            config: the settings of :meth:`config`: ``image_shape``, ``patch``, ``dim``, ``heads``, ``head_dim`` and
                any of the optional constructor arguments (``dynamics`` as a settings dict).

        Returns:
            A new :class:`ImageET`.

        Raises:
            ValueError: not a dict, a required setting missing, an unknown setting, or a bad value (dynamics
                that cannot be rebuilt, sizes beyond ``MAX_PARAMETERS``), naming the setting.
        """
        if not isinstance(config, dict):
            raise ValueError(f"a model description must be a dict of settings, got {type(config).__name__}")
        config = dict(config)
        missing = [key for key in DESCRIPTION_REQUIRED if key not in config]
        unknown = sorted(set(config) - set(DESCRIPTION_REQUIRED) - set(DESCRIPTION_OPTIONAL))
        if missing or unknown:
            raise ValueError(f"the model description misses {missing} / has unknown settings {unknown}")
        dynamics: Dynamics = DEFAULT_INTEGRATION
        if "dynamics" in config:
            try:
                dynamics = check_dynamics("dynamics", settings_from_dict(config.pop("dynamics")))
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise ValueError(
                    f"the model description's 'dynamics' cannot be rebuilt: {type(error).__name__}: {error}"
                ) from None
        image_shape = config.pop("image_shape")
        if not isinstance(image_shape, (list, tuple)):
            raise ValueError(f"the model description's 'image_shape' must be [C, H, W], got {image_shape!r}")
        try:
            return cls(tuple(image_shape), dynamics=dynamics, **config)
        except TypeError as error:
            raise ValueError(f"the model description holds a bad setting: {error}") from None

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``; weights that do not fit this model (a missing, unexpected or misshapen
        entry) are a ValueError naming the entries instead of a RuntimeError.

        Args:
            state_dict: the weights, as :meth:`state_dict` gives them.
            strict: every entry of the model must be in ``state_dict`` and no other.
            assign: assign the tensors instead of copying into the parameters.

        Returns:
            ``nn.Module.load_state_dict``'s missing and unexpected keys.

        Raises:
            ValueError: the weights do not fit the model.
        """
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except (RuntimeError, TypeError, AttributeError) as error:
            first = " ".join(str(error).split())[:600] or type(error).__name__
            raise ValueError(f"the weights do not fit the model the file describes: {first}") from None

    def field(self) -> ETField:
        """The vector field of the block (a fresh NFE counter)."""
        return ETField(self.block, tau=self.tau)

    def _check_hidden(self, hidden: object, batch: int) -> Tensor:
        if not isinstance(hidden, Tensor) or hidden.dtype != torch.bool:
            raise TypeError(
                f"hidden must be a boolean tensor (B, N) with N={self.num_patches}, got "
                f"{type(hidden).__name__ if not isinstance(hidden, Tensor) else hidden.dtype}"
            )
        if tuple(hidden.shape) != (batch, self.num_patches):
            raise ValueError(f"hidden must have shape ({batch}, {self.num_patches}), got {tuple(hidden.shape)}")
        return hidden

    def filled(self, images: Tensor, hidden: Tensor) -> Tensor:
        """``images (B, C, H, W)`` with their ``hidden (B, N)`` patches replaced by the model's classical fill
        (``fill``); the images themselves for ``fill=None``. Not differentiated (the fill is a fixed function).

        Args:
            images: the images ``(B, C, H, W)`` of the model's ``image_shape``, floating point.
            hidden: the hidden patches, boolean ``(B, N)``.

        Returns:
            The filled images ``(B, C, H, W)``.

        Raises:
            TypeError: ``images`` is not a floating tensor, or ``hidden`` not a boolean tensor.
            ValueError: a shape that does not fit the model, or a callable ``fill`` whose output has the wrong shape
                or changes a visible patch.
        """
        images = _check_images(images, self.image_shape)
        hidden = self._check_hidden(hidden, images.shape[0])
        if self.fill is None:
            return images
        if callable(self.fill):
            with torch.no_grad():
                filled = self.fill(images, hidden)
            if not isinstance(filled, Tensor) or filled.shape != images.shape:
                raise ValueError(
                    f"fill must return the filled images of shape {tuple(images.shape)}, got "
                    f"{tuple(filled.shape) if isinstance(filled, Tensor) else type(filled).__name__}"
                )
            visible = ~hidden[..., None]
            if not torch.equal(patchify(filled, self.patch) * visible, patchify(images, self.patch) * visible):
                raise ValueError("fill must keep the visible patches of the images unchanged")
            return filled
        c, h, w = self.image_shape
        pixels = hidden.reshape(-1, h // self.patch, w // self.patch)
        pixels = pixels.repeat_interleave(self.patch, 1).repeat_interleave(self.patch, 2)
        return biharmonic_fill(images, pixels)

    def tokens(self, images: Tensor, hidden: Tensor) -> Tensor:
        """Initial state ``x0 (B, N(+1), D)``: encoded patches, the hidden ones replaced by MASK (with ``fill``: the
        encoded fill plus MASK), plus positions; CLS first if used (with ``cls_position``, CLS is put in front
        before the positions are added, so it gets one).

        Args:
            images: the images ``(B, C, H, W)`` of the model's ``image_shape``, floating point.
            hidden: the hidden patches, boolean ``(B, N)``.

        Returns:
            The initial state ``(B, N, D)``, or ``(B, 1 + N, D)`` with a CLS token.

        Raises:
            TypeError: ``images`` is not a floating tensor, or ``hidden`` not a boolean tensor.
            ValueError: a shape that does not fit the model, or a bad fill (see :meth:`filled`).
        """
        return self._tokens(self.filled(images, hidden), hidden)

    def _tokens(self, filled: Tensor, hidden: Tensor) -> Tensor:
        encoded = self.encoder(patchify(filled, self.patch))
        mask = self.mask_token.to(encoded.dtype)
        x0 = torch.where(hidden[..., None], mask if self.fill is None else encoded + mask, encoded)
        if not self.cls_position:
            x0 = x0 + self.position
        if self.cls is not None:
            x0 = torch.cat([self.cls.expand(x0.shape[0], 1, self.dim), x0], dim=1)
        if self.cls_position:
            x0 = x0 + self.position
        return x0

    def decode(self, g: Tensor) -> Tensor:
        """Patches ``(..., N, C P P)`` from normalized tokens ``g (..., N(+1), D)`` (the CLS token dropped; with
        ``renormalize``, the LayerNorm is applied to ``g`` once more first).

        Args:
            g: the normalized tokens ``(..., N, D)``, or ``(..., 1 + N, D)`` with a CLS token.

        Returns:
            The decoded patches ``(..., N, C P P)`` (the decoder's output, without the fill).
        """
        if self.cls is not None:
            g = g[..., 1:, :]
        if self.renormalize:
            g = self.block.neuron(g)
        return self.decoder(g)

    def forward(self, images: Tensor, hidden: Tensor, dynamics: Dynamics | None = None) -> Completion:
        """Complete ``images (B, C, H, W)`` whose patches ``hidden (B, N)`` are masked (with the model's dynamics, or
        ``dynamics`` when given).

        Args:
            images: the images ``(B, C, H, W)`` of the model's ``image_shape``, floating point.
            hidden: the hidden patches, boolean ``(B, N)``.
            dynamics: an :class:`~et_ode.Integration` or :class:`~et_ode.AttractorReadout` to run instead of the
                model's, or None.

        Returns:
            The completion: patches ``(B, N, C P P)`` and the solve.

        Raises:
            TypeError: ``images`` is not a floating tensor, or ``hidden`` not a boolean tensor.
            ValueError: a shape that does not fit the model, or a bad fill (see :meth:`filled`).
            et_ode.SolveError: the integration cannot go on.
        """
        filled = self.filled(images, hidden)
        solution = (dynamics or self.dynamics).answer(self.field(), self._tokens(filled, hidden))
        return Completion(self._answer(self.decode(solution.g), filled), solution)

    def _answer(self, decoded: Tensor, filled: Tensor) -> Tensor:
        """The patches ``(..., N, C P P)``: the decoder's output, added to the fill's patches when there is a fill."""
        return decoded if self.fill is None else decoded + patchify(filled, self.patch)

    def film(
        self,
        images: Tensor,
        hidden: Tensor,
        t: Tensor | Sequence[float] | None = None,
        integration: Integration | None = None,
        keep_visible: bool = True,
    ) -> tuple[Tensor, Solution]:
        """The completion over time: images ``(T, B, C, H, W)`` decoded at the saved times, and the solution.

        The flow is integrated by ``integration`` (default: the model's own, or ``Integration()`` for a model that
        reads its answer at the attractor), without a stop and gradients, and saved at the times ``t``: from 0 to
        the horizon (default 9 equal steps to ``integration.t1``; :class:`et_ode.EulerET` saves every step instead).
        ``keep_visible``: show the input in the visible patches (the decoder is trained on the hidden ones only); False
        shows the decoding of every token.

        Args:
            images: the images ``(B, C, H, W)`` of the model's ``image_shape``, floating point.
            hidden: the hidden patches, boolean ``(B, N)``.
            t: the saved times ``(T,)``, or None for the default.
            integration: the integration to run, or None for the default.
            keep_visible: show the input in the visible patches.

        Returns:
            The frames ``(T, B, C, H, W)`` clamped to ``[0, 1]``, and the solution.

        Raises:
            TypeError: ``images`` is not a floating tensor, or ``hidden`` not a boolean tensor.
            ValueError: a shape that does not fit the model, a bad fill, or a bad ``t`` for the solver.
            et_ode.SolveError: the integration cannot go on.
        """
        if integration is None:
            integration = self.dynamics if isinstance(self.dynamics, Integration) else Integration()
        if t is None and not isinstance(integration.solver, EulerET):
            t = torch.linspace(0.0, integration.t1, 9)
        t = None if t is None else torch.as_tensor(t, dtype=torch.float64)
        with torch.no_grad():
            filled = self.filled(images, hidden)
            solution = integration.replace(gradient=Direct(), stop=None).solve(self.field(), self._tokens(filled, hidden), t)
            frames = self._answer(self.decode(self.block.neuron(solution.xs)), filled)  # (T, B, N, C P P)
            if keep_visible:
                frames = torch.where(hidden[..., None], frames, patchify(images, self.patch))
        return unpatchify(frames, self.patch, self.image_shape).clamp(0, 1), solution


# ----------------------------------------------------------------------------------------------- the task
def _unwrap(model: nn.Module) -> Any:
    """The module inside a DDP wrapper: an :class:`ImageET` or a baseline (both have ``patch``)."""
    return getattr(model, "module", model)


def _images_of(batch: Any) -> Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class CompletionTask:
    """Masked-patch completion for :func:`et_ode.training.train.fit`.

    Training batches are images ``(B, C, H, W)`` (or tuples whose first item is the images); masks are
    drawn with the global RNG (restored on resume). Under data parallelism each of the ``W`` ranks holds every
    ``W``-th example of the global batch (see :func:`et_ode.training.train.fit`): every rank draws the masks of the whole
    global batch (their RNGs agree) and keeps its examples' ones, so ``W`` processes draw exactly the masks one
    process would on the global batch (not ``W`` copies of the same masks). Evaluation batches are
    ``(images, hidden, scored)`` with fixed masks (:func:`fixed_mask_set`), so every model and baseline is
    scored on the same patches.

    Args:
        ratio: the scored share of the patches, in ``(0, 1)`` (:func:`random_masks`).
        visible_fraction: the share of the scored patches left visible, in ``[0, 1)``.

    Raises:
        ValueError: ``ratio`` or ``visible_fraction`` is out of range.
    """

    def __init__(self, ratio: float, visible_fraction: float = 0.0):
        if not (isinstance(ratio, (int, float)) and 0 < ratio < 1):
            raise ValueError(f"mask ratio must be in (0, 1) (the fraction of patches scored), got {ratio!r}")
        if not 0 <= visible_fraction < 1:
            raise ValueError(f"visible_fraction must be in [0, 1), got {visible_fraction!r}")
        self.ratio = ratio
        self.visible_fraction = visible_fraction
        self._solution: Solution | None = None  # the last training solve, read by after_backward

    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, float]]:
        """The masked-patch MSE of ``model`` on ``batch`` with freshly drawn masks.

        Args:
            model: an :class:`ImageET` or a baseline (possibly inside a DDP wrapper).
            batch: images ``(B, C, H, W)``, or a tuple whose first item they are.

        Returns:
            The loss (a 0-d tensor) and metrics: ``mse``, and ``nfe`` and ``energy`` when the model solves dynamics.
        """
        images = _images_of(batch)
        core = _unwrap(model)
        rank, world = devices.rank(), devices.world_size()
        hidden, scored = random_masks(
            images.shape[0] * world,
            core.num_patches,
            self.ratio,
            visible_fraction=self.visible_fraction,
            device=images.device,
        )
        hidden, scored = hidden[rank::world], scored[rank::world]
        out = model(images, hidden)
        loss = masked_mse(out.patches, patchify(images, core.patch), scored)
        metrics = {"mse": float(loss.detach())}
        if out.solution is not None:
            metrics.update(nfe=float(out.solution.stats.nfe_forward), energy=float(out.solution.energies[-1].mean()))
        self._solution = out.solution
        return loss, metrics

    def after_backward(self) -> dict[str, float]:
        """``{"nfe_backward": ...}``: field evaluations of the last loss's backward pass (the adjoint's backward
        solve or the implicit gradient's; 0 when gradients flow through the solver's steps)."""
        solution, self._solution = self._solution, None
        return {} if solution is None else {"nfe_backward": float(solution.stats.nfe_backward)}

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """The metrics of :func:`evaluate_completion`.

        Args:
            model: an :class:`ImageET` or a baseline.
            batches: ``(images (B, C, H, W), hidden (B, N), scored (B, N))`` triples.

        Returns:
            The metrics of :func:`evaluate_completion`.

        Raises:
            ValueError: no scored patch in ``batches``.
        """
        return evaluate_completion(model, batches)


def evaluate_completion(model: nn.Module, batches: Iterable[Any], dynamics: Dynamics | None = None) -> dict[str, float]:
    """Masked-patch MSE over all scored pixels of ``batches`` of ``(images, hidden, scored)``.

    ``model(images, hidden)`` returns a :class:`Completion` (an :class:`ImageET` or a baseline). Also returns,
    when the model solves dynamics, the mean forward NFE per batch, the mean final energy and residual
    (RMS |dg/dt|), the total solve time in seconds and the mean final time per batch.

    Args:
        model: an :class:`ImageET` or a baseline (possibly inside a DDP wrapper).
        batches: ``(images (B, C, H, W), hidden (B, N), scored (B, N))`` triples.
        dynamics: the dynamics to run instead of the model's, or None.

    Returns:
        ``mse``, and with dynamics ``nfe``, ``energy``, ``residual``, ``solve_seconds`` and ``t_final``.

    Raises:
        ValueError: no scored patch in ``batches``.
    """
    squared, count, images_seen = 0.0, 0.0, 0
    nfe, energy, residual, seconds, t_final, solves = 0.0, 0.0, 0.0, 0.0, 0.0, 0
    patch = _unwrap(model).patch
    for images, hidden, scored in batches:
        out = model(images, hidden) if dynamics is None else model(images, hidden, dynamics=dynamics)
        weight = scored.to(out.patches.dtype)[..., None]
        squared += float(((out.patches - patchify(images, patch)).square() * weight).sum())
        count += float(weight.sum()) * out.patches.shape[-1]
        images_seen += images.shape[0]
        if out.solution is not None:
            solves += 1
            nfe += out.solution.stats.nfe_forward
            seconds += out.solution.stats.wall_time
            t_final += out.solution.stats.t_final
            energy += float(out.solution.energies[-1].sum())
            residual += float(out.solution.residual.sum())
    if count == 0:
        raise ValueError("evaluation saw no scored patch (empty data?)")
    metrics = {"mse": squared / count}
    if solves:
        metrics.update(
            nfe=nfe / solves,
            energy=energy / images_seen,
            residual=residual / images_seen,
            solve_seconds=seconds,
            t_final=t_final / solves,
        )
    return metrics


def fixed_mask_set(
    images: Tensor, num_patches: int, ratio: float, visible_fraction: float = 0.0, seed: int = 0
) -> torch.utils.data.TensorDataset:
    """``TensorDataset(images, hidden, scored)`` with masks fixed by ``seed``: a reproducible evaluation set.

    Args:
        images: the images ``(n, C, H, W)``.
        num_patches: patches per image ``N``.
        ratio: the scored share of the patches, in ``(0, 1)``.
        visible_fraction: the share of the scored patches left visible, in ``[0, 1)``.
        seed: the seed of the masks.

    Returns:
        The data set of ``(images, hidden (n, N), scored (n, N))``.

    Raises:
        ValueError: ``ratio`` or ``visible_fraction`` is out of range (see :func:`random_masks`).
    """
    generator = torch.Generator().manual_seed(seed)
    hidden, scored = random_masks(
        images.shape[0], num_patches, ratio, visible_fraction=visible_fraction, generator=generator
    )
    return torch.utils.data.TensorDataset(images, hidden, scored)
