"""Which attention implementation runs. One knob, so the implementations exclude each other by
construction: attention slicing, xFormers and the dispatcher backends each replace what the others
installed.

- sdpa: PyTorch's scaled_dot_product_attention picking its kernel (diffusers' default).
- sdpa-flash / -efficient / -cudnn / -math: SDPA held to one kernel with
  torch.nn.attention.sdpa_kernel. That is a context around the call, not pipeline state, so the
  denoiser's forward is wrapped to run under it: the worker and production then call the pipeline
  the same plain way, and the VAE (whose float32 upcast and 512-wide single-head attention suit no
  half-precision-only kernel) keeps SDPA's own choice.
- sliced / sliced-max: `enable_attention_slicing("auto"/"max")`, UNet models only.
- xformers: `enable_xformers_memory_efficient_attention()` (UNet, SD3), or the "xformers" backend
  of diffusers' attention dispatcher (Flux).
- flash-attn / flash-attn-3 / sage: dispatcher backends (`set_attention_backend`), Flux only: for
  UNet2DConditionModel and SD3 the dispatcher is a silent no-op in diffusers 0.42.1.
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading

from ..errors import first_line
from ..models import FAMILIES
from .base import Knob, NoEffect, denoiser, package_missing

# slice sizes in diffusers' terms: "auto" halves the heads per step, "max" runs one head at a time
_SLICES = {"sliced": "auto", "sliced-max": "max"}
# autotune's names -> torch.nn.attention.SDPBackend members
_SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-math": "MATH",
}
SDPA_KERNELS = tuple(_SDPA_BACKENDS)  # the choices that hold SDPA to one kernel
# autotune's names -> diffusers.models.attention_dispatch.AttentionBackendName values
_DISPATCHER = {"flash-attn": "flash", "flash-attn-3": "_flash_3", "sage": "sage"}


def _hold_sdpa_kernel(model, kernel_name: str) -> None:
    """Wrap the model's forward to run under one SDPA kernel, held by this process's hold of the
    switches (_enter_hold, _leave_hold), taken eagerly: around a compiled forward too (the wrapper is
    kept out of the graph, and the forward inside it compiled on its own, under the switches it
    runs with). A sdpa_kernel context inside the forward was traced by dynamo instead: the graph
    kept SDPA's own kernel, and the switches were set again at run time around each graph break,
    outside any hold. (So no fullgraph compile of the whole model: a rule forbids it.)"""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = getattr(SDPBackend, kernel_name)
    forward = model.forward
    # dynamo compiles the callees of a frame it skips (recursive=False below): the hold's own
    # functions, which read and change shared state, are kept out of graphs whole
    enter, leave = torch.compiler.disable(_enter_hold), torch.compiler.disable(_leave_hold)

    @functools.wraps(forward)  # keeps the signature that pipelines inspect
    def held(*args, **kwargs):
        if getattr(_in_a_hold, "inside", False):  # nested in this thread's call: torch's nesting restores in order
            with sdpa_kernel(kernel):
                return forward(*args, **kwargs)
        token = object()  # made before the try: whatever interrupts, leave() sees this call's token
        try:
            enter(kernel, token)
            return forward(*args, **kwargs)
        finally:
            leave(token)

    forward_under_kernel = torch.compiler.disable(held, recursive=False)  # recursive=False: forward still compiles
    forward_under_kernel.sdpa_kernel = kernel  # what tests and `autotune show` can read back
    model.forward = forward_under_kernel


# torch's sdpa_kernel sets process-wide switches, and restores on exit what it found on entry: two
# threads' calls that overlapped (a server calling pipelines from several threads) restored them
# out of order, and left SDPA held to one kernel for good, for every pipeline of the process. So
# the calls of this process share one hold: calls asking for the kernel held join it while no call
# waits for another kernel (else they wait too, so that one is not starved), one asking for
# another kernel waits until none holds the first, and the last to leave restores the switches.
_HOLD = threading.Condition()
# "last": the kernel held now while "holders" is not empty, else the one held last
_held = {"last": None, "holders": set(), "context": None, "waiting": collections.Counter()}
_in_a_hold = threading.local()  # this thread's call is inside a hold already (a nested call)


def _may_enter(kernel) -> bool:
    """Whether a call on `kernel` may join now: turns alternate between kernels while calls of
    another wait, so that a steady stream of calls on one kernel starves none."""
    others_wait = any(n for k, n in _held["waiting"].items() if k != kernel)
    if not _held["holders"]:  # free: the kernel held last goes again only if no other waits
        return not (others_wait and kernel == _held["last"])
    return _held["last"] == kernel and not others_wait


def _enter_hold(kernel, token: object) -> None:
    """Join the hold of `kernel` as `token`, waiting while another kernel is held (the token is
    added in one step: a Ctrl-C leaves the call in the hold or out of it, never half)."""
    from torch.nn.attention import sdpa_kernel

    try:
        with _HOLD:
            _held["waiting"][kernel] += 1
            try:
                while not _may_enter(kernel):
                    _HOLD.wait()
            finally:
                _held["waiting"][kernel] -= 1
            if not _held["holders"]:
                # kept before it is entered: a Ctrl-C on the way in (even between __enter__
                # returning and this line's end) leaves _leave_hold the context to look at
                context = sdpa_kernel(kernel)
                _held.update(context=context, last=kernel)
                context.__enter__()
            _held["holders"].add(token)
        _in_a_hold.inside = True
    except BaseException:
        _leave_hold(token)  # a Ctrl-C while it waited or joined: nothing of it stays
        raise


def _leave_hold(token: object) -> None:
    """Leave the hold; the last call out restores the switches (as does a call stopped between
    entering the context and joining the hold, which no other call could leave)."""
    _in_a_hold.inside = False
    with _HOLD:
        _held["holders"].discard(token)
        if not _held["holders"] and _held["context"] is not None:
            context, _held["context"] = _held["context"], None
            # Entered and not left: exit it. torch's sdpa_kernel is a generator context, whose
            # state says so (a private field: an ExitStack, the public way, registers the exit
            # only after __enter__ returns, and a Ctrl-C between the two left the switches set)
            if inspect.getgeneratorstate(context.gen) == inspect.GEN_SUSPENDED:
                context.__exit__(None, None, None)
        _HOLD.notify_all()


def _apply_attention(pipe, value, target, config):
    # "sdpa" is what diffusers installs by default (AttnProcessor2_0): on UNet models and SD3 nothing
    # to do, and leaving the processors alone keeps the fused ones that fuse_qkv may have installed.
    # Flux's processors go through the dispatcher: there "sdpa" is pinned, as every choice is.
    if (value == "sdpa" or value in SDPA_KERNELS) and target.family == "flux":
        _pin_backend(pipe.transformer, "native")  # native SDPA: what the sdpa_kernel context below acts on
    if value in _SLICES:
        pipe.enable_attention_slicing(_SLICES[value])
    elif value in SDPA_KERNELS:
        _hold_sdpa_kernel(denoiser(pipe), _SDPA_BACKENDS[value])
    elif value == "xformers":
        if target.family == "flux":
            _pin_backend(pipe.transformer, "xformers")
        else:
            pipe.enable_xformers_memory_efficient_attention()
    elif value in _DISPATCHER:
        _pin_backend(pipe.transformer, _DISPATCHER[value])


def replaces_processors(config: dict, family: str) -> bool:
    """Whether `config` installs attention processors of its own in place of those the pipeline
    holds (an IP-Adapter's): fused QKV's, and slicing's on a UNet model (a no-op elsewhere).
    xFormers keeps an IP-Adapter's (diffusers converts them to their xFormers twins)."""
    return bool(config.get("fuse_qkv")) or (config.get("attention") in _SLICES and FAMILIES[family].denoiser == "unet")


def _pin_backend(model, backend: str) -> None:
    """Name `backend` in each of the model's attention processors, and nothing else.

    A processor that names no backend runs the process-wide default, which diffusers'
    set_attention_backend also sets (0.42.1): a pipeline left on that default would switch to
    flash-attn the moment another pipeline in the process chose it, and a pipeline the user built
    without autotune would inherit this one's choice. So every choice is pinned on the processors
    (the public call) and the process-wide default is put back as it was (a private name, hence
    the one place that touches it)."""
    import logging

    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry._active_backend
    # Each call logs that the dispatcher is experimental: noise in a serving process that loads a
    # profile, for a choice the profile measured. A filter drops that one notice, so a warning
    # another thread logs meanwhile still shows (lowering the logger's level would hide it).
    logger = logging.getLogger("diffusers.models.modeling_utils")
    logger.addFilter(_drop_experimental_notice)
    try:
        model.set_attention_backend(backend)
    finally:
        logger.removeFilter(_drop_experimental_notice)
        _AttentionBackendRegistry.set_active_backend(default)


def _drop_experimental_notice(record) -> bool:
    return not record.getMessage().startswith("Attention backends are an experimental feature")


def _xformers_unusable() -> str | None:
    """A reason when xFormers cannot run here: not installed, or installed without kernels that
    load with this torch (a wheel built for another torch imports fine, then every attention call
    raises "No operator found"). Read from xformers' own load result, without touching CUDA."""
    missing = package_missing("xformers")
    if missing:
        return missing
    import torch
    import xformers

    # xformers' own record of loading its compiled library: the exception it met, or None. Not
    # `_has_cpp_library`, which is also False in builds that compile nothing here and take their
    # kernels from another package. Private names, hence the defaults: a version without them is
    # taken as usable, as before this check.
    try:
        from xformers import _cpp_lib
    except ImportError:
        return None
    failure = getattr(_cpp_lib, "_cpp_library_load_exception", None)
    if failure is not None:
        build = getattr(failure, "build_info", None)  # xFormersInvalidLibException's record of its build
        built_for = f" (built for torch {build.torch_version})" if build else ""
        return f"xFormers {xformers.__version__} has no CUDA kernels that load with torch {torch.__version__}{built_for}"
    return None


def _dispatcher_requirement(backend: str) -> str | None:
    """diffusers' own check of a dispatcher backend (package installed, version), as a reason."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except (RuntimeError, ValueError, ImportError) as exc:
        return first_line(exc)
    return None


def _attention_unavailable(value, target):
    if value == "sdpa":
        return None
    if value in _SLICES:
        if not target.has_unet:
            return NoEffect(f"attention slicing is a no-op for {target.family} (only UNet models slice attention)")
        return None
    if value == "sdpa-math":
        return None  # runs everywhere: the reference kernel
    if value == "sdpa-flash" and not target.is_cuda:
        # torch's CPU SDPA has two kernels, flash and math, and takes flash wherever it runs
        return NoEffect("on a CPU, SDPA runs its flash kernel already wherever it can")
    if not target.is_cuda:
        return f"{value} needs a CUDA GPU"
    if value in SDPA_KERNELS:
        if value == "sdpa-cudnn" and target.capability_below((8, 0)):
            return f"cuDNN attention needs compute capability 8.0 or more ({target.capability} here)"
        if value == "sdpa-flash" and target.capability_below((8, 0)):
            return f"SDPA's flash kernel needs compute capability 8.0 or more ({target.capability} here)"
        return None
    if value == "xformers":
        return _xformers_unusable() or (_dispatcher_requirement("xformers") if target.family == "flux" else None)
    # the dispatcher backends
    if target.family != "flux":
        return (f"attention-backend dispatcher ({value}) is a silent no-op for {target.family} in diffusers "
                "0.42.1 (effective on Flux only)")
    if value == "flash-attn-3" and target.capability_below((9, 0)):
        return f"FlashAttention 3 needs a Hopper GPU (compute capability 9.0; {target.capability} here)"
    return _dispatcher_requirement(_DISPATCHER[value])


ATTENTION = Knob(
    name="attention",
    choices=("sdpa", *_SLICES, *SDPA_KERNELS, "xformers", *_DISPATCHER),
    default="sdpa",
    help="attention implementation: SDPA (or one SDPA kernel), sliced, xFormers, flash-attn/sage (Flux)",
    apply=_apply_attention,
    unavailable=_attention_unavailable,
)
