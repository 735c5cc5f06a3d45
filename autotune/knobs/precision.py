"""Numeric precision: the dtype of every component, and CUDA's process-global math flags."""

from __future__ import annotations

import torch

from ..errors import warn_at_caller
from .base import Knob, Outrun, ProcessSettings, needs_cuda

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _apply_dtype(pipe, value, target, config):
    # Pipelines are loaded in this dtype already (models.build_pipeline takes it); casting here
    # makes `Profile.apply` on a pipeline the user loaded in another dtype reach the same state.
    # Component by component with the loader's rule, not pipe.to(dtype=): that would also cast the
    # modules a model keeps in float32 (T5's `wo` in float16, against overflow), which the trial kept.
    from ..models import cast_model

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            first = next(component.parameters(), None)  # where the component is: it stays there
            cast_model(component, DTYPES[value], first.device if first is not None else pipe.device)
    # SDXL's original VAE overflows in float16 (NaN, black images); its config says force_upcast
    # and the pipeline then decodes in float32. Nothing here touches that flag (tests/test_catalogue.py
    # checks it); a VAE whose config says otherwise (the fp16-fix VAE) is float16-safe by its word.


# x86 flags of native half-precision arithmetic. Without them torch converts each value to float32
# and back: on a 2-core AMD EPYC (avx512_bf16, no avx512_fp16), SD1.5 at 128x128 ran a call in
# 16.7 s in float16 (+ channels_last), 7.3 s in float32 and 2.6 s in bfloat16, and a frozen
# float16 compile ran past the 900 s trial timeout (versus_hand_tuning.py, 2026-12-02:
# benchmarks/results/versus_hand_tuning-epyc-1202.md: its guide-sd15 and default contestants,
# the 3.00 GiB study's trial 1, the 23.54 GiB study's trial 19).
NATIVE_BFLOAT16 = ("avx512_bf16", "amx_bf16")
NATIVE_FLOAT16 = ("avx512_fp16", "amx_fp16")


def _dtype_unavailable(value, target):
    """float16 left out of a CPU's search where the CPU computes bfloat16 natively and float16
    not: bfloat16 needs no more memory (memory_rank) and runs several times faster there. Where
    the flags say otherwise, or say nothing (another OS, an Arm CPU), both are searched."""
    if value != "float16" or target.is_cuda:
        return None
    from ..fingerprint import cpu_flags

    flags = cpu_flags()
    native_bf16 = [f for f in NATIVE_BFLOAT16 if f in flags]
    if native_bf16 and not any(f in flags for f in NATIVE_FLOAT16):
        return Outrun(f"this CPU computes bfloat16 natively ({native_bf16[0]}) and float16 not (no "
                      f"{' or '.join(NATIVE_FLOAT16)}): float16 needs as much memory and ran 2.3x slower "
                      "than float32, 6.5x slower than bfloat16, on such a CPU", by="bfloat16")
    return None


DTYPE = Knob(
    name="dtype",
    choices=tuple(DTYPES),
    default="float32",
    help="weight and activation dtype of every component (SDXL's pipeline still decodes a float16 VAE in "
    "float32 where the VAE's config asks it to)",
    apply=_apply_dtype,
    unavailable=_dtype_unavailable,
    # 4 bytes per weight against 2; float16 above bfloat16: SDXL's VAE decodes upcast to float32
    # in float16 (force_upcast), and T5 keeps its `wo` layers in float32 in float16
    memory_rank={"float32": 2, "float16": 1, "bfloat16": 0},
)


# The SDXL VAE fine-tuned to stay finite in float16 (the original overflows: NaN, black images),
# so it decodes in float16 instead of being upcast to float32 for every decode.
SDXL_VAE_FP16_FIX = "madebyollin/sdxl-vae-fp16-fix"


def _hub_cache() -> str:
    # Read at each call, not at import: huggingface_hub fixes its constants when imported, and
    # HF_HUB_CACHE may point elsewhere in the process that asks (tests do).
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _fp16_fix_unavailable(value, target):
    if not value:
        return None
    if target.family != "sdxl":
        return "the fp16-fix VAE is a replacement for SDXL's VAE"
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(SDXL_VAE_FP16_FIX, "config.json", cache_dir=_hub_cache()), str):
        return (f"{SDXL_VAE_FP16_FIX} is not in the local Hugging Face cache (nothing is downloaded; "
                f"`hf download {SDXL_VAE_FP16_FIX}` makes it a choice)")
    return None


def _apply_vae_fp16_fix(pipe, value, target, config):
    if not value:
        return
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(SDXL_VAE_FP16_FIX, torch_dtype=pipe.dtype, cache_dir=_hub_cache(),
                                        local_files_only=True)
    # Where the rest of the pipeline is: on the device, or on the host (for offload hooks to
    # place, or until quantization is done: knobs.apply_config moves it then).
    pipe.vae = vae.to(pipe.device)


VAE_FP16_FIX = Knob(
    name="vae_fp16_fix",
    choices=(False, True),
    default=False,
    help=f"replace SDXL's VAE by {SDXL_VAE_FP16_FIX} from the local cache: decodes in float16 "
    "instead of being upcast to float32",
    apply=_apply_vae_fp16_fix,
    unavailable=_fp16_fix_unavailable,
)


# The two flags below are process-global: a trial is its own process, and in serving, applying a
# profile sets them for the whole process, under both choices (base.ProcessSettings).
def _matmul_precision() -> str | None:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # pytorch#196728: the per-backend setter was used; that is left alone
        return None


_TORCH_FLAGS = ProcessSettings(lambda: {"matmul": _matmul_precision(), "cudnn_tf32": torch.backends.cudnn.allow_tf32,
                                        "cudnn_benchmark": torch.backends.cudnn.benchmark})


# torch's own defaults, which the trials ran with (each a fresh process) under both False choices.
_TORCH_DEFAULTS = {"matmul": "highest", "cudnn_tf32": True, "cudnn_benchmark": False}


def _kept_otherwise(flag: str, knob: str, said: str, reset: str) -> None:
    """Warn where a False choice puts back a setting the serving process had made before autotune
    first set any (False keeps it, not to override its owner) and that is not what the trials
    measured."""
    had = _TORCH_FLAGS.before()[flag]
    if had is not None and had != _TORCH_DEFAULTS[flag]:
        warn_at_caller(f"{said} was {had!r} in this process when autotune first configured a pipeline in it, and "
                       f"{knob}: false keeps that; its trials ran "
                       f"with torch's default {_TORCH_DEFAULTS[flag]!r}, so this pipeline may run faster or slower and "
                       f"compute slightly otherwise than measured ({reset} before the first profile is applied, to serve "
                       "what was measured)")


def _apply_tf32(pipe, value, target, config):
    # Through the process-wide matmul precision, which sets cuBLAS's TF32 as the per-backend
    # setter would. Inductor still reads it (torch.get_float32_matmul_precision), and that getter
    # raises once the per-backend setter (torch.backends.cuda.matmul.fp32_precision = "tf32") has
    # been used: every max-autotune compile then fails (pytorch#196728).
    before = _TORCH_FLAGS.before()
    matmul = "high" if value else before["matmul"]
    if matmul is not None:
        torch.set_float32_matmul_precision(matmul)
    # Convolutions run in TF32 by torch's default, in both choices (the float32 reference too):
    # True makes sure of it, False keeps what the process had.
    torch.backends.cudnn.allow_tf32 = True if value else before["cudnn_tf32"]
    _TORCH_FLAGS.configured("TF32 (torch's float32 matmul precision)", (matmul, torch.backends.cudnn.allow_tf32))
    if not value:
        _kept_otherwise("matmul", "tf32", "the float32 matmul precision", "torch.set_float32_matmul_precision('highest')")
        if target.device.startswith("cuda"):  # cuDNN runs nothing of a CPU pipeline
            _kept_otherwise("cudnn_tf32", "tf32", "torch.backends.cudnn.allow_tf32", "set it to True")


TF32 = Knob(
    name="tf32",
    choices=(False, True),
    default=False,
    help="TF32 tensor-core math for float32 matmuls (Ampere+; tiny drift); convolutions use TF32 "
    "by torch's default either way",
    apply=_apply_tf32,
    unavailable=needs_cuda("TF32"),
)


def _apply_cudnn_benchmark(pipe, value, target, config):
    # True: cuDNN times its convolution algorithms at the first call of each shape and keeps the
    # fastest (the warm-up pays for it).
    torch.backends.cudnn.benchmark = True if value else _TORCH_FLAGS.before()["cudnn_benchmark"]
    _TORCH_FLAGS.configured("cuDNN benchmark", torch.backends.cudnn.benchmark)
    if not value and target.device.startswith("cuda"):
        _kept_otherwise("cudnn_benchmark", "cudnn_benchmark", "torch.backends.cudnn.benchmark", "set it to False")


CUDNN_BENCHMARK = Knob(
    name="cudnn_benchmark",
    choices=(False, True),
    default=False,
    help="let cuDNN time its convolution algorithms at the first call and keep the fastest",
    apply=_apply_cudnn_benchmark,
    unavailable=needs_cuda("the cuDNN autotuner"),
)
