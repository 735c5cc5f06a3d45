"""How weights and tensors are laid out: fused attention projections, channels_last."""

from __future__ import annotations

import torch

from .base import Knob, denoiser


def _apply_fuse_qkv(pipe, value, target, config):
    if not value:
        return
    if target.has_unet:
        # Fuses q/k/v (k/v for cross-attention) in the UNet and the VAE and installs
        # FusedAttnProcessor2_0 on both.
        pipe.fuse_qkv_projections()
    else:
        pipe.transformer.fuse_qkv_projections()


FUSE_QKV = Knob(
    name="fuse_qkv",
    choices=(False, True),
    default=False,
    help="fuse the q/k/v projections of attention into one matmul",
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
    help="NHWC memory format for the UNet and the VAE convolutions",
    apply=_apply_channels_last,
)


__all__ = ["FUSE_QKV", "CHANNELS_LAST", "denoiser"]
