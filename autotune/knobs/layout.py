"""How weights and tensors are laid out: fused attention projections, channels_last."""

from __future__ import annotations

import torch

from .base import Knob


# Per fused projection, the separate ones it replaces. diffusers keeps those beside it, to unfuse
# later; the fused processors never call them.
_FUSED_FROM = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),  # cross-attention: the query still comes from to_q
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}
SEPARATE_PROJECTIONS = frozenset(name for separate in _FUSED_FROM.values() for name in separate)


class DroppedProjection(torch.nn.Module):
    """Stands where a separate projection was, fused into another and dropped: it holds no
    weights, and says what happened where something reaches for it. A LoRA loaded afterwards
    with layers for it is refused by peft, which cannot wrap it (its error shows this repr);
    had the attribute been None, peft skipped those layers without a word and the LoRA changed
    only the layers left. Called, by whatever needs the separate projections again (unfusing,
    attention slicing, xFormers or an IP-Adapter's processors set after the profile), it raises."""

    def __init__(self, fused_into: str):
        super().__init__()
        self.fused_into = fused_into

    def extra_repr(self) -> str:
        return (f"fused into {self.fused_into} and dropped by an autotune profile's fuse_qkv; a LoRA for it must be "
                "fused into the weights (pipe.fuse_lora(), then pipe.unload_lora_weights()) before the profile is applied")

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"this projection was fused into {self.fused_into} and dropped by an autotune profile's fuse_qkv: what "
            "calls it (unfusing, or an attention processor set after the profile was applied: attention slicing, "
            "xFormers, an IP-Adapter) cannot run on this pipeline; for those, serve a configuration without "
            "fuse_qkv (another point of the profile's front, or a study tuned without it)")


def drop_unfused_projections(model: torch.nn.Module) -> int:
    """Replace the separate projections a fused attention module no longer calls with a
    DroppedProjection; the parameters removed. They are a quarter of SDXL's UNet (648M of 2567M
    parameters), 18% of Flux's transformer, 17% of SD3's: kept, fuse_qkv would cost that much
    memory. The price: this pipeline cannot be unfused again."""
    removed = 0
    for module in model.modules():
        if not getattr(module, "fused_projections", False):
            continue
        for fused, separate in _FUSED_FROM.items():
            if getattr(module, fused, None) is None:
                continue
            for name in separate:
                old = getattr(module, name, None)
                if isinstance(old, torch.nn.Module) and not isinstance(old, DroppedProjection):
                    removed += sum(p.numel() for p in old.parameters())
                    setattr(module, name, DroppedProjection(fused))
    return removed


def _apply_fuse_qkv(pipe, value, target, config):
    if not value:
        return
    if target.has_unet:
        # Fuses q/k/v (k/v for cross-attention) in the UNet and the VAE and installs
        # FusedAttnProcessor2_0 on both.
        pipe.fuse_qkv_projections()
        fused = ("unet", "vae")
    else:
        pipe.transformer.fuse_qkv_projections()
        fused = ("transformer",)
    for name in fused:
        drop_unfused_projections(getattr(pipe, name))


FUSE_QKV = Knob(
    name="fuse_qkv",
    choices=(False, True),
    default=False,
    help="fuse the q/k/v projections of attention into one matmul (and drop the separate ones)",
    apply=_apply_fuse_qkv,
)


def _apply_channels_last(pipe, value, target, config):
    if not value:
        return
    # Only convolutional networks gain from NHWC: the UNet and the VAE, not a transformer.
    if target.has_unet:
        pipe.unet.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)


CHANNELS_LAST = Knob(
    name="channels_last",
    choices=(False, True),
    default=False,
    help="NHWC memory format for the convolutions (a UNet's and the VAE's)",
    apply=_apply_channels_last,
)


__all__ = ["FUSE_QKV", "CHANNELS_LAST", "drop_unfused_projections"]
