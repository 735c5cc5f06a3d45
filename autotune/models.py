"""The model registry: what a model name means and how to build its pipeline.

A name resolves to a `ModelSpec`: an alias ("sdxl"), a tiny offline pipeline ("tiny-sdxl"), a local
directory written by `save_pretrained`, or a hub id already in the local Hugging Face cache. Nothing
here downloads: real weights come from the cache or a directory, and two offline kinds make every
code path runnable without them:

- "tiny": small seeded-random pipelines with the real structure (see `autotune.tiny`);
- "random": the full-size architecture of an alias, built from the published component configs
  shipped in `autotune/model_configs/<alias>/`, with cheap random weights. Compute and memory depend
  on shapes, not values, so it measures like the real model (its images are noise).
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .errors import ModelError, first_line, os_reason
from .workload import Workload

MODEL_CONFIGS = Path(__file__).parent / "model_configs"
KINDS = ("pretrained", "tiny", "random")


@dataclass(frozen=True)
class _Family:
    pipeline_class: str  # diffusers' pipeline class
    denoiser: str  # "unet" or "transformer": the denoiser's attribute on the pipeline
    denoiser_class: str  # diffusers' class of that denoiser
    workload: Workload  # the default: 1024x1024, 30 steps for SDXL
    # Height and width must be multiples of this, as the pipeline's check_inputs asks: the VAE's
    # 8x downsampling for UNet models; times the transformer's 2x2 patches for SD3 (an error) and
    # Flux (which only warns and resizes, so trials would measure another size than recorded).
    pixel_multiple: int


FAMILIES = {
    "sdxl": _Family("StableDiffusionXLPipeline", "unet", "UNet2DConditionModel", Workload(1024, 1024, 30), 8),
    "sd15": _Family("StableDiffusionPipeline", "unet", "UNet2DConditionModel", Workload(512, 512, 50), 8),
    "sd3": _Family("StableDiffusion3Pipeline", "transformer", "SD3Transformer2DModel", Workload(1024, 1024, 28), 16),
    "flux": _Family("FluxPipeline", "transformer", "FluxTransformer2DModel", Workload(1024, 1024, 28), 16),
}
_FAMILY_OF_CLASS = {family.pipeline_class: name for name, family in FAMILIES.items()}


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what the user asked for, normalized: alias, tiny-*, hub id or absolute directory
    family: str  # "sdxl" | "sd15" | "sd3" | "flux"
    kind: str  # "pretrained" | "tiny" | "random"
    source: str | None  # hub id or absolute local directory; None for tiny
    pipeline_class: str  # e.g. "StableDiffusionXLPipeline"
    denoiser: str  # "unet" or "transformer": the attribute on the pipeline
    default_workload: Workload  # height, width, steps (and guidance where the model wants one)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ModelError(f"unknown model family '{self.family}': use one of {', '.join(FAMILIES)}")
        if self.kind not in KINDS:
            raise ModelError(f"unknown model kind '{self.kind}': use one of {', '.join(KINDS)}")

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "family": self.family,
            "kind": self.kind,
            "source": self.source,
            "pipeline_class": self.pipeline_class,
            "denoiser": self.denoiser,
            "default_workload": self.default_workload.to_dict(),
        }

    @classmethod
    def from_dict(cls, d) -> "ModelSpec":
        problem = spec_problem(d)
        if problem:
            raise ModelError(f"malformed model spec: {problem}")
        return cls(
            name=d["name"],
            family=d["family"],
            kind=d["kind"],
            source=d.get("source"),
            pipeline_class=d["pipeline_class"],
            denoiser=d["denoiser"],
            default_workload=Workload.from_dict(d["default_workload"]),
        )


SPEC_KEYS = ("name", "family", "kind", "pipeline_class", "denoiser", "default_workload")


def spec_problem(d) -> str | None:
    """What keeps `d` (ModelSpec.to_dict's mapping, read from a file) from being a model spec, in
    a user's words, or None: checked when the file is read, not as a TypeError when a trial builds it."""
    if not isinstance(d, dict):
        return f"expected a mapping of {', '.join(SPEC_KEYS)}, not {d!r:.40}"
    missing = [k for k in SPEC_KEYS if k not in d]
    if missing:
        return f"it lacks {', '.join(missing)}"
    for key in SPEC_KEYS[:-1]:
        if not isinstance(d[key], str):
            return f"{key} must be text, not {d[key]!r:.40}"
    if d["family"] not in FAMILIES:
        return f"unknown model family '{d['family']}': use one of {', '.join(FAMILIES)}"
    if d["kind"] not in KINDS:
        return f"unknown model kind '{d['kind']}': use one of {', '.join(KINDS)}"
    family = FAMILIES[d["family"]]
    if d["kind"] == "tiny" and d["name"] != f"tiny-{d['family']}":  # built from the family alone: the name is its only word
        return f"a tiny model of family {d['family']} is named tiny-{d['family']}, not {d['name']!r:.40}"
    if (d["pipeline_class"], d["denoiser"]) != (family.pipeline_class, family.denoiser):
        return (f"family {d['family']} is a {family.pipeline_class} with a {family.denoiser}, not a "
                f"{d['pipeline_class']} with a {d['denoiser']}")
    source = d.get("source")
    if source is not None and not isinstance(source, str):
        return f"source must be text (a hub id or a model folder), not {source!r:.40}"
    if d["kind"] == "pretrained" and not source:
        return "a pretrained model needs a source (a hub id or a model folder)"
    try:
        Workload.from_dict(d["default_workload"])
    except ValueError as exc:
        return f"default_workload {exc}"
    return None


def _spec(
    name: str, family: str, kind: str, source: str | None, workload: Workload | None = None
) -> ModelSpec:
    f = FAMILIES[family]
    return ModelSpec(name, family, kind, source, f.pipeline_class, f.denoiser, workload or f.workload)


def _tiny(family: str) -> ModelSpec:
    from .tiny import TINY_RESOLUTION, TINY_STEPS

    workload = Workload(TINY_RESOLUTION, TINY_RESOLUTION, TINY_STEPS)
    return _spec(f"tiny-{family}", family, "tiny", None, workload)


ALIASES: dict[str, ModelSpec] = {
    "sdxl": _spec("sdxl", "sdxl", "pretrained", "stabilityai/stable-diffusion-xl-base-1.0"),
    "sd15": _spec("sd15", "sd15", "pretrained", "stable-diffusion-v1-5/stable-diffusion-v1-5"),
    "sd3": _spec("sd3", "sd3", "pretrained", "stabilityai/stable-diffusion-3-medium-diffusers"),
    "flux-dev": _spec("flux-dev", "flux", "pretrained", "black-forest-labs/FLUX.1-dev"),
    "flux-schnell": _spec(
        "flux-schnell", "flux", "pretrained", "black-forest-labs/FLUX.1-schnell",
        Workload(1024, 1024, 4, guidance_scale=0.0),  # timestep-distilled: 4 steps, no guidance
    ),
    **{f"tiny-{family}": _tiny(family) for family in FAMILIES},
}

# "org/name", as the hub spells repository ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def model_names() -> list[str]:
    """The aliases, for help text and error messages."""
    return list(ALIASES)


def resolve_model(name: str, random_weights: bool = False) -> ModelSpec:
    """What `name` means. Reads only local files; raises ModelError with the fix when it cannot tell."""
    key = name.strip()
    alias = ALIASES.get(key.lower()) or next((s for s in ALIASES.values() if s.source == key), None)
    if alias is not None:
        return _random(alias) if random_weights else alias
    if random_weights:
        choices = ", ".join(_random_aliases())
        raise ModelError(f"--random-weights needs a built-in architecture: use one of {choices}")

    # os.path's expanduser leaves ~nouser as it is (no such folder, said below); pathlib's raises
    path = Path(os.path.expanduser(key))
    try:
        if path.is_dir():
            return _from_directory(path.resolve())
        is_there = path.exists()
    except OSError as exc:  # a folder on the way that this user may not search (mode 000)
        raise ModelError(f"cannot read '{key}' ({os_reason(exc)})") from None
    if is_there:
        raise ModelError(
            f"'{key}' is a file: single-file checkpoints are not supported; "
            "give a pipeline directory (pipe.save_pretrained(dir)) or a hub id"
        )
    if _is_path(key):
        raise ModelError(f"no such directory '{key}': give a pipeline directory written by save_pretrained")
    if _HUB_ID.fullmatch(key):
        return _from_hub_cache(key)
    raise ModelError(
        f"unknown model '{name}': use one of {', '.join(model_names())}, "
        "a local pipeline directory or a hub id"
    )


def _random(alias: ModelSpec) -> ModelSpec:
    if alias.kind == "tiny":
        return alias  # already random weights
    if not (MODEL_CONFIGS / alias.name).is_dir():
        raise _no_configs(alias.name)
    return replace(alias, kind="random")


def _no_configs(name: str) -> ModelError:
    choices = ", ".join(_random_aliases())
    return ModelError(f"no shipped architecture configs for '{name}': --random-weights works for {choices}")


def _family_from_index(index_file: Path, where: str) -> str:
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {index_file}: {e}") from e
    class_name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(class_name, str):  # valid JSON of another shape: a list, a list for the name
        raise ModelError(f"cannot read {index_file}: not a diffusers model index (a mapping whose "
                         '"_class_name" names the pipeline class)')
    family = _FAMILY_OF_CLASS.get(class_name)
    if family is None:
        raise ModelError(
            f"{where} holds a {class_name}, which autotune does not support: "
            f"supported pipelines are {', '.join(_FAMILY_OF_CLASS)}"
        )
    return family


def _from_directory(path: Path) -> ModelSpec:
    index = path / "model_index.json"
    if not index.is_file():
        raise ModelError(
            f"'{path}' has no model_index.json: not a diffusers pipeline directory "
            "(write one with pipe.save_pretrained(dir))"
        )
    family = _family_from_index(index, f"'{path}'")
    return _spec(str(path), family, "pretrained", str(path))


def _not_cached(hub_id: str) -> ModelError:
    alias = next((name for name, spec in ALIASES.items() if spec.source == hub_id), None)
    without_weights = (
        f"measure its architecture without weights with --model {alias} --random-weights"
        if alias
        else f"measure a built-in architecture ({', '.join(_random_aliases())}) with --random-weights"
    )
    # `hf` is huggingface_hub's CLI (it replaced `huggingface-cli`).
    return ModelError(
        f"'{hub_id}' is not in the local Hugging Face cache: download it with `hf download {hub_id}`, "
        f"or {without_weights}"
    )


def _random_aliases() -> list[str]:
    return [name for name in ALIASES if (MODEL_CONFIGS / name).is_dir()]


def check_weights_here(spec: ModelSpec) -> None:
    """ModelError, with the way out, when a pretrained model's weights are not in the local cache:
    an alias resolves without looking (--list-knobs needs only its family), a study must not
    start and fail in its first call."""
    if spec.kind == "pretrained" and not Path(spec.source).is_dir():
        _from_hub_cache(spec.source)


def _is_path(source: str) -> bool:
    """Whether a source names a folder rather than a hub id ("org/name", which holds a / too)."""
    return source.startswith(("/", ".", "~")) or (os.sep in source and not _HUB_ID.fullmatch(source))


def _cached_index(source: str) -> str:
    """The cached model_index.json of a source that is no folder here. A source written as a
    path is a folder that is gone: said so, not as the hub's complaint about a repo id."""
    if _is_path(source):
        there = " (a file is there)" if Path(os.path.expanduser(source)).exists() else ""  # ~nouser: as it is
        raise ModelError(f"no such model folder {source}{there}")
    from huggingface_hub import try_to_load_from_cache

    try:
        index = try_to_load_from_cache(source, "model_index.json")
    except ValueError:  # HFValidationError: not a repo id the hub allows
        raise ModelError(f"'{source}' is neither a model folder nor a hub id (org/name)") from None
    if not isinstance(index, str):  # None (never fetched) or a marker that it does not exist
        raise _not_cached(source)
    return index


def _from_hub_cache(hub_id: str) -> ModelSpec:
    index = _cached_index(hub_id)
    family = _family_from_index(Path(index), f"'{hub_id}'")
    return _spec(hub_id, family, "pretrained", hub_id)


@functools.cache
def _tiny_denoiser_config(family: str) -> dict:
    """A tiny model's denoiser config: tiny models are built, not stored, so it is read from one
    built pipeline, once per process (each `Profile.apply` asks)."""
    from .tiny import build

    return dict(getattr(build(family), FAMILIES[family].denoiser).config)


def _pipeline_json(spec: ModelSpec, name: str) -> dict | None:
    """A JSON file of `spec`'s pipeline folder ("model_index.json", "unet/config.json"), read
    without its weights where this machine has it: a random-weights model's shipped one, a
    pretrained one's in its folder or the local cache. None where it is not here, or no mapping."""
    try:
        if spec.kind == "random":
            path = MODEL_CONFIGS / spec.name / name
        elif Path(spec.source).is_dir():
            path = Path(spec.source) / name
        else:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(spec.source, name)
            if not isinstance(found, str):
                return None
            path = Path(found)
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def denoiser_config(spec: ModelSpec) -> dict | None:
    """The architecture of `spec`'s denoiser (its config): a tiny one's as built, else as
    _pipeline_json finds it. None where it is not here (a profile carried to a machine without
    the model): nothing to compare with."""
    if spec.kind == "tiny":
        return dict(_tiny_denoiser_config(spec.family))
    return _pipeline_json(spec, f"{FAMILIES[spec.family].denoiser}/config.json")


def pipeline_class_here(spec: ModelSpec) -> str | None:
    """The pipeline class `spec`'s model_index.json names where it is here (a folder replaced since
    a profile was measured may hold another model), or None."""
    name = (_pipeline_json(spec, "model_index.json") or {}).get("_class_name")
    return name if isinstance(name, str) else None


# A tiny pipeline is built of the classes of its family's full-size one (test_models checks it).
_FULL_SIZE_OF_FAMILY = {"sd15": "sd15", "sdxl": "sdxl", "sd3": "sd3", "flux": "flux-dev"}


def component_classes(spec: ModelSpec) -> dict[str, str] | None:
    """The class name of each component of `spec`'s pipeline that model_index.json names ("vae":
    "AutoencoderKL"), schedulers and tokenizers included; None where its index is not here."""
    if spec.kind == "tiny":
        spec = replace(spec, name=_FULL_SIZE_OF_FAMILY[spec.family], kind="random")
    index = _pipeline_json(spec, "model_index.json")
    if index is None:
        return None
    return {name: value[1] for name, value in index.items()
            if isinstance(value, list) and len(value) == 2 and isinstance(value[1], str)}


def build_pipeline(spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The pipeline of `spec`, its weights in `dtype` on `device`, every module in eval mode."""
    device = torch.device(device)
    if spec.kind == "pretrained":
        return _load_pretrained(spec, dtype).to(device)
    if spec.kind == "tiny":
        from . import tiny

        pipe = tiny.build(spec.family)
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                cast_model(component, dtype, device)
        return pipe
    return _build_random(spec, dtype, device)


def _module_dtypes(model: torch.nn.Module, dtype: torch.dtype):
    """Each submodule with the dtype from_pretrained(torch_dtype=dtype) gives it: float32 for the ones the
    model keeps in float32 (T5's `wo` in float16), `dtype` for the rest. Tiny and random builds follow
    the same rule, so that they hold what a real load holds.
    """
    keep = set()
    if dtype == torch.float16:
        keep.update(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        keep.update(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, module in model.named_modules():
        yield module, torch.float32 if keep.intersection(name.split(".")) else dtype


def cast_model(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Move a built model to `device` and cast its floating tensors as `_module_dtypes` says.

    Tensor by tensor, not model.to(): a kept-in-float32 module keeps its float32 values exactly, and
    diffusers' `to` override would warn about float32 modules on every cast.
    """
    for module, module_dtype in _module_dtypes(model, dtype):
        for param in module._parameters.values():
            if param is not None:  # in place: the Parameter, and any tie to it, stays
                param.data = param.data.to(device, module_dtype)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                buffer_dtype = module_dtype if buffer.is_floating_point() else buffer.dtype
                module._buffers[name] = buffer.to(device, buffer_dtype)


def _load_pretrained(spec: ModelSpec, dtype: torch.dtype):
    import diffusers

    if not Path(spec.source).is_dir():
        _cached_index(spec.source)
    pipeline_class = getattr(diffusers, spec.pipeline_class)
    try:
        with warnings.catch_warnings():
            # diffusers 0.42 renamed torch_dtype to dtype and warns; earlier versions know only torch_dtype.
            warnings.filterwarnings("ignore", message="`torch_dtype` is deprecated", category=FutureWarning)
            # local_files_only: never the network, and a hub id missing from the cache fails at once.
            return pipeline_class.from_pretrained(spec.source, torch_dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load '{spec.source}': {first_line(e)}") from e


# --- random weights -------------------------------------------------------------------------------

_INIT_STD = 0.02
_POOL_SIZE = 1_000_003  # prime, so the repeating pattern does not line up with rows


class _Noise:
    """Cheap random init: copies from one pool of N(0, 0.02) values, continuing where it left off.

    Drawing billions of fresh normals costs ~0.15 G/s on a CPU (a minute for Flux); copying runs at
    memory speed. Weight values only need to be finite and varied: compute depends on shapes.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device):
        generator = torch.Generator(device=device).manual_seed(0)
        pool = torch.randn(_POOL_SIZE, generator=generator, device=device, dtype=torch.float32)
        self.pool = pool.mul_(_INIT_STD).to(dtype)
        self.offset = 0

    def fill_(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1)
        done = 0
        while done < flat.numel():
            n = min(flat.numel() - done, _POOL_SIZE - self.offset)
            flat[done : done + n].copy_(self.pool[self.offset : self.offset + n])
            done += n
            self.offset = (self.offset + n) % _POOL_SIZE


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, noise: _Noise) -> None:
    """Give every meta parameter real storage on `device` (in `dtype`, see `_module_dtypes`): norm weights 1,
    biases 0, the rest noise. Buffers were built for real (positions, rotary tables) and are only moved.
    """
    made = {}  # id(meta parameter) -> real one, so tied parameters stay tied
    for module, module_dtype in _module_dtypes(model, dtype):
        is_norm = "Norm" in type(module).__name__
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                data = torch.empty(param.shape, dtype=module_dtype, device=device)
                if name == "bias":
                    data.zero_()
                elif is_norm:
                    data.fill_(1.0)
                else:
                    noise.fill_(data)
                made[id(param)] = torch.nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
    cast_model(model, dtype, device)  # the buffers


def _empty_model(library: str, class_name: str, config_file: Path) -> torch.nn.Module:
    """The model a shipped config describes, its parameters on `meta` (no storage, no slow default init).

    Only parameters go to meta as they are registered; buffers (CLIP's position ids, SD3's positional
    table) are computed for real, as they would be by from_pretrained.
    """
    from accelerate import init_empty_weights

    config = json.loads(config_file.read_text())
    if library == "transformers":
        import transformers

        model_class = getattr(transformers, class_name)
        with init_empty_weights():
            return model_class(model_class.config_class.from_dict(config))
    import diffusers

    with init_empty_weights():
        return getattr(diffusers, class_name).from_config(config)


def _build_random(spec: ModelSpec, dtype: torch.dtype, device: torch.device):
    import diffusers

    from .tiny import clip_tokenizer, t5_tokenizer

    directory = MODEL_CONFIGS / spec.name
    if not directory.is_dir():
        raise _no_configs(spec.name)
    index = json.loads((directory / "model_index.json").read_text())
    noise = _Noise(dtype, device)
    kwargs = {}
    for name, value in index.items():
        if name.startswith("_"):
            continue
        if not isinstance(value, list):  # a pipeline argument such as requires_safety_checker
            kwargs[name] = value
            continue
        library, class_name = value
        if library is None:  # optional part left out (safety checker, feature extractor)
            kwargs[name] = None
        elif name.startswith("tokenizer"):
            # Generated tokenizers: their ids are a small range of the real vocabularies.
            kwargs[name] = clip_tokenizer() if class_name == "CLIPTokenizer" else t5_tokenizer()
        elif name == "scheduler":
            config = json.loads((directory / name / "scheduler_config.json").read_text())
            kwargs[name] = getattr(diffusers, class_name).from_config(config)
        else:
            model = _empty_model(library, class_name, directory / name / "config.json")
            _materialize(model, dtype, device, noise)
            kwargs[name] = model.eval()
    return getattr(diffusers, spec.pipeline_class)(**kwargs)
