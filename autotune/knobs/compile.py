"""torch.compile: the mode, fullgraph, regional compilation, the VAE decoder, inductor settings.

`compile` is the knob that compiles; `compile_fullgraph`, `compile_regional` and `compile_vae` say
how, and are read by it (their own apply does nothing). Each of those, `inductor_flags` and
`compile_freezing` only matter when `compile` is not "none" (knobs.CONFLICTS forbids them
otherwise, so they never repeat the baseline). Compilation happens in place (nn.Module.compile), at the first call: the warm-up.

torch.jit.trace, which the older diffusers guides used to trace the UNet, is not a choice: it is
superseded by torch.compile. A traced module is frozen to one set of input shapes and Python control
flow taken at trace time, returns tuples instead of the UNet's output class (the guides wrapped it
by hand), breaks with hooks (offload, caches, layerwise casting), and torch has deprecated
TorchScript in favour of torch.compile/torch.export, which keep the module and trace it themselves.
"""

from __future__ import annotations

import os
import shutil

from ..errors import first_line
from .base import Knob, ProcessSettings, denoiser, denoiser_class, nothing
from .quantize import DYNAMIC_INT8

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# modes that capture CUDA graphs: the point of them is CUDA, and they cannot follow offload hooks
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _apply_compile(pipe, value, target, config):
    if value == "none":
        return
    options = {"mode": None if value == "default" else value, "fullgraph": bool(config["compile_fullgraph"])}
    if config["compile_regional"]:
        # Only the repeated blocks (the transformer blocks): much shorter compile, most of the gain.
        denoiser(pipe).compile_repeated_blocks(**options)
    else:
        # In place: the pipeline keeps the same module object, so hooks and attribute access work.
        denoiser(pipe).compile(**options)
    if config["compile_vae"]:
        # The decoder only (what the pipeline calls once per image); fullgraph is left off for it.
        pipe.vae.decoder.compile(mode=options["mode"])


def _compile_unavailable(value, target):
    if value == "none":
        return None
    if value in CUDA_GRAPH_MODES and not target.is_cuda:
        return f"mode {value} captures CUDA graphs: CUDA only"
    if not target.is_cuda:
        return _no_cpp_compiler()
    return _no_c_compiler_for_triton()


def _no_cpp_compiler() -> str | None:
    # Inductor's own search ($CXX, else g++ on Linux): a c++ or clang++ on PATH that it would not
    # use does not make compile a choice.
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # InvalidCxxCompiler, or the search's own OSError
        return f"torch.compile on the CPU needs a C++ compiler inductor finds ({first_line(exc)})"
    return None


COMPILE = Knob(
    name="compile",
    choices=("none", *MODES),
    default="none",
    help="torch.compile the denoiser in this mode (cost: compilation at the first call)",
    apply=_apply_compile,
    unavailable=_compile_unavailable,
)

COMPILE_FULLGRAPH = Knob(
    name="compile_fullgraph",
    choices=(False, True),
    default=False,
    help="compile with fullgraph=True (no graph breaks; not with hooks or caches)",
    apply=nothing,  # read by compile
)


def _regional_unavailable(value, target):
    if not value:
        return None
    cls = denoiser_class(target.family)
    if not getattr(cls, "_repeated_blocks", None):
        return f"{cls.__name__} names no _repeated_blocks: compile_repeated_blocks raises ValueError"
    return None


COMPILE_REGIONAL = Knob(
    name="compile_regional",
    choices=(False, True),
    default=False,
    help="compile only the repeated blocks (compile_repeated_blocks): far shorter compile",
    apply=nothing,  # read by compile
    unavailable=_regional_unavailable,
)

COMPILE_VAE = Knob(
    name="compile_vae",
    choices=(False, True),
    default=False,
    help="compile the VAE decoder too, in the same mode",
    apply=nothing,  # read by compile
)

# The SDXL guide's inductor settings ("Accelerate inference of text-to-image diffusion models").
# Process-global: a trial is its own process, and in serving, applying a profile sets them for the
# whole process. Set here alone (torchao is told not to set its own), and by both choices, so that a
# pipeline configured after another profile's compiles as its own trial did: False puts back what
# the process had before autotune set any (in a trial, torch's defaults).
_GUIDE_FLAGS = {
    "conv_1x1_as_mm": True,
    "coordinate_descent_tuning": True,
    "epilogue_fusion": False,
    "coordinate_descent_check_all_directions": True,
}
_INT8_FLAGS = {"force_fuse_int_mm_with_mul": True, "use_mixed_mm": True}  # with dynamic int8


def _inductor_config():
    from torch._inductor import config  # here: inductor is slow to import, and only compiling needs it

    return config


def _read_inductor_flags() -> dict:
    inductor = _inductor_config()
    # flags come and go between torch releases: those this torch has
    return {name: getattr(inductor, name) for name in {**_GUIDE_FLAGS, **_INT8_FLAGS} if hasattr(inductor, name)}


_INDUCTOR_FLAGS = ProcessSettings(_read_inductor_flags)


def _apply_inductor_flags(pipe, value, target, config):
    if config["compile"] == "none":
        # A pipeline that never compiles neither reads nor needs inductor's config: set back, it
        # undid the flags of a compiled pipeline served beside it before that one's first (lazy)
        # compile, and recorded, it warned of a conflict that changes nothing (helper-13).
        return
    # the choice, recorded before the early return: a later configuration that sets them otherwise warns
    _INDUCTOR_FLAGS.configured("inductor's flags", (bool(value), bool(value) and config["quantize"] in DYNAMIC_INT8))
    if not value and not _INDUCTOR_FLAGS.touched:
        return  # none set by autotune in this process: nothing to put back (inductor not imported)
    inductor = _inductor_config()
    before = _INDUCTOR_FLAGS.before()
    flags = dict(before)
    if value:
        flags.update(_GUIDE_FLAGS)
        if config["quantize"] in DYNAMIC_INT8:
            flags.update(_INT8_FLAGS)
    for name, setting in flags.items():
        if name in before:
            setattr(inductor, name, setting)


INDUCTOR_FLAGS = Knob(
    name="inductor_flags",
    choices=(False, True),
    default=False,
    help="the SDXL guide's inductor flags (1x1 convs as matmuls, coordinate-descent tuning, ...)",
    apply=_apply_inductor_flags,
)


# Inductor's freezing: the compiled graph takes the weights as constants, folds what depends on
# them alone, and (on the CPU) prepacks them for oneDNN's kernels. For inference only: the pipeline
# calls the denoiser under no_grad, as freezing needs. The originals stay on the module, so the
# weights are held twice where they are transformed: on the 2-core CPU here, SD1.5 (random
# weights) in bfloat16 at 128x128 with channels_last and compile=default ran in 0.71 and 0.74 s
# in two rounds of alternate trials against 1.39 and 3.10 s without it (the 3.10 beside other
# work), and in a third 1.49 s against 1.24 s, with a test run beside the frozen trial; at a peak
# of 4.35 GiB against 3.36 GiB.
# inductor's freezing_discard_parameters, which drops the originals once folded, did not lower
# that peak (4.35 GiB with it, 4.38 without, two rounds each, same stack): the peak comes during
# the freezing, while both are held, so it is not offered as a choice.
# The weights are then fixed: a change made in place after the first call (a LoRA fused into
# them) is not seen (pytorch#103990). Process-global, set by both choices as inductor_flags is.
_FREEZING = ProcessSettings(lambda: {"freezing": _inductor_config().freezing})


def _apply_freezing(pipe, value, target, config):
    if config["compile"] == "none":
        return  # as _apply_inductor_flags: inductor's config is no concern of an uncompiled pipeline
    _FREEZING.configured("inductor's freezing", bool(value))  # before the early return, as the flags' choice
    if not value and not _FREEZING.touched:
        return  # never set by autotune in this process: nothing to put back
    before = _FREEZING.before()  # read before the first set: what False puts back
    _inductor_config().freezing = True if value else before["freezing"]


COMPILE_FREEZING = Knob(
    name="compile_freezing",
    choices=(False, True),
    default=False,
    help="inductor freezing: the weights become constants of the compiled graph, folded and "
    "(on the CPU) prepacked; faster, and more memory",
    apply=_apply_freezing,
)


def _no_c_compiler_for_triton() -> str | None:
    # Inductor's CUDA kernels are Triton's, and Triton builds each kernel's launcher with a C
    # compiler at the first call: without one (a slim container image) every compiled trial
    # would fail there. Triton's own search where it has one (triton.runtime.build.get_cc in
    # recent releases), else the same order it uses: $CC, gcc, clang.
    try:
        from triton.runtime.build import get_cc
    except ImportError:  # Triton without get_cc, or no Triton (torch's CUDA wheels bring it)
        found = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    else:
        try:
            found = get_cc()
        except RuntimeError:
            found = None
    if not found:
        return "torch.compile on CUDA needs a C compiler for Triton's kernel launchers (gcc, clang, or $CC)"
    return None
