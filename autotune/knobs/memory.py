"""Settings that trade speed for device memory: VAE slicing and tiling, CPU offload."""

from __future__ import annotations

from .base import Knob


def _apply_vae_slicing(pipe, value, target):
    # Decodes a batch one image at a time: acts only when batch_size > 1.
    if value:
        pipe.vae.enable_slicing()


VAE_SLICING = Knob(
    name="vae_slicing",
    choices=(False, True),
    default=False,
    help="decode the batch one image at a time (acts only for batch_size > 1)",
    apply=_apply_vae_slicing,
    memory_rank={False: 1, True: 0},
)


def _apply_vae_tiling(pipe, value, target):
    # Decodes overlapping tiles: acts only above the VAE's sample_size (1024 for SDXL).
    if value:
        pipe.vae.enable_tiling()


VAE_TILING = Knob(
    name="vae_tiling",
    choices=(False, True),
    default=False,
    help="decode in overlapping tiles (acts only above the VAE's sample size)",
    apply=_apply_vae_tiling,
    memory_rank={False: 1, True: 0},
)

# Offload moves weights between host and device memory with accelerate hooks, so the pipeline is
# not moved to the device first (knobs.apply_config asks `places_on_device`).
_OFFLOADS = {"model": "enable_model_cpu_offload", "sequential": "enable_sequential_cpu_offload"}


def places_on_device(value) -> bool:
    return value not in _OFFLOADS


def _apply_offload(pipe, value, target):
    if value in _OFFLOADS:
        getattr(pipe, _OFFLOADS[value])(device=target.device)


def _offload_unavailable(value, target):
    if value in _OFFLOADS and not target.is_cuda:
        return "CPU offload needs an accelerator: on the CPU the weights already live in host memory"
    return None


OFFLOAD = Knob(
    name="offload",
    choices=("none", *_OFFLOADS),
    default="none",
    help="keep weights in host memory and move them to the device per model or per layer",
    apply=_apply_offload,
    unavailable=_offload_unavailable,
    memory_rank={"none": 2, "model": 1, "sequential": 0},  # whole pipeline, one model, one layer
)
