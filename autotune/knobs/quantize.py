"""How the denoiser's weights are stored: torchao quantization, or fp8 storage with layerwise casting.

Both rewrite the weights, so both come after fuse_qkv in APPLY_ORDER (a quantized or fp8 weight
cannot be concatenated into a fused projection), and they exclude each other (knobs.CONFLICTS).
A config with either is built on the host and reaches the device already rewritten
(knobs.build_device).

The VAE is not quantized, though issue #4 names it as optional: torchao's configs quantize linear
layers, and 2.5% of the VAE's weights are in them (2.1M of 83.7M parameters in the VAEs of SDXL,
SD1.5, SD3 and Flux, counted from their shipped configs); the rest, and its time, are convolutions.
"""

from __future__ import annotations

import torch

from .base import Knob, denoiser, package_missing
from .memory import places_on_device

# The linear shapes the SDXL guide ("Accelerate inference of text-to-image diffusion models")
# leaves in bfloat16 under dynamic int8: for these, quantizing the activations cost more than the
# int8 matmul saved. Layers with 16 or fewer input features are left alone too.
_SDXL_GUIDE_SKIPPED_SHAPES = {
    (1280, 640), (1920, 1280), (1920, 640), (2048, 1280), (2048, 2560), (2560, 1280), (256, 128),
    (2816, 1280), (320, 640), (512, 1536), (512, 256), (512, 512), (640, 1280), (640, 1920),
    (640, 320), (640, 5120), (640, 640), (960, 320), (960, 640),
}


def guide_filter(module, fqn: str = "") -> bool:
    """The SDXL guide's `dynamic_quant_filter_fn`: which linear layers dynamic int8 pays for."""
    return (
        isinstance(module, torch.nn.Linear)
        and module.in_features > 16
        and (module.in_features, module.out_features) not in _SDXL_GUIDE_SKIPPED_SHAPES
    )


# The quantize choices that quantize activations to int8 at each call (all layers, or the guide's
# filter): the inductor_flags knob adds inductor's int8 matmul fusions for them.
DYNAMIC_INT8 = ("int8dq", "int8dq-filtered")


def _torchao_config(value, on_host: bool = False):
    from torchao.quantization import quant_api as q  # here: torchao is heavy to import

    # set_inductor_config=False: torchao's default turns on coordinate-descent tuning and the int-mm
    # fusion for the whole process, so quantizing the text encoders would change how the denoiser
    # compiles and `inductor_flags=False` would not mean what it says. The inductor_flags knob owns them.
    owned = {"set_inductor_config": False}
    if value == "int8wo":
        return q.Int8WeightOnlyConfig(**owned)
    if value in DYNAMIC_INT8:
        return q.Int8DynamicActivationInt8WeightConfig(**owned)
    if value == "float8dq":
        # A row of zeros has a zero scale and quantizes to 0/0 = NaN (torchao 0.18 bounds the
        # row's max only when told to). SDXL's unconditional text embeddings are all zeros
        # (force_zeros_for_empty_prompt), so its cross-attention projections meet such rows.
        # On the host (offload keeps weights there), torch's own quantize kernel: where the mslk
        # package is installed, torchao's AUTO picks mslk's, which runs on a GPU only.
        if on_host:
            from torchao.quantization.quantize_.common import KernelPreference

            owned["kernel_preference"] = KernelPreference.TORCH
        return q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow(), activation_value_lb=1e-12, **owned)
    if value == "int4wo":
        # torchao 0.18's default packing (PLAIN) needs the mslk package; the tile-packed format
        # runs on torch's own tinygemm kernel (CUDA, SM >= 8.0, bfloat16 weights).
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        return q.Int4WeightOnlyConfig(group_size=128, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D, **owned)
    raise ValueError(value)


def _quantize_on(target, config):
    """Where quantize_ should quantize: on the GPU, one module at a time (quantize_ moves each
    there just before quantizing it), when the pipeline is to live there and was built on the
    host for this; None (in place) otherwise, e.g. for offload, whose hooks keep weights on the host."""
    return target.device if target.is_cuda and places_on_device(config) else None


def _apply_quantize(pipe, value, target, config):
    if value == "none":
        return
    from torchao.quantization import quantize_

    kwargs = {"filter_fn": guide_filter} if value == "int8dq-filtered" else {}
    on = _quantize_on(target, config)
    quantize_(denoiser(pipe), _torchao_config(value, on_host=on is None), device=on, **kwargs)


_CUDA_ONLY = {
    "float8dq": ((8, 9), "float8 matmuls (torch._scaled_mm) need a CUDA GPU of compute capability 8.9 or more"),
    "int4wo": ((8, 0), "the int4 tinygemm kernel needs a CUDA GPU of compute capability 8.0 or more"),
}


def _quantize_unavailable(value, target):
    if value == "none":
        return None
    if value in _CUDA_ONLY:
        least, reason = _CUDA_ONLY[value]
        # unlike the attention kernels, an unknown capability is taken as too low here
        if not target.is_cuda or target.capability is None or target.capability_below(least):
            here = f"compute capability {target.capability}" if target.is_cuda else "a CPU"
            return f"{reason} ({here} here)"
    return package_missing("torchao")


QUANTIZE = Knob(
    name="quantize",
    choices=("none", "int8wo", *DYNAMIC_INT8, "float8dq", "int4wo"),
    default="none",
    help="torchao quantization of the denoiser's linear layers: int8 weight-only, dynamic int8 "
    "(all layers, or the SDXL guide's filter), dynamic float8 row-wise, int4 weight-only",
    apply=_apply_quantize,
    unavailable=_quantize_unavailable,
)


# The pipeline attributes a text encoder may be under (SD1.5 has the first only, SD3 all three)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def _apply_quantize_text_encoders(pipe, value, target, config):
    if value == "none":
        return
    from torchao.quantization import quantize_

    # Flux's and SD3's T5-XXL is the largest component after the denoiser (4.7B parameters): its
    # weights in int8 free most of its memory; it runs once per prompt, so speed matters little.
    for name in TEXT_ENCODERS:
        encoder = getattr(pipe, name, None)
        if encoder is not None:
            quantize_(encoder, _torchao_config(value), device=_quantize_on(target, config))


QUANTIZE_TEXT_ENCODERS = Knob(
    name="quantize_text_encoders",
    choices=("none", "int8wo"),
    default="none",
    help="torchao int8 weight-only quantization of the text encoders (CLIP, T5)",
    apply=_apply_quantize_text_encoders,
    unavailable=lambda value, target: package_missing("torchao") if value != "none" else None,
)


# layerwise_casting's storage formats, and the torch dtype of each
_FP8_DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
FP8_FORMATS = tuple(_FP8_DTYPES)


def _apply_layerwise_casting(pipe, value, target, config):
    if value == "none":
        return
    # Weights are stored in fp8 and upcast, layer by layer, to the config's dtype for compute.
    # diffusers skips the precision-critical layers (norms, embeddings) by its own patterns.
    denoiser(pipe).enable_layerwise_casting(storage_dtype=_FP8_DTYPES[value], compute_dtype=pipe.dtype)


LAYERWISE_CASTING = Knob(
    name="layerwise_casting",
    choices=("none", *FP8_FORMATS),
    default="none",
    help="store the denoiser's weights in fp8 and upcast each layer for compute (lossy, less memory)",
    apply=_apply_layerwise_casting,
    memory_rank={"none": 1, "fp8-e4m3": 0, "fp8-e5m2": 0},  # 1 byte per weight against 2 or 4
)
