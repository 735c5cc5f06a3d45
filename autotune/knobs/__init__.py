"""The knob catalogue and the one function that applies a configuration.

A configuration is a flat dict {knob name: choice}. `apply_config` is the only code that turns one
into pipeline state; trial workers and production (`Profile.apply`) both call it. `build_configured`
(trials, `Profile.load_pipeline`) first holds the process settings of BEFORE_BUILD, then builds and
calls it.

Order matters, and lives in APPLY_ORDER alone: dtype, the VAE swap and the process-global
precision flags first; fuse QKV before anything rewrites the weights (a quantized or fp8 weight
cannot be concatenated); then quantization of the denoiser, the host allocator's mmap threshold
(held from before the build on: BEFORE_BUILD), quantization of the text encoders and fp8 storage,
after which the pipeline moves to the device (so the device never holds the weights before they
are rewritten); layout and the attention implementation; VAE slicing and tiling; caches (hooks on
the denoiser's blocks); placement and offload hooks after every change to the modules (and nothing
moved to the GPU before them); compile last, so it traces the final modules, with its settings and
inductor's process-wide ones. What ordering cannot fix is forbidden in CONFLICTS, each rule
with its reason.
"""

from __future__ import annotations

from typing import Any

from ..errors import AutotuneError, warn_at_caller
from .attention import ATTENTION, SDPA_KERNELS
from .base import Knob, SearchOnly, Target
from .cache import CACHE, CACHES
from .compile import (COMPILE, COMPILE_FREEZING, COMPILE_FULLGRAPH, COMPILE_REGIONAL, COMPILE_VAE, CUDA_GRAPH_MODES,
                      INDUCTOR_FLAGS)
from .host import MALLOC_MMAP_THRESHOLD
from .layout import CHANNELS_LAST, FUSE_QKV, SEPARATE_PROJECTIONS
from .memory import HOOKED, OFFLOAD, PER_LAYER, PLACEMENT, STREAMED, VAE_SLICING, VAE_TILING, places_on_device
from .precision import CUDNN_BENCHMARK, DTYPE, DTYPES, TF32, VAE_FP16_FIX
from .quantize import FP8_FORMATS, LAYERWISE_CASTING, QUANTIZE, QUANTIZE_TEXT_ENCODERS, TEXT_ENCODERS

APPLY_ORDER: tuple[Knob, ...] = (
    DTYPE,
    VAE_FP16_FIX,  # a component swap: before anything changes the VAE's modules
    TF32,
    CUDNN_BENCHMARK,
    FUSE_QKV,
    QUANTIZE,
    # held before the pipeline is built (BEFORE_BUILD); here after QUANTIZE, so that a space can
    # search it only where quantization frees the weights as loaded
    MALLOC_MMAP_THRESHOLD,
    QUANTIZE_TEXT_ENCODERS,
    LAYERWISE_CASTING,
    CHANNELS_LAST,
    ATTENTION,
    VAE_SLICING,
    VAE_TILING,
    CACHE,
    PLACEMENT,
    OFFLOAD,
    COMPILE,
    COMPILE_FULLGRAPH,
    COMPILE_REGIONAL,
    COMPILE_VAE,
    INDUCTOR_FLAGS,  # global inductor settings, read at the first compiled call
    COMPILE_FREEZING,  # the same
)
CATALOGUE: dict[str, Knob] = {k.name: k for k in APPLY_ORDER}
# Process settings that must already hold while the pipeline's weights are allocated:
# build_configured applies them before it builds (and apply_config again, which changes nothing
# then). On a pipeline loaded before, they hold only for what is allocated after.
BEFORE_BUILD: tuple[Knob, ...] = (MALLOC_MMAP_THRESHOLD,)

_COMPILED = [mode for mode in COMPILE.choices if mode != "none"]
_QUANTIZED = [kind for kind in QUANTIZE.choices if kind != "none"]

# Combinations that are valid one by one but not together, as (partial config, reason). A value
# may be a list: any of its elements matches. The key "family" narrows a rule to model families
# (a space that knows its target passes it; without one the rule holds for every family). The
# search never measures a config that matches one.
CONFLICTS: tuple[tuple[dict, str], ...] = (
    # attention processors replace each other: the last installed wins, silently
    ({"fuse_qkv": True, "attention": ["sliced", "sliced-max"]},
     "attention slicing replaces the fused attention processors, undoing fuse_qkv"),
    ({"fuse_qkv": True, "attention": "xformers", "family": ["sdxl", "sd15", "sd3"]},
     "xFormers installs its own attention processors, undoing fuse_qkv (on Flux it is a dispatcher backend and keeps the fusion)"),
    # what only matters in one precision
    ({"vae_fp16_fix": True, "dtype": ["float32", "bfloat16"]},
     "the fp16-fix VAE only matters in float16 (SDXL's own VAE is upcast only in float16)"),
    # kernels that exist for half precision only
    ({"dtype": "float32", "attention": ["sdpa-flash", "sdpa-cudnn", "flash-attn", "flash-attn-3", "sage"]},
     "this attention kernel takes float16/bfloat16 only: in float32 it finds no kernel and fails"),
    ({"dtype": ["float32", "float16"], "quantize": ["float8dq", "int4wo"]},
     "torchao's float8 row-wise and int4 tinygemm quantization take bfloat16 weights only"),
    # both rewrite the denoiser's weights
    ({"quantize": _QUANTIZED, "layerwise_casting": list(FP8_FORMATS)},
     "quantization and fp8 layerwise casting both rewrite the denoiser's weights: choose one"),
    # fullgraph cannot trace through hooks
    ({"compile_fullgraph": True, "offload": HOOKED},
     "fullgraph=True cannot trace through offload hooks (graph breaks are errors)"),
    ({"compile_fullgraph": True, "cache": list(CACHES)},
     "fullgraph=True cannot trace through cache hooks (data-dependent skips are graph breaks)"),
    # A kernel choice is held around the denoiser's call (attention.py), outside its graph; a
    # whole-model fullgraph compile would have to trace it instead, and the graph kept SDPA's own
    # kernel there (the CPU's flash op for sdpa-math, seen with torch's profiler on tiny sd15 and Flux)
    ({"compile_fullgraph": True, "compile_regional": False, "attention": list(SDPA_KERNELS)},
     "a whole-model fullgraph compile cannot hold an SDPA kernel choice: the compiled graph keeps SDPA's own kernel"),
    ({"compile": list(CUDA_GRAPH_MODES), "offload": HOOKED},
     "CUDA-graph compile modes replay fixed device addresses; offload moves the weights (diffusers#8879)"),
    ({"compile": list(CUDA_GRAPH_MODES), "compile_regional": True},
     "CUDA-graph compile modes on regionally compiled blocks: one block's output is the next replay's "
     "input and is overwritten by it (pytorch#152887)"),
    # The same mechanism, read in torch's cudagraph_trees and diffusers' VAE, not yet seen on a
    # GPU: each call of a CUDA-graph-compiled module starts a new generation and frees the
    # outputs of the last one, while the VAE keeps every tile's (or slice's) decoded output in a
    # list until it joins them.
    ({"compile": list(CUDA_GRAPH_MODES), "compile_vae": True, "vae_tiling": True},
     "a CUDA-graph-compiled VAE decoder runs once per tile, and each replay overwrites the tiles "
     "decoded before it, which the VAE still holds to blend them"),
    ({"compile": list(CUDA_GRAPH_MODES), "compile_vae": True, "vae_slicing": True},
     "a CUDA-graph-compiled VAE decoder runs once per image of the batch, and each replay "
     "overwrites the images decoded before it, which the VAE still holds to join them"),
    # Inferred the same way: the caches keep tensors computed in one denoiser call for the next.
    ({"compile": list(CUDA_GRAPH_MODES), "cache": list(CACHES)},
     "step caches keep tensors from one denoiser call for the next, and a CUDA-graph replay "
     "overwrites the outputs of the one before"),
    # Offload hooks on every layer are compiler-disabled (accelerate's hooks.py, diffusers'
    # group_offloading.py): each layer's call is a graph break and runs eagerly. Seen on the CPU
    # with a toy of 4 blocks of 2 linear layers (torch._dynamo.explain): 1 graph of 24 ops
    # without offload, 6 graphs of 6 ops in all with diffusers' leaf-level group offload; the
    # matmuls ran outside every graph. Compile would fuse only what lies between layers, after
    # compiling a fragment per layer (SDXL's UNet has 1,050 leaf modules with weights, counted on
    # its shipped config).
    # Not ruled out: CUDA-graph modes with SDXL's float16 VAE, whose weights are cast into new
    # memory at each call. cudagraph trees record again when a weight moves: slower, not wrong,
    # and left for measurement to judge.
    ({"compile": _COMPILED, "offload": PER_LAYER},
     "offload hooks on every layer stop the compiler at each one: every matmul and convolution would "
     "run uncompiled, and a fragment per layer would be compiled for the little left between them"),
    # The same, by another cause: diffusers' layerwise-casting hooks are not compiler-disabled, and
    # dynamo breaks the graph in their Module.to at each layer (the Parameter constructor). Seen
    # on the CPU with tiny sd15 in bfloat16 (torch._dynamo.explain): 1 graph of 402 ops without
    # it, 53 graphs of 94 ops with fp8-e4m3; compiled, it ran 1.8x slower than uncompiled with
    # the same casting (0.92 s against 0.55 s a call) after a 137 s compile (helper 72).
    ({"compile": _COMPILED, "layerwise_casting": list(FP8_FORMATS)},
     "fp8 layerwise-casting hooks break the compiled graph at every layer: the matmuls and convolutions "
     "would run uncompiled, after a fragment per layer is compiled"),
    # how to compile only matters when compiling
    ({"compile": "none", "compile_fullgraph": True}, "compile_fullgraph only matters when compiling"),
    ({"compile": "none", "compile_regional": True}, "compile_regional only matters when compiling"),
    ({"compile": "none", "compile_vae": True}, "compile_vae only matters when compiling"),
    ({"compile": "none", "inductor_flags": True}, "inductor_flags only matter when compiling"),
    ({"compile": "none", "compile_freezing": True}, "compile_freezing only matters when compiling"),
    # freezing takes the weights as constants of the compiled graph, as they are when it compiles
    ({"compile_freezing": True, "offload": HOOKED},
     "freezing takes the weights as constants where they are when it compiles; offload hooks move them at each call"),
    # Measured on this project's CPU (fullgraph: FailOnRecompileLimitHit), read in torch's dynamo
    # (parameters guarded by identity when freezing, pytorch#128355): every block compiled again.
    ({"compile_freezing": True, "compile_regional": True},
     "freezing guards each block's weights by identity: the shared compiled block is compiled again for "
     "every block, and past dynamo's recompile limit (8) the rest run uncompiled, or fail with fullgraph"),
    # where weights are quantized: offload and balanced placement keep them on the host until
    # the hooks move them, so quantize_ runs there
    ({"quantize": "int4wo", "offload": HOOKED},
     "int4 weights are packed for the tinygemm kernel when quantized, and torch packs them only on a "
     "GPU (no CPU kernel for _convert_weight_to_int4pack); offload keeps them on the host"),
    ({"quantize": "int4wo", "placement": "balanced"},
     "int4 weights are packed only on a GPU (no CPU kernel for _convert_weight_to_int4pack); "
     "balanced placement quantizes on the host before it places the components"),
    # placement
    ({"placement": "balanced", "offload": HOOKED},
     "balanced placement puts whole components on GPUs; offload hooks would move them again (diffusers raises)"),
    ({"vae_tiling": True, "offload": STREAMED},
     "diffusers: group offload with CUDA streams on a VAE may misbehave when the first pass is tiled"),
    # Inferred from diffusers 0.42.1's code for a failure of the GPU pair test on an H100 (an SDXL
    # VAE decode with "mixed dtype"): the pinned host copies are keyed by parameter and made once,
    # and `.to(dtype)` converts the parameters in place, so the copies keep the old dtype.
    # (-lowmem makes the same copies at set-up and only pins them as it moves: the same mechanism)
    ({"dtype": "float16", "vae_fp16_fix": False, "offload": STREAMED,
      "family": ["sdxl"]},
     "SDXL upcasts its float16 VAE with .to(float32) for each decode; group offload with streams onloads "
     "the float16 host copies it made when it was set up, so the decode mixes dtypes"),
)

Config = dict[str, Any]


def matches(rule: dict, config: Config, family: str | None = None) -> bool:
    """Whether a config matches a partial config such as {"offload": "model", "compile": [...]}.
    A "family" key in the rule matches every family when `family` is not given."""
    for name, wanted in rule.items():
        if name == "family":
            if family is not None and family not in (wanted if isinstance(wanted, list) else [wanted]):
                return False
            continue
        value = config.get(name, CATALOGUE[name].default if name in CATALOGUE else None)
        if isinstance(wanted, list):
            if value not in wanted:
                return False
        elif value != wanted:
            return False
    return True


def conflict(config: Config, family: str | None = None) -> str | None:
    """Why a full config is a known-invalid combination (for `family`, or any), or None."""
    for rule, reason in CONFLICTS:
        if matches(rule, config, family):
            return reason
    return None


def baseline() -> Config:
    """The default pipeline: float32 and nothing enabled."""
    return {k.name: k.default for k in APPLY_ORDER}


def changed(config: Config) -> Config:
    """The knobs a config sets away from the default pipeline, and their values."""
    base = baseline()
    return {k: v for k, v in config.items() if base.get(k) != v}


def complete(config: Config) -> Config:
    """Every catalogue knob, in apply order, with defaults for those the config leaves out."""
    unknown = sorted(map(repr, set(config) - set(CATALOGUE)))  # repr: a key may be a YAML number
    if unknown:
        raise ValueError(f"unknown knob(s): {', '.join(unknown)}")
    full = baseline()
    full.update(config)
    for name, value in full.items():
        CATALOGUE[name].check(value)
    return full


def unrunnable(config: Config, target: Target) -> list[str]:
    """Why each choice of `config` cannot run on `target` ("knob=value: reason"), as the search
    drops them (SearchSpace.restrict), but for those that run here and are only left out of the
    search (SearchOnly: they change nothing, or another choice outruns them):
    empty for a config a study measured on this machine. A profile carried to another device or
    machine, or a package uninstalled since, meets them."""
    full = complete(config)
    return [f"{name}={value}: {reason}" for name, value in full.items()
            if value != CATALOGUE[name].default and (reason := CATALOGUE[name].unavailable(value, target))
            and not isinstance(reason, SearchOnly)]


# The knobs that rewrite weights: fused into new projections (the separate ones dropped), or put
# into a smaller storage format. A config that sets one is built on the host and reaches the device
# only rewritten: loaded to the GPU first, the weights as loaded would set the trial's peak (the
# caching allocator keeps their blocks, and the driver counts them), and neither quantization nor
# dropping the unfused projections could bring a config under a budget.
WEIGHT_REWRITES: tuple[Knob, ...] = (FUSE_QKV, QUANTIZE, QUANTIZE_TEXT_ENCODERS, LAYERWISE_CASTING)
_LAST_REWRITE = max(WEIGHT_REWRITES, key=APPLY_ORDER.index)


def rewrites_weights(config: Config) -> bool:
    """Whether a config fuses weights or stores some in a smaller format than its dtype."""
    return any(config.get(k.name, k.default) != k.default for k in WEIGHT_REWRITES)


def build_device(config: Config, target: Target) -> str:
    """Where to build the pipeline before apply_config: on the target device only when nothing
    has to happen to the weights on the host first (offload and placement hooks move them
    themselves; fusing, quantization and fp8 storage rewrite them on the way)."""
    if places_on_device(config) and not rewrites_weights(config):
        return target.device
    return "cpu"


# Set on a pipeline as its configuration begins, and refused by the next one: knobs rewrite the
# pipeline (fused QKV drops the q, k and v layers), and a second configuration, or one after a
# failed first, would meet a pipeline unlike any a trial measured.
APPLIED = "_autotune_configured"


def apply_config(pipe, config: Config, target: Target):
    """Put a freshly loaded pipeline into the state that `config` describes, on `target.device`."""
    config = complete(config)
    if getattr(pipe, APPLIED, None):
        raise AutotuneError(f"this pipeline is configured already ({getattr(pipe, APPLIED)}); apply a "
                            "configuration to a freshly loaded pipeline")
    described = ", ".join(f"{k}={v}" for k, v in changed(config).items()) or "the baseline"
    setattr(pipe, APPLIED, f"{described}, stopped part-way")  # until its last knob is applied
    if rewrites_weights(config) and pipe.device.type != "cpu":
        warn_at_caller(f"the pipeline is on {pipe.device} before its weights are fused, quantized or cast to "
                       "fp8: its weights as loaded were there first, so its peak memory will be higher than "
                       "the profile measured (load it on the CPU and let the configuration move it)")
    for knob in APPLY_ORDER:
        knob.apply(pipe, config[knob.name], target, config)
        # The whole pipeline goes to the device once its weights are in their final format
        # (quantize_ moves the modules it quantizes there one by one itself).
        if knob is _LAST_REWRITE and places_on_device(config):
            pipe.to(target.device)
    setattr(pipe, APPLIED, described)
    return pipe


def settings_found(pipe) -> list[str]:
    """What a pipeline holds that a freshly loaded one does not, and a configuration would not undo:
    the settings its user made before handing it to Profile.apply (a configuration sets each knob
    from a fresh pipeline's state, and leaves what it does not change as found). Read from the
    state itself: diffusers' and accelerate's hooks, attention processors, fused projections, the
    VAE's slicing and tiling, compilation, quantization (at load or after), channels_last."""
    import torch

    found = []
    vae = getattr(pipe, "vae", None)
    if getattr(vae, "use_slicing", False):
        found.append("VAE slicing")
    if getattr(vae, "use_tiling", False):
        found.append("VAE tiling")
    for name in ("unet", "transformer", "vae", *TEXT_ENCODERS):
        model = getattr(pipe, name, None)
        if model is None or not hasattr(model, "modules"):
            continue
        named = list(model.named_modules())
        modules = [m for _, m in named]
        if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
            found.append(f"{name} compiled")
        else:
            if any(getattr(m, "_compiled_call_impl", None) is not None for m in modules):  # regional, the VAE's decoder
                found.append(f"{name} blocks compiled")
            # a method replaced by its compiled form, as the guides do (`pipe.vae.decode =
            # torch.compile(pipe.vae.decode)`): torch.compile's wrapper keeps the function it wraps.
            # Not torch.compiler.disable's, which wraps alike (autotune's SDPA kernel hold: below).
            methods = [".".join(filter(None, (name, path, attr))) for path, m in named
                       for attr, value in vars(m).items() if not attr.startswith("_")
                       and hasattr(value, "_torchdynamo_orig_callable") and not getattr(value, "_torchdynamo_disable", False)]
            if methods:
                found.append(f"{', '.join(methods)} compiled")
        hooks = sorted({hook for m in modules for hook in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})})
        if hooks:
            found.append(f"{name} hooks ({', '.join(hooks)})")
        if any(hasattr(m, "_hf_hook") for m in modules):
            found.append(f"{name} offloaded (accelerate hooks)")
        if any(getattr(m, "fused_projections", False) for m in modules):
            found.append(f"{name} fused projections")
        # quantized as it was loaded (from_pretrained's quantization_config: bitsandbytes, GGUF,
        # quanto, torchao...): diffusers' and transformers' models keep the quantizer; by torchao's
        # quantize_ after loading: the weights' types say it
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
            found.append(f"{name} quantized when loaded ({getattr(method, 'value', method) or type(quantizer).__name__})")
        elif any(type(param).__module__.startswith("torchao") for param in model.parameters()):
            found.append(f"{name} weights quantized (torchao)")
        elif any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in modules):
            # torch's own quantize_dynamic: its layers hold packed weights, no parameters to cast
            found.append(f"{name} weights quantized (torch.ao)")
        # any of them: part of a model converted (its decoder, the UNet's up blocks) was taken, and
        # left that part in channels_last under a profile measured without it (helper-13)
        convs = [m.weight for m in modules if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-1] > 1]
        if any(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs):
            found.append(f"{name} in channels_last")
        if any(getattr(m, "_chunk_size", None) is not None for m in modules):
            found.append(f"{name} forward chunking")
        # slicing, xFormers, and the pre-SDPA processor set_default_attn_processor installs
        processors = sorted({type(m.processor).__name__ for m in modules if hasattr(m, "processor")
                             and (any(word in type(m.processor).__name__ for word in ("Sliced", "XFormers"))
                                  or type(m.processor).__name__ == "AttnProcessor")})
        if processors:
            found.append(f"{name} attention processors ({', '.join(processors)})")
        held = getattr(getattr(model, "forward", None), "sdpa_kernel", None)  # a pipeline made of a configured one's parts
        if held is not None:
            found.append(f"{name} held to SDPA's {held.name} kernel (by an autotune configuration)")
    return found


def lora_on_fused_projections(pipe) -> list[str]:
    """The models whose q/k/v projections (those fuse_qkv fuses: the denoiser's and the VAE's)
    carry LoRA layers not fused into their weights (peft's lora_A)."""
    return [name for name in ("unet", "transformer", "vae")
            if hasattr(model := getattr(pipe, name, None), "named_modules")
            and any(path.rsplit(".", 1)[-1] in SEPARATE_PROJECTIONS and hasattr(m, "lora_A")
                    for path, m in model.named_modules())]


def additions_found(pipe) -> list[str]:
    """What a user added to a pipeline to keep under a profile's configuration (LoRA adapters, an
    IP-Adapter, FreeU), which the trials did not measure: a line each."""
    found = []
    for name in ("unet", "transformer", *TEXT_ENCODERS):
        model = getattr(pipe, name, None)
        if model is None or not hasattr(model, "modules"):
            continue
        adapters = getattr(model, "peft_config", None)  # load_lora_weights (peft), not fused into the weights
        if adapters:
            found.append(f"{name} LoRA adapters ({', '.join(map(str, adapters))})")
        if any("IPAdapter" in type(getattr(m, "processor", None)).__name__ for m in model.modules()):
            found.append(f"{name} IP-Adapter attention processors")
        if any(getattr(block, "b1", None) is not None for block in getattr(model, "up_blocks", [])):  # enable_freeu
            found.append(f"{name} FreeU")
    return found


def build_configured(spec, config: Config, target: Target):
    """Build `spec`'s pipeline and put it into the state `config` describes: the one sequence
    that trial workers and production (`Profile.load_pipeline`) both run."""
    from ..models import build_pipeline

    config = complete(config)
    for knob in BEFORE_BUILD:
        knob.apply(None, config[knob.name], target, config)
    pipe = build_pipeline(spec, dtype=DTYPES[config["dtype"]], device=build_device(config, target))
    return apply_config(pipe, config, target)


__all__ = [
    "APPLIED",
    "APPLY_ORDER",
    "BEFORE_BUILD",
    "CATALOGUE",
    "CONFLICTS",
    "Config",
    "Knob",
    "Target",
    "apply_config",
    "baseline",
    "build_configured",
    "build_device",
    "complete",
    "conflict",
    "matches",
    "rewrites_weights",
    "settings_found",
    "unrunnable",
]
