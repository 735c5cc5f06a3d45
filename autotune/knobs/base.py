"""What a knob is: its choices, when a choice can run, and how it changes a pipeline."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Target:
    """What a configuration is applied to, known before any pipeline is built.

    device: a torch device string ("cpu", "cuda", "cuda:1").
    family: the model family ("sdxl", "sd15", "sd3", "flux").
    capability: the CUDA compute capability as (major, minor), None on a CPU.
    """

    device: str
    family: str
    capability: tuple[int, int] | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def has_unet(self) -> bool:
        return self.family in ("sdxl", "sd15")


# A function that says why `value` cannot run on `target`, or None when it can.
Availability = Callable[[Any, Target], "str | None"]
# A function that changes `pipe` in place so that it runs with `value`.
Apply = Callable[[Any, Any, Target], None]


def always(value: Any, target: Target) -> str | None:
    return None


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple
    default: Any  # the baseline's value: applying it leaves a freshly loaded pipeline as it is
    help: str
    apply: Apply
    unavailable: Availability = field(default=always)
    # Where a choice is known to need no less device memory than another, all else equal: a
    # rank per choice, higher needing more (offload "none" > "model" > "sequential"). Knobs
    # whose choices trade memory both ways (compile, attention kernels) leave it None. The study
    # uses it to skip configs that only add memory to one that ran out (study.memory_dominated).
    memory_rank: dict | None = None

    def needs_no_less_memory(self, value: Any, than: Any) -> bool:
        """Whether `value` is known to need at least the device memory `than` needs."""
        if value == than:
            return True
        rank = self.memory_rank or {}
        return value in rank and than in rank and rank[value] >= rank[than]

    def check(self, value: Any) -> None:
        if value not in self.choices:
            known = ", ".join(str(c) for c in self.choices)
            raise ValueError(f"knob '{self.name}' has no choice {value!r} (choices: {known})")


def package_missing(name: str) -> str | None:
    """A reason when an optional package is not importable (checked without importing it)."""
    if importlib.util.find_spec(name) is None:
        return f"the package '{name}' is not installed"
    return None


def denoiser(pipe):
    """The pipeline's denoising network: the UNet or the transformer."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
