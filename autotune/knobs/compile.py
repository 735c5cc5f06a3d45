"""torch.compile of the denoiser."""

from __future__ import annotations

import shutil

from .base import Knob, denoiser


def _apply_compile(pipe, value, target):
    if value == "none":
        return
    # In place (nn.Module.compile): the pipeline keeps the same module object, so hooks and
    # attribute access keep working. Compilation itself happens on the first call (the warm-up).
    mode = None if value == "default" else value
    denoiser(pipe).compile(mode=mode)


def _compile_unavailable(value, target):
    if value != "none" and not target.is_cuda:
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            return "torch.compile on the CPU needs a C++ compiler (none found on PATH)"
    return None


COMPILE = Knob(
    name="compile",
    choices=("none", "default"),
    default="none",
    help="torch.compile the denoiser (cost: compilation at the first call)",
    apply=_apply_compile,
    unavailable=_compile_unavailable,
)
