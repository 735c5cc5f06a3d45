"""Settings that trade speed for device memory: VAE slicing and tiling, CPU offload of every kind,
and placement across several GPUs."""

from __future__ import annotations

import contextlib

from .base import Knob, NoEffect


def _apply_vae_slicing(pipe, value, target, config):
    # Decodes a batch one image at a time: acts only when batch_size > 1.
    if value:
        pipe.vae.enable_slicing()


def _vae_slicing_unavailable(value, target):
    # Not an error at batch size 1, but the same pipeline as without it: a trial spent on it
    # measures nothing new, and its difference from the baseline is noise.
    if value and target.batch_size == 1:
        return NoEffect("VAE slicing decodes a batch one image at a time: at batch size 1 it changes nothing")
    return None


VAE_SLICING = Knob(
    name="vae_slicing",
    choices=(False, True),
    default=False,
    help="decode the batch one image at a time (acts only for batch_size > 1)",
    apply=_apply_vae_slicing,
    unavailable=_vae_slicing_unavailable,
    memory_rank={False: 1, True: 0},
)


def _apply_vae_tiling(pipe, value, target, config):
    if not value:
        return
    vae = pipe.vae
    vae.enable_tiling()
    workload = target.workload
    # diffusers tiles only images larger than the VAE's sample size (SDXL, SD3 and Flux: 1024 px),
    # so at the models' own resolutions tiling would change nothing. There, tiles of half the
    # image (a multiple of the VAE's scale) make it act: less decoder memory, and seams the quality
    # guard judges.
    default = vae.tile_sample_min_size
    default = default[0] if isinstance(default, (list, tuple)) else default
    if workload is None or max(workload.height, workload.width) > default:
        return
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    tile = max(8 * scale, max(workload.height, workload.width) // 2 // scale * scale)
    vae.tile_sample_min_size = tile
    vae.tile_latent_min_size = tile // scale


VAE_TILING = Knob(
    name="vae_tiling",
    choices=(False, True),
    default=False,
    help="decode in overlapping tiles (of half the image where the VAE would not tile it by default)",
    apply=_apply_vae_tiling,
    memory_rank={False: 1, True: 0},
)


# Offload moves weights between host and device memory with hooks, so the pipeline is not moved
# to the device first (knobs.apply_config asks `places_on_device`): "never .to('cuda') before
# sequential offload". All offload kinds are choices of one knob, so they exclude each other by
# construction (diffusers raises ValueError for group offload on top of model/sequential offload).
_OFFLOADS = {"model": "enable_model_cpu_offload", "sequential": "enable_sequential_cpu_offload"}
# Group offload (`pipe.enable_group_offload`, every component): block_level moves N top-level
# blocks at a time, leaf_level one leaf module at a time. "-stream" prefetches the next group on a
# CUDA stream while this one computes (record_stream too: faster, slightly more memory); it keeps
# a pinned (page-locked) host copy of every weight from set-up on. "-lowmem" (low_cpu_mem_usage)
# pins each group's copy only while it moves: slower per step, and no page-locked memory the size
# of the model, which a host short of memory (or a container's locked-memory limit) cannot give.
_GROUPS = {
    "group-block-1": dict(offload_type="block_level", num_blocks_per_group=1),
    "group-block-2": dict(offload_type="block_level", num_blocks_per_group=2),
    "group-block-1-stream": dict(offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                                 record_stream=True),
    "group-leaf": dict(offload_type="leaf_level"),
    "group-leaf-stream": dict(offload_type="leaf_level", use_stream=True, record_stream=True),
    "group-leaf-stream-lowmem": dict(offload_type="leaf_level", use_stream=True, record_stream=True,
                                     low_cpu_mem_usage=True),
}


# The offload kinds the rules name, read from the tables above: every kind hooks the weights; the
# stream kinds pin host copies at set-up; sequential and leaf-level hook every layer.
HOOKED = [*_OFFLOADS, *_GROUPS]
STREAMED = [kind for kind, kwargs in _GROUPS.items() if kwargs.get("use_stream")]
PER_LAYER = ["sequential", *(kind for kind, kwargs in _GROUPS.items() if kwargs["offload_type"] == "leaf_level")]


def places_on_device(config) -> bool:
    """Whether apply_config moves the whole pipeline to the target device itself (no offload
    hooks and no multi-GPU placement do it instead)."""
    return (config.get(OFFLOAD.name, OFFLOAD.default) == OFFLOAD.default
            and config.get(PLACEMENT.name, PLACEMENT.default) == PLACEMENT.default)


def _apply_offload(pipe, value, target, config):
    import torch

    if value != "none" and pipe.device.type != "cpu":
        # accelerate's and diffusers' hooks expect the weights on the host; a pipeline moved to
        # the GPU first keeps a full copy there (sequential offload then fails or wastes memory)
        raise ValueError(f"offload={value}: the pipeline is on {pipe.device} already; load it on the CPU "
                         "and let the offload hooks place the weights")
    if value in _OFFLOADS:
        getattr(pipe, _OFFLOADS[value])(device=target.device)
    elif value in _GROUPS:
        onload = torch.device(target.device)
        # diffusers makes the prefetch stream on the current CUDA device: on cuda:1 it would be
        # cuda:0's while the weights go to cuda:1
        with torch.cuda.device(onload) if onload.type == "cuda" else contextlib.nullcontext():
            pipe.enable_group_offload(onload_device=onload, offload_device=torch.device("cpu"), **_GROUPS[value])


def _offload_unavailable(value, target):
    if value in _OFFLOADS and not target.is_cuda:
        return "CPU offload needs an accelerator: on the CPU the weights already live in host memory"
    if value in _GROUPS and not target.is_cuda:
        return "group offload needs a CUDA GPU: on the CPU the weights already live in host memory"
    return None


OFFLOAD = Knob(
    name="offload",
    choices=("none", *_OFFLOADS, *_GROUPS),
    default="none",
    help="keep weights in host memory and move them to the GPU per model, per layer or per group of blocks",
    apply=_apply_offload,
    unavailable=_offload_unavailable,
    # Known order: the whole pipeline > one model at a time > one block (group-block-1, no
    # prefetch) > one layer. Stream kinds prefetch a second group, and leaf groups against
    # sequential are not known: left out of the ranking.
    memory_rank={"none": 3, "model": 2, "group-block-1": 1, "sequential": 0},
)


def _apply_placement(pipe, value, target, config):
    if value != "balanced":
        return
    # What DiffusionPipeline.from_pretrained(device_map="balanced") does, on a built pipeline:
    # whole components, largest first, dealt to the GPUs by diffusers' own assignment, each then
    # dispatched by accelerate as from_pretrained dispatches it.
    import torch
    from diffusers.pipelines.pipeline_loading_utils import _assign_components_to_devices

    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    sizes = {n: stored_bytes(m) for n, m in modules.items()}
    sizes = dict(sorted(sizes.items(), key=lambda item: item[1], reverse=True))
    free = {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}
    free = dict(sorted(free.items(), key=lambda item: item[1], reverse=True))
    assignment = _assign_components_to_devices(sizes, free, "balanced")
    device_map = {name: device for device, names in assignment.items() for name in names}
    for name, device in device_map.items():
        dispatch_whole(modules[name], device)
    pipe.hf_device_map = device_map


def stored_bytes(module) -> int:
    """The bytes a module's parameters take where they are stored. A torchao-quantized weight
    reports its original dtype's element size (int8 counted as bfloat16: twice its size), so a
    tensor subclass is counted by the tensors it holds (torch's __tensor_flatten__ protocol)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def size(tensor) -> int:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            return sum(size(getattr(tensor, name)) for name in names)
        return tensor.numel() * tensor.element_size()

    return sum(size(p) for p in module.parameters())


def dispatch_whole(module, device) -> None:
    """Put a whole component on `device` as diffusers' loader does for a device_map: with
    force_hooks, accelerate attaches the hook that moves each call's inputs to the component's
    device (without it, a one-device map attaches none, and a component fed from another GPU
    fails), and skip_keys leaves the tensors the model names (caches) where they are."""
    from accelerate import dispatch_model

    dispatch_model(module, device_map={"": device}, force_hooks=True, skip_keys=getattr(module, "_skip_keys", None))


def _placement_unavailable(value, target):
    if value == "single":
        return None
    from ..fingerprint import cuda_device_count

    count = cuda_device_count()  # read at each call: --gpus restricts a worker's space to its GPU
    if not target.is_cuda or count < 2:
        return f"balanced placement needs more than one CUDA GPU visible ({count} here)"
    return None


PLACEMENT = Knob(
    name="placement",
    choices=("single", "balanced"),
    default="single",
    help='spread whole components over the visible GPUs (device_map="balanced"); needs 2+ GPUs',
    apply=_apply_placement,
    unavailable=_placement_unavailable,
)
