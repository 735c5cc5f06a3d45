"""What a knob is: its choices, when a choice can run, and how it changes a pipeline."""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import warn_at_caller
from ..models import FAMILIES
from ..workload import Workload


@dataclass(frozen=True)
class Target:
    """What a configuration is applied to, known before any pipeline is built.

    device: a torch device string ("cpu", "cuda", "cuda:1").
    family: the model family ("sdxl", "sd15", "sd3", "flux").
    capability: the CUDA compute capability as (major, minor), None on a CPU.
    workload: the calls the pipeline will make (size, steps, batch), for knobs whose effect
        depends on them (MagCache's step count, VAE slicing's batch, VAE tiling's tile size);
        None where no workload is known (listing the space).
    """

    device: str
    family: str
    capability: tuple[int, int] | None = None
    workload: Workload | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def capability_below(self, least: tuple[int, int]) -> bool:
        """Whether the GPU's compute capability is known and below `least`: False where it is not
        known (a CPU, or a GPU whose capability was not read)."""
        return self.capability is not None and tuple(self.capability) < least  # a worker reads it from JSON: a list

    @property
    def has_unet(self) -> bool:
        return FAMILIES[self.family].denoiser == "unet"

    @property
    def steps(self) -> int | None:
        return self.workload.steps if self.workload else None

    @property
    def batch_size(self) -> int | None:
        return self.workload.batch_size if self.workload else None


# A function that says why `value` cannot run on `target`, or None when it can.
Availability = Callable[[Any, Target], "str | None"]
# A function that changes `pipe` in place so that it runs with `value`. It also gets the complete
# config, for the few knobs that read another's value (compile reads compile_fullgraph).
Apply = Callable[[Any, Any, Target, dict], None]


def always(value: Any, target: Target) -> str | None:
    return None


def nothing(pipe, value, target: Target, config: dict) -> None:
    """The apply of a knob that another knob reads (compile_fullgraph is read by compile)."""


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
        # its choices, type and all: `in` alone takes 1 for True and 0 for False (YAML's 1 is an int)
        if not any(type(value) is type(choice) and value == choice for choice in self.choices):
            known = ", ".join(str(c) for c in self.choices)
            # YAML reads "true" in quotes as text: the likely slip behind a boolean knob's 'true'
            quoted = isinstance(value, str) and any(type(c) is not str and str(c).lower() == value.lower()
                                                    for c in self.choices)
            hint = f"; write {value} without quotes" if quoted else ""
            raise ValueError(f"knob '{self.name}' has no choice {value!r} (choices: {known}{hint})")


class ProcessSettings:
    """Process-wide settings (torch's TF32 and cuDNN flags, inductor's config) that a knob sets
    under both of its choices, so that a pipeline configured after another profile's gets the
    state its own trial measured: False puts back what the process had before autotune first set
    any. Read then, not at import: a serving process may set its own after importing autotune."""

    # What the last configuration of this process set, by setting (`configured`); the tests clear
    # it, each standing for a serving process of its own.
    configured_states: dict[str, object] = {}
    _configuring = threading.Lock()
    _instances: list[ProcessSettings] = []

    def __init__(self, read: Callable[[], dict]):
        self._read = read
        self._before: dict | None = None
        ProcessSettings._instances.append(self)

    @classmethod
    def forget(cls) -> None:
        """Forget what this process had before autotune set these, and what configurations set:
        as in a fresh process (the tests stand for one each)."""
        with cls._configuring:
            cls.configured_states.clear()
            for settings in cls._instances:
                settings._before = None

    @classmethod
    def configured(cls, what: str, state) -> None:
        """Record the `state` a configuration set of the setting `what`, and warn where an earlier
        configuration in this process set it otherwise: process-wide, it now holds for that one's
        pipeline too (two profiles served by one process)."""
        with cls._configuring:  # two threads configuring at once would both read the state before
            earlier = cls.configured_states.get(what, state)
            cls.configured_states[what] = state
        if earlier != state:
            warn_at_caller(f"{what}: a pipeline configured earlier in this process was measured with another setting; "
                           "it is process-wide, so that pipeline now runs (and compiles, if it has not yet) under this "
                           "one's: serve the two from separate processes")

    @property
    def touched(self) -> bool:
        """Whether autotune has set any of them in this process."""
        return self._before is not None

    def before(self) -> dict:
        if self._before is None:
            self._before = self._read()
        return self._before


class SearchOnly(str):
    """A reason to leave a choice out of the search on this target although it runs here: the
    search spends no trial on it, and a profile that holds it still loads (knobs.unrunnable)."""


class NoEffect(SearchOnly):
    """A choice that runs but changes nothing on this target (VAE slicing at batch size 1)."""


class Outrun(SearchOnly):
    """A choice that runs and changes the pipeline, where another choice of its knob, `by`, needs
    no more memory and runs much faster on this target (float16 on a CPU that computes bfloat16
    natively and float16 not). Left out only of a space that searches `by` too (a config of it
    that the space's rules allow, of choices that run on this target); a hand-made config that asks
    for it still runs it."""

    def __new__(cls, reason: str, by):
        self = super().__new__(cls, reason)
        self.by = by
        return self

    def __getnewargs__(self):  # copy and pickle call __new__ with these: str's would lack `by`
        return str(self), self.by


def package_missing(name: str) -> str | None:
    """A reason when an optional package is not importable (checked without importing it)."""
    if importlib.util.find_spec(name) is None:
        return f"the package '{name}' is not installed"
    return None


def needs_cuda(what: str):
    """An availability function: `what` runs only on a CUDA device (the default choice always runs)."""

    def unavailable(value, target: Target) -> str | None:
        if value not in (False, "none") and not target.is_cuda:
            return f"{what} needs a CUDA GPU"
        return None

    return unavailable


def denoiser_class(family: str):
    """The denoiser's class for a model family, from the installed diffusers: availability
    questions ("does it have enable_cache?") are asked of the class, before any pipeline exists."""
    import diffusers

    return getattr(diffusers, FAMILIES[family].denoiser_class)


def denoiser(pipe):
    """The pipeline's denoising network: the UNet or the transformer."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
