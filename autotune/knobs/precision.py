"""Numeric precision of the weights and activations."""

from __future__ import annotations

import torch

from .base import Knob

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _apply_dtype(pipe, value, target):
    # Pipelines are loaded in this dtype already (models.build_pipeline takes it); casting here
    # makes `Profile.apply` on a pipeline the user loaded in another dtype reach the same state.
    # SDXL's VAE keeps its own fp32 upcast for decoding (force_upcast): never NaN.
    if pipe.dtype != DTYPES[value]:
        pipe.to(dtype=DTYPES[value])


DTYPE = Knob(
    name="dtype",
    choices=tuple(DTYPES),
    default="float32",
    help="weight and activation dtype of every component",
    apply=_apply_dtype,
    memory_rank={"float32": 1, "bfloat16": 0, "float16": 0},  # 4 bytes per weight against 2
)
