"""The knob catalogue and the one function that applies a configuration.

A configuration is a flat dict {knob name: choice}. `apply_config` is the only code that turns one
into pipeline state; trial workers and production (`Profile.apply`) both call it.

Order matters (see ../shared/notes/knobs.md): dtype first; fuse QKV before quantization (a
quantized weight cannot be concatenated); layout and attention processors next; offload hooks
after every change to the modules; compile last, so it traces the final modules.
"""

from __future__ import annotations

from typing import Any

from .attention import ATTENTION
from .base import Knob, Target
from .compile import COMPILE
from .layout import CHANNELS_LAST, FUSE_QKV
from .memory import OFFLOAD, VAE_SLICING, VAE_TILING, places_on_device
from .precision import DTYPE, DTYPES
from .quantize import QUANTIZE

APPLY_ORDER: tuple[Knob, ...] = (
    DTYPE,
    FUSE_QKV,
    QUANTIZE,
    CHANNELS_LAST,
    ATTENTION,
    VAE_SLICING,
    VAE_TILING,
    OFFLOAD,
    COMPILE,
)
CATALOGUE: dict[str, Knob] = {k.name: k for k in APPLY_ORDER}

# Combinations that are valid one by one but not together, as (partial config, reason). A value
# may be a list: any of its elements matches. The search never measures a config that matches one.
CONFLICTS: tuple[tuple[dict, str], ...] = (
    (
        {"fuse_qkv": True, "attention": ["sliced", "sliced-max"]},
        "attention slicing replaces the fused attention processors, undoing fuse_qkv",
    ),
)

Config = dict[str, Any]


def matches(rule: dict, config: Config) -> bool:
    """Whether a config matches a partial config such as {"offload": "model", "compile": [...]}."""
    for name, wanted in rule.items():
        value = config.get(name, CATALOGUE[name].default if name in CATALOGUE else None)
        if isinstance(wanted, list):
            if value not in wanted:
                return False
        elif value != wanted:
            return False
    return True


def conflict(config: Config) -> str | None:
    for rule, reason in CONFLICTS:
        if matches(rule, config):
            return reason
    return None


def baseline() -> Config:
    """The default pipeline: float32 and nothing enabled."""
    return {k.name: k.default for k in APPLY_ORDER}


def complete(config: Config) -> Config:
    """Every catalogue knob, in apply order, with defaults for those the config leaves out."""
    unknown = sorted(set(config) - set(CATALOGUE))
    if unknown:
        raise ValueError(f"unknown knob(s): {', '.join(unknown)}")
    full = baseline()
    full.update(config)
    for name, value in full.items():
        CATALOGUE[name].check(value)
    return full


def apply_config(pipe, config: Config, target: Target):
    """Put a freshly loaded pipeline into the state that `config` describes, on `target.device`."""
    config = complete(config)
    for knob in APPLY_ORDER:
        knob.apply(pipe, config[knob.name], target)
        if knob is DTYPE and places_on_device(config["offload"]):
            pipe.to(target.device)
    return pipe


def build_configured(spec, config: Config, target: Target):
    """Build `spec`'s pipeline and put it into the state `config` describes: the one sequence
    that trial workers and production (`Profile.load_pipeline`) both run."""
    from ..models import build_pipeline

    config = complete(config)
    # Offload hooks place the weights themselves: build on the CPU for them.
    build_device = target.device if places_on_device(config["offload"]) else "cpu"
    pipe = build_pipeline(spec, dtype=DTYPES[config["dtype"]], device=build_device)
    return apply_config(pipe, config, target)


__all__ = [
    "APPLY_ORDER",
    "CATALOGUE",
    "CONFLICTS",
    "Config",
    "Knob",
    "Target",
    "apply_config",
    "baseline",
    "build_configured",
    "complete",
    "conflict",
    "matches",
]
