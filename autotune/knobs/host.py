"""The host's memory allocator: glibc's mmap threshold, which decides whether freed blocks leave
the process or stay on its heap.

glibc gives a block of at least the threshold its own mapping, returned to the system when freed,
and serves smaller ones from its heap, which keeps what is freed for reuse. The threshold starts
at 128 KiB and, by default, rises to the size of each mapped block freed (up to 32 MiB), so after
the first large tensors are freed, later ones of that size land on the heap. Where a pipeline
copies and frees large weights (inductor freezing folds and prepacks every weight), the heap then
keeps those copies' holes and the process's peak grows by them.

Measured on this project's 2-core CPU (benchmarks/results/measurement_stability.md, 3 trials
each, the configs alternating): SD1.5 at 128x128 with int8 dynamic quantization, compiled and
frozen, peaked at 4.70 GiB with glibc's default, 3.84 GiB held at 1 MiB and 3.91 GiB at 4 MiB, its
calls about 7-15% slower held (within the VM's drift). Uncompiled, bf16 with int8 weight-only or
dynamic quantization peaked 0.58-0.66 GiB lower held at 1 MiB and ran 1.8-2x slower: torchao's
int8 layers make a weight-sized temporary at each call, each a fresh mapping when held. Held only
after the pipeline was built, the frozen stack gave 4.52 GiB: the weights as loaded, freed when
quantized, left their holes on the heap. Which one wins under a budget is measured like any other
knob.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

from ..errors import AutotuneError, warn_at_caller
from .base import Knob, NoEffect, ProcessSettings

THRESHOLDS = {"1MiB": 1 << 20, "4MiB": 4 << 20}
_M_MMAP_THRESHOLD = -3  # malloc.h
SETTING = "glibc's mmap threshold"  # as ProcessSettings.configured names it
_held: str | None = None  # what this process's threshold was held at by autotune, if it was
_warned = False


@functools.cache  # a process's C library and its malloc do not change; asked for each space and apply
def _glibc():
    """This process's glibc, or the reason it has none whose mallopt decides its allocations."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None, f"mallopt's M_MMAP_THRESHOLD is glibc's (this C library: {platform.libc_ver()[0] or platform.system()})"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # An allocator preloaded in front of glibc's (LD_PRELOAD of jemalloc or tcmalloc, common in
    # serving images) takes every malloc: glibc's mallopt would still say yes and change nothing.
    in_use = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    if in_use != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None, "this process's malloc is not glibc's (an allocator preloaded in front of it)"
    return libc, None


def _unavailable(value, target):
    if value == "dynamic":
        return None
    if target.is_cuda:  # NoEffect: a CPU profile that holds it still loads on a GPU (_apply passes it by)
        return NoEffect("on a GPU the budget is device memory, and this changes host memory only")
    return _glibc()[1]


def _apply(pipe, value, target, config):
    # Process-wide, for every block allocated from this call on: knobs.build_configured calls it
    # before it builds the pipeline (knobs.BEFORE_BUILD), so the weights as loaded follow it too.
    global _held, _warned
    if target.is_cuda:  # a CPU profile's choice, loaded onto a GPU: device memory is what counts there
        return
    if value == "dynamic":
        if _held is None:
            ProcessSettings.configured(SETTING, value)  # a later held threshold holds for this pipeline too
        elif not _warned:
            # glibc has no call that gives back its rising threshold once one was held.
            _warned = True
            warn_at_caller(f"glibc's mmap threshold stays held at {_held} in this process, held by a "
                           "configuration applied before; this one was measured with glibc's default")
        return
    # said where a pipeline configured before runs under another (helper-13: 1MiB, then 4MiB, in silence)
    ProcessSettings.configured(SETTING, value)
    libc, why_not = _glibc()
    if libc is None:
        raise AutotuneError(f"malloc_mmap_threshold={value} cannot be held here: {why_not}")
    if libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLDS[value]) != 1:
        raise AutotuneError(f"malloc_mmap_threshold={value}: glibc's mallopt refused {THRESHOLDS[value]} bytes")
    _held = value


MALLOC_MMAP_THRESHOLD = Knob(
    name="malloc_mmap_threshold",
    choices=("dynamic", *THRESHOLDS),
    default="dynamic",
    help="hold glibc's mmap threshold (mallopt) before the pipeline is built, so that freed host blocks "
    "above it go back to the system instead of staying on the heap: a lower peak where quantization "
    "frees the weights as loaded, page faults for every block above it a call allocates; process-wide",
    apply=_apply,
    unavailable=_unavailable,
)
