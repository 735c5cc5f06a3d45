"""Step caches: reuse work from earlier denoising steps (lossy; the quality guard judges them).

`model.enable_cache(config)` exists only on diffusers' CacheMixin models: in diffusers 0.42.1 that is
FluxTransformer2DModel among the four families (UNet2DConditionModel and SD3Transformer2DModel have
no enable_cache). Availability asks the installed class, so a newer diffusers that adds it opens
the knob without a code change. DeepCache, the UNet cache, is a separate package and not here.
"""

from __future__ import annotations

from .base import Knob, denoiser, denoiser_class

CACHES = ("first-block", "taylorseer", "magcache")


def _cache_config(value, target):
    import diffusers.hooks as hooks

    if value == "first-block":
        # skip the rest of the transformer while the first block's residual changes less than 5%
        return hooks.FirstBlockCacheConfig(threshold=0.05)
    if value == "taylorseer":
        # diffusers' defaults: a full step every 5, Taylor (order 1) predictions between
        return hooks.TaylorSeerCacheConfig()
    if value == "magcache":
        # MagCache skips steps by a magnitude-ratio curve measured per checkpoint: diffusers ships
        # Flux's (FLUX_MAG_RATIOS), resampled to the workload's step count, which MagCache also
        # uses to reset its state at the end of each call.
        if not target.steps:
            raise ValueError("cache=magcache needs the workload's step count (Target.steps)")
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        return hooks.MagCacheConfig(mag_ratios=FLUX_MAG_RATIOS, num_inference_steps=int(target.steps))
    raise ValueError(value)


def _apply_cache(pipe, value, target, config):
    if value != "none":
        denoiser(pipe).enable_cache(_cache_config(value, target))


def _cache_unavailable(value, target):
    if value == "none":
        return None
    cls = denoiser_class(target.family)
    if not hasattr(cls, "enable_cache"):
        return f"{cls.__name__} has no enable_cache in this diffusers (caches run on CacheMixin models such as Flux)"
    if value == "magcache" and target.family != "flux":
        return "MagCache needs magnitude ratios measured for the checkpoint; diffusers ships Flux's only"
    return None


CACHE = Knob(
    name="cache",
    choices=("none", *CACHES),
    default="none",
    help="reuse work across denoising steps: FirstBlockCache, TaylorSeer, MagCache (lossy; Flux)",
    apply=_apply_cache,
    unavailable=_cache_unavailable,
)
