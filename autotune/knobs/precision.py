"""Numeric precision: the dtype of every component, and CUDA's process-global math flags."""

from __future__ import annotations

import torch

from .base import Knob, needs_cuda

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _apply_dtype(pipe, value, target, config):
    # Pipelines are loaded in this dtype already (models.build_pipeline takes it); casting here
    # makes `Profile.apply` on a pipeline the user loaded in another dtype reach the same state.
    if pipe.dtype != DTYPES[value]:
        pipe.to(dtype=DTYPES[value])
    # SDXL's original VAE overflows in float16 (NaN, black images); its config says force_upcast
    # and the pipeline then decodes in float32. Nothing here touches that flag (tests/test_catalogue.py
    # checks it); a VAE whose config says otherwise (the fp16-fix VAE) is float16-safe by its word.


DTYPE = Knob(
    name="dtype",
    choices=tuple(DTYPES),
    default="float32",
    help="weight and activation dtype of every component (SDXL's VAE keeps its fp32 upcast)",
    apply=_apply_dtype,
    memory_rank={"float32": 1, "bfloat16": 0, "float16": 0},  # 4 bytes per weight against 2
)


# The two flags below are process-global. A trial is its own process, and in production they are
# set when the profile is applied; the default (False) leaves whatever the process has.
def _apply_tf32(pipe, value, target, config):
    if not value:
        return
    # torch >= 2.9 names precision per backend (fp32_precision); mixing it with the legacy
    # allow_tf32 flags raises, so use the new one where it exists.
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):
        matmul.fp32_precision = "tf32"
        conv.fp32_precision = "tf32"
    else:  # older torch
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


TF32 = Knob(
    name="tf32",
    choices=(False, True),
    default=False,
    help="TF32 tensor-core math for float32 matmuls and convolutions (Ampere+; tiny drift)",
    apply=_apply_tf32,
    unavailable=needs_cuda("TF32"),
)


def _apply_cudnn_benchmark(pipe, value, target, config):
    if value:
        # cuDNN times its convolution algorithms at the first call of each shape and keeps the
        # fastest: the warm-up pays for it.
        torch.backends.cudnn.benchmark = True


CUDNN_BENCHMARK = Knob(
    name="cudnn_benchmark",
    choices=(False, True),
    default=False,
    help="let cuDNN time its convolution algorithms at the first call and keep the fastest",
    apply=_apply_cudnn_benchmark,
    unavailable=needs_cuda("the cuDNN autotuner"),
)
