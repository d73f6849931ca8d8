"""Task models built on the ET block: image completion and graphs (classification, node scoring)."""

from .graph import GraphET
from .image import (
    CompletionTask,
    ImageET,
    SolverSettings,
    evaluate_completion,
    fixed_mask_set,
    masked_mse,
    patchify,
    random_masks,
    unpatchify,
)

__all__ = [
    "CompletionTask",
    "GraphET",
    "ImageET",
    "SolverSettings",
    "evaluate_completion",
    "fixed_mask_set",
    "masked_mse",
    "patchify",
    "random_masks",
    "unpatchify",
]
