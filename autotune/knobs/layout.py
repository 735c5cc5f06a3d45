"""How weights and tensors are laid out: fused attention projections, channels_last."""

from __future__ import annotations

import functools

import torch

from ..errors import AutotuneError
from .base import Knob


# Per fused projection, the separate ones it replaces. diffusers keeps those beside it, to unfuse
# later; the fused processors never call them.
_FUSED_FROM = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),  # cross-attention: the query still comes from to_q
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}


def drop_unfused_projections(model: torch.nn.Module) -> int:
    """Remove the separate projections a fused attention module no longer calls; the parameters
    removed. They are a quarter of SDXL's UNet (648M of 2567M parameters), 18% of Flux's
    transformer, 17% of SD3's: kept, fuse_qkv would cost that much memory. The price: this
    pipeline cannot be unfused again (unfuse_qkv_projections would call them)."""
    removed = 0
    for module in model.modules():
        if not getattr(module, "fused_projections", False):
            continue
        for fused, separate in _FUSED_FROM.items():
            if getattr(module, fused, None) is None:
                continue
            for name in separate:
                old = getattr(module, name, None)
                if isinstance(old, torch.nn.Module):
                    removed += sum(p.numel() for p in old.parameters())
                    setattr(module, name, None)
    return removed


def dropped_projections(model: torch.nn.Module) -> list[str]:
    """The paths of the separate projections drop_unfused_projections removed from `model`."""
    return [f"{path}.{name}" for path, module in model.named_modules() if getattr(module, "fused_projections", False)
            for fused, separate in _FUSED_FROM.items() if getattr(module, fused, None) is not None
            for name in separate if getattr(module, name, "kept") is None]


def refuse_lora_on_dropped_projections(model: torch.nn.Module, model_name: str) -> None:
    """Make a LoRA loaded after the fusion (load_lora_weights, load_lora_adapter, add_adapter) that
    targets a dropped projection fail, loading nothing of it. peft skips a target it does not find
    in silence, so such a LoRA changed only the layers left (a cross-attention's query, the output
    projections) and the images were wrong without a word. peft has no hook for this, so the
    model's two entry points to it are wrapped on this instance."""
    for method in ("load_lora_adapter", "add_adapter"):
        loads = getattr(model, method, None)
        if loads is None:
            continue

        @functools.wraps(loads)
        def load_checked(*args, _loads=loads, **kwargs):
            before = set(getattr(model, "peft_config", None) or {})
            try:
                result = _loads(*args, **kwargs)  # needs peft: imported by then
            except ValueError as exc:  # peft: none of the targets found, as where all were q/k/v
                exc.add_note(f"autotune: the profile's fused QKV dropped the {model_name}'s separate q/k/v "
                             "projections; a LoRA for them must be fused into the weights before the profile is applied")
                raise
            from peft.tuners.tuners_utils import check_target_module_exists  # peft's own target matching

            for adapter in set(getattr(model, "peft_config", None) or {}) - before:
                missed = [path for path in dropped_projections(model)
                          if check_target_module_exists(model.peft_config[adapter], path)]
                if missed:
                    model.delete_adapters(adapter)
                    raise AutotuneError(
                        f"LoRA adapter '{adapter}' has layers for the {model_name}'s q/k/v projections, which the "
                        f"profile's fused QKV dropped ({missed[0]}{f' and {len(missed) - 1} more' if len(missed) > 1 else ''}): "
                        "it was not loaded. "
                        "Load it into a freshly loaded pipeline, fuse it into the weights (pipe.fuse_lora(), then "
                        "pipe.unload_lora_weights()) and apply the profile after")
            return result

        setattr(model, method, load_checked)


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
        refuse_lora_on_dropped_projections(getattr(pipe, name), name)


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
