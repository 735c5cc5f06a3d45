"""Which attention implementation runs."""

from __future__ import annotations

from .base import Knob

# slice sizes in diffusers' terms: "auto" halves the heads per step, "max" runs one head at a time
_SLICES = {"sliced": "auto", "sliced-max": "max"}


def _apply_attention(pipe, value, target):
    # "sdpa" is what diffusers installs by default (AttnProcessor2_0, torch's
    # scaled_dot_product_attention): nothing to do, and leaving the processors alone keeps the
    # fused ones that fuse_qkv may have installed.
    if value in _SLICES:
        pipe.enable_attention_slicing(_SLICES[value])


def _attention_unavailable(value, target):
    if value in _SLICES and not target.has_unet:
        return f"attention slicing is a no-op for {target.family} (only UNet models slice attention)"
    return None


ATTENTION = Knob(
    name="attention",
    choices=("sdpa", *_SLICES),
    default="sdpa",
    help="attention implementation: PyTorch SDPA, or sliced attention (less memory, slower)",
    apply=_apply_attention,
    unavailable=_attention_unavailable,
)
