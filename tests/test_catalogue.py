"""The full catalogue (#4): each new knob's effect on a real tiny pipeline, what is dropped on this
machine and why, and every pair of choices each shipped space allows: applied cleanly, or ruled out.

Nothing is mocked. CUDA cannot exist here, so CUDA-only knobs are checked through their
availability and the conflict rules against a `Target(device="cuda", capability=(9, 0))` (a plain
value, never applied); tests/gpu/test_knobs_gpu.py applies them for real on a GPU.
"""

import copy
import ctypes
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autotune import AutotuneError, fingerprint
from autotune.knobs import APPLY_ORDER, CATALOGUE, CONFLICTS, Target, apply_config, baseline, build_configured, complete, conflict
from autotune.models import build_pipeline, resolve_model
from autotune.space import SHIPPED_DIR, Dimension, SearchSpace
from autotune.workload import Workload
from helpers import build_tiny

FAMILIES = ("sdxl", "sd15", "sd3", "flux")
H100 = (9, 0)


def cpu(family, steps=1, size=32, batch_size=1):
    return Target(device="cpu", family=family, workload=Workload(size, size, steps, batch_size=batch_size))


def cuda(family, capability=H100):
    return Target(device="cuda", family=family, capability=capability, workload=Workload(1024, 1024, 4))


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny pipelines on a shared 2-core machine: two threads fighting other processes made a call
    # 20x slower than one thread (measured: 5 s against 0.1-0.3 s).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_call(pipe, steps=1, size=32):
    """One cheap call: 1 step at 32x32 (a 4x4 latent), no classifier-free guidance."""
    out = pipe(prompt="a red cube", height=size, width=size, num_inference_steps=steps, guidance_scale=1.0,
               generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    return out.images


def _registries(model) -> list:
    """The diffusers hook registries anywhere in a model."""
    return [r for r in (getattr(m, "_diffusers_hook", None) for m in model.modules()) if r is not None]


def hooks_of(model) -> set:
    """Names of the diffusers hooks registered anywhere in a model."""
    return {name for registry in _registries(model) for name in registry.hooks}


def hooks_named(model, name: str) -> list:
    """The diffusers hooks called `name` anywhere in a model."""
    return [h for h in (r.get_hook(name) for r in _registries(model)) if h is not None]


def reason(knob, value, target):
    return CATALOGUE[knob].unavailable(value, target)


def xformers_said(why) -> bool:
    """Whether `why` is what xFormers on a CUDA target is dropped for on this machine: not
    installed (CI), installed with kernels that do not load with this torch (the GPU image's
    wheel, built for another); anything where its kernels load (on Flux the dispatcher's check)."""
    import importlib.util

    if importlib.util.find_spec("xformers") is None:
        return why == "the package 'xformers' is not installed"
    from autotune.knobs.attention import _xformers_unusable

    unusable = _xformers_unusable()
    return unusable is None or (why == unusable and "has no CUDA kernels that load" in why)


# ---- precision --------------------------------------------------------------------------------------
def test_tf32_and_cudnn_benchmark_are_cuda_only_with_a_reason():
    for knob in ("tf32", "cudnn_benchmark"):
        assert "needs a CUDA GPU" in reason(knob, True, cpu("sdxl"))
        assert reason(knob, False, cpu("sdxl")) is None  # the baseline's value always runs
        assert reason(knob, True, cuda("sdxl")) is None


def test_tf32_and_cudnn_benchmark_set_the_process_flags():
    # The flags exist (and are settable) in a CPU build of torch too: this applies them for real.
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        torch.backends.cudnn.allow_tf32 = False  # torch's default is on: the knob must turn it on
        CATALOGUE["tf32"].apply(None, True, cuda("sdxl"), {})
        CATALOGUE["cudnn_benchmark"].apply(None, True, cuda("sdxl"), {})
        assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"
        # inductor reads the process-wide figure when it autotunes: it must not raise
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:]


def test_sdxl_in_float16_keeps_the_vae_upcast_and_never_nans():
    pipe = build_tiny("sdxl", {"dtype": "float16"})
    assert pipe.vae.dtype == torch.float16
    assert pipe.vae.config.force_upcast  # the pipeline decodes in float32 because of it
    assert np.isfinite(small_call(pipe)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_dtype_applied_to_a_loaded_pipeline_gives_the_trials_dtypes(dtype):
    """`Profile.apply` on a pipeline loaded in float32 casts it as the trial's build did: T5 keeps
    its `wo` layers in float32 in float16 (transformers' rule, against overflow), nothing else does."""
    spec = resolve_model("tiny-sd3")
    target = Target(device="cpu", family="sd3")

    def dtypes(pipe):
        return {f"{name}.{p}": t.dtype for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)
                for p, t in c.state_dict().items() if t.is_floating_point()}

    built = dtypes(build_configured(spec, {"dtype": dtype}, target))
    applied = dtypes(apply_config(build_pipeline(spec), complete({"dtype": dtype}), target))
    assert applied == built
    kept = {k for k, v in built.items() if v == torch.float32}
    assert bool(kept) == (dtype == "float16") and all(".wo." in k for k in kept)


# ---- weights: quantization and fp8 storage --------------------------------------------------------
@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache for this test (the knob reads the location at each call)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def cache_fp16_fix_vae(hub):
    """A tiny SDXL-shaped VAE that stays in float16 (force_upcast False), laid out in `hub` as
    huggingface_hub lays out a download of the fp16-fix VAE (refs/main -> snapshots/REV)."""
    from diffusers import AutoencoderKL

    from autotune.knobs.precision import SDXL_VAE_FP16_FIX

    repo = hub / f"models--{SDXL_VAE_FP16_FIX.replace('/', '--')}"
    revision = "0" * 40
    vae = AutoencoderKL.from_config(build_tiny("sdxl").vae.config, force_upcast=False)
    vae.save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)


def test_fp16_fix_vae_is_sdxl_only_and_never_downloaded(hub_cache):
    assert "SDXL's VAE" in reason("vae_fp16_fix", True, cpu("sd15"))
    assert "not in the local Hugging Face cache" in reason("vae_fp16_fix", True, cpu("sdxl"))
    assert "only matters in float16" in conflict({"vae_fp16_fix": True, "dtype": "bfloat16"})
    cache_fp16_fix_vae(hub_cache)
    assert reason("vae_fp16_fix", True, cpu("sdxl")) is None


def test_fp16_fix_vae_replaces_sdxls_vae_and_decodes_in_float16(hub_cache, monkeypatch):
    cache_fp16_fix_vae(hub_cache)
    original = build_tiny("sdxl", {"dtype": "float16"})
    assert original.vae.config.force_upcast  # SDXL's own VAE: decoded in float32
    pipe = build_tiny("sdxl", {"dtype": "float16", "vae_fp16_fix": True})
    assert not pipe.vae.config.force_upcast and pipe.vae.dtype == torch.float16
    assert np.isfinite(small_call(pipe)).all()
    # searched under float16, on a CPU whose flags leave float16 in the search (both native)
    monkeypatch.setattr(fingerprint, "cpu_flags", lambda: frozenset({"amx_bf16", "avx512_fp16"}))
    space = SearchSpace.from_file(SHIPPED_DIR / "sdxl.yaml").restrict(cpu("sdxl"))
    assert {d.name: d.when for d in space.dimensions}["vae_fp16_fix"] == {"dtype": "float16"}


@pytest.mark.parametrize("flags, left_out", [
    ({"avx512_bf16", "avx2"}, True),  # the AMD EPYC of 2026-12-02: float16 6.5x slower than bfloat16
    ({"amx_bf16", "avx512_bf16", "avx512_fp16"}, False),  # a Sapphire Rapids Xeon: both native
    ({"avx2"}, False),  # neither native: both converted, both searched
    (set(), False),  # no flags listed (another OS): nothing decided from them
])
def test_float16_is_left_out_of_a_cpu_search_where_only_bfloat16_is_native(monkeypatch, flags, left_out):
    from autotune.knobs import unrunnable
    from autotune.knobs.base import Outrun

    monkeypatch.setattr(fingerprint, "cpu_flags", lambda: frozenset(flags))
    said = reason("dtype", "float16", cpu("sd15"))
    assert isinstance(said, Outrun) == left_out and (said is None) == (not left_out)
    assert reason("dtype", "float16", cuda("sd15")) is None
    assert reason("dtype", "bfloat16", cpu("sd15")) is None
    space = SearchSpace.from_file(SHIPPED_DIR / "sd15.yaml").restrict(cpu("sd15"))
    assert ("float16" in space.choices_of("dtype")) == (not left_out)
    if left_out:  # said with its reason, which survives a copy (its `by` too)
        import pickle

        said_in_space = next(d.reason for d in space.dropped if d.knob == "dtype" and d.value == "float16")
        assert "natively (avx512_bf16)" in said_in_space
        assert copy.deepcopy(said_in_space).by == pickle.loads(pickle.dumps(said_in_space)).by == "bfloat16"
    # a seed or warm start in float16 takes bfloat16 where float16 is left out, not float32
    assert space.fit([{"dtype": "float16", "channels_last": True}])[0]["dtype"] == ("bfloat16" if left_out else "float16")
    # left out of the search only: a profile or a hand-made config holding it still runs here
    assert unrunnable({"dtype": "float16"}, cpu("sd15")) == []
    # and only where the space searches bfloat16 too: a space of float32 and float16 measures both
    fp16_space = SearchSpace([Dimension("dtype", ("float32", "float16"))]).restrict(cpu("sd15"))
    assert fp16_space.choices_of("dtype") == ("float32", "float16")
    # or lists bfloat16 and forbids it: no config of it runs, so float16 is measured
    dtypes = Dimension("dtype", ("float32", "float16", "bfloat16"))
    assert "float16" in SearchSpace([dtypes], forbid=[{"dtype": "bfloat16"}]).restrict(cpu("sd15")).choices_of("dtype")
    # a rule that forbids some bfloat16 configs leaves others: float16 is still outrun
    some = SearchSpace([dtypes, Dimension("channels_last", (False, True))],
                       forbid=[{"dtype": "bfloat16", "channels_last": True}]).restrict(cpu("sd15"))
    assert ("float16" in some.choices_of("dtype")) == (not left_out)
    # and bfloat16 allowed only beside a choice this machine cannot run runs no config here either
    beside = SearchSpace([dtypes, Dimension("attention", ("sdpa", "xformers"))],
                         forbid=[{"dtype": "bfloat16", "attention": "sdpa"}]).restrict(cpu("sd15"))
    assert "float16" in beside.choices_of("dtype")


def test_layerwise_casting_stores_denoiser_weights_in_fp8_and_runs():
    pipe = build_tiny("sd15", {"layerwise_casting": "fp8-e4m3"})
    dtypes = {p.dtype for p in pipe.unet.parameters()}
    assert torch.float8_e4m3fn in dtypes
    assert torch.float32 in dtypes  # diffusers keeps norms and embeddings out of fp8
    assert "layerwise_casting" in hooks_of(pipe.unet)
    assert pipe.vae.dtype == torch.float32 and not hooks_of(pipe.vae)
    images = small_call(pipe)
    assert np.isfinite(images).all()
    assert torch.float8_e4m3fn in {p.dtype for p in pipe.unet.parameters()}  # cast back after use


def test_layerwise_casting_on_a_transformer_with_bfloat16_compute():
    pipe = build_tiny("flux", {"dtype": "bfloat16", "layerwise_casting": "fp8-e5m2"})
    assert torch.float8_e5m2 in {p.dtype for p in pipe.transformer.parameters()}
    assert np.isfinite(small_call(pipe)).all()


def test_fp8_layerwise_casting_breaks_the_compiled_graph_at_every_layer():
    """Why compile is forbidden with fp8 layerwise casting: diffusers' casting hooks are not
    compiler-disabled, and dynamo breaks the graph in their Module.to at each layer. Traced by
    dynamo (torch._dynamo.explain: no inductor, seconds), on the UNet's real inputs; should a
    later diffusers or torch trace through them, this fails and the rule is to be dropped."""
    import torch._dynamo

    def explained(config):
        pipe = build_tiny("sd15", {"dtype": "bfloat16", **config})
        inputs = {}

        def capture(module, args, kwargs):
            inputs.update(args=args, kwargs=kwargs)
            raise StopIteration  # the UNet's first call's inputs are all this needs

        handle = pipe.unet.register_forward_pre_hook(capture, with_kwargs=True)
        with pytest.raises(StopIteration):
            small_call(pipe)
        handle.remove()
        try:
            with torch.no_grad():
                return torch._dynamo.explain(pipe.unet.forward)(*inputs["args"], **inputs["kwargs"])
        finally:
            torch._dynamo.reset()

    plain, cast = explained({}), explained({"layerwise_casting": "fp8-e4m3"})
    assert plain.graph_break_count == 0
    assert cast.graph_break_count >= 20 and cast.op_count < plain.op_count / 2, (cast.graph_break_count, cast.op_count)
    assert "break the compiled graph at every layer" in conflict({**baseline(), "dtype": "bfloat16", "compile": "default",
                                                                   "layerwise_casting": "fp8-e4m3"})


def test_int8dq_with_the_guides_filter_quantizes_only_the_layers_it_names():
    from autotune.knobs.quantize import guide_filter

    # the guide's rule: more than 16 input features, and not one of the SDXL shapes it lists
    assert guide_filter(torch.nn.Linear(32, 64))
    assert not guide_filter(torch.nn.Linear(16, 64))
    assert not guide_filter(torch.nn.Linear(640, 640)) and not guide_filter(torch.nn.Conv2d(32, 32, 1))
    # the tiny UNet's shapes all pass it (none is listed): every one is quantized, and only they
    plain = build_tiny("sd15")
    wanted = {n for n, m in plain.unet.named_modules() if guide_filter(m)}
    assert wanted
    pipe = build_tiny("sd15", {"quantize": "int8dq-filtered"})
    quantized = {n for n, m in pipe.unet.named_modules()
                 if isinstance(m, torch.nn.Linear) and type(m.weight).__module__.startswith("torchao")}
    assert quantized == wanted
    # dynamic: each quantized layer quantizes its input too (torchao 0.18's Int8Tensor holds how;
    # int8wo's holds None), not weight-only int8 under the filter
    assert all(m.weight.act_quant_kwargs is not None for n, m in pipe.unet.named_modules() if n in quantized)
    assert np.isfinite(small_call(pipe)).all()


@pytest.mark.parametrize("family, encoders", [("sdxl", ("text_encoder", "text_encoder_2")),
                                              ("sd3", ("text_encoder", "text_encoder_2", "text_encoder_3"))])
def test_quantize_text_encoders_reaches_every_encoder_and_not_the_denoiser(family, encoders):
    pipe = build_tiny(family, {"quantize_text_encoders": "int8wo"})
    for name in encoders:
        linears = [m for m in getattr(pipe, name).modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m.weight).__module__.startswith("torchao") for m in linears), name
    denoiser = pipe.unet if family == "sdxl" else pipe.transformer
    assert not any(type(p).__module__.startswith("torchao") for p in denoiser.parameters())
    assert np.isfinite(small_call(pipe)).all()


@pytest.mark.parametrize("config", [{"quantize": "int8wo"}, {"quantize": "int8dq"}, {"quantize_text_encoders": "int8wo"}])
def test_quantization_leaves_the_inductor_settings_to_the_inductor_flags_knob(config, inductor_config):
    from autotune.knobs.compile import _GUIDE_FLAGS

    flags = {name: getattr(inductor_config, name) for name in _GUIDE_FLAGS}
    build_tiny("sdxl", config)  # inductor_flags left at False: nothing global may change
    assert {name: getattr(inductor_config, name) for name in _GUIDE_FLAGS} == flags
    assert inductor_config.force_fuse_int_mm_with_mul is False
    build_tiny("sdxl", {**config, "inductor_flags": True, "compile": "default"})  # they matter when compiling only
    assert all(getattr(inductor_config, name) == setting for name, setting in _GUIDE_FLAGS.items())


def test_float8_and_int4_need_a_recent_cuda_gpu():
    assert "compute capability 8.9" in reason("quantize", "float8dq", cpu("sdxl"))
    assert "(compute capability (8, 6) here)" in reason("quantize", "float8dq", cuda("sdxl", (8, 6)))
    assert reason("quantize", "float8dq", cuda("sdxl", (8, 9))) is None
    assert "compute capability 8.0" in reason("quantize", "int4wo", cpu("flux"))
    assert reason("quantize", "int4wo", cuda("flux", (8, 0))) is None
    # torchao's row-wise float8 and int4 tinygemm take bfloat16 weights only: ruled out otherwise
    assert conflict({**baseline(), "quantize": "int4wo", "dtype": "float16"})
    assert not conflict({**baseline(), "quantize": "float8dq", "dtype": "bfloat16"})


def test_float8_quantized_on_the_host_uses_torchs_quantize_kernel():
    # with the mslk package installed, torchao's AUTO picks mslk's GPU kernel even for host weights
    from torchao.quantization.quantize_.common import KernelPreference

    from autotune.knobs.quantize import _torchao_config

    assert _torchao_config("float8dq", on_host=True).kernel_preference == KernelPreference.TORCH
    assert _torchao_config("float8dq").kernel_preference == KernelPreference.AUTO  # on the GPU: torchao's pick


# ---- attention ---------------------------------------------------------------------------------------
def test_sdpa_kernel_choice_wraps_the_denoiser_call_and_only_it():
    """sdpa-math (the one kernel choice that runs on a CPU) holds SDPA to the math kernel inside
    the denoiser, for a plain pipe(...) call as production makes it; the VAE keeps SDPA's choice."""
    from torch.nn.attention import SDPBackend

    pipe = build_tiny("sd15", {"attention": "sdpa-math"})
    assert pipe.unet.forward.sdpa_kernel == SDPBackend.MATH
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
        return hook

    unet_attn = next(m for n, m in pipe.unet.named_modules() if n.endswith("attn1"))
    vae_attn = pipe.vae.decoder.mid_block.attentions[0]
    unet_attn.register_forward_pre_hook(record("unet"))
    vae_attn.register_forward_pre_hook(record("vae"))
    assert np.isfinite(small_call(pipe)).all()
    assert seen["unet"] == (False, True)  # only math inside the denoiser
    assert seen["vae"] == (True, True)  # SDPA's own choice outside it
    assert torch.backends.cuda.flash_sdp_enabled()  # and the context is left after the call


class _Denoiser:
    """A denoiser whose call waits inside until told to leave, to make two threads' calls overlap."""

    def __init__(self):
        self.inside, self.leave, self.seen = threading.Event(), threading.Event(), None

    def forward(self, x):
        b = torch.backends.cuda
        self.seen = (b.flash_sdp_enabled(), b.math_sdp_enabled())
        self.inside.set()
        assert self.leave.wait(10)
        return x


def _switches():
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_overlapping_calls_from_two_threads_leave_sdpa_as_they_found_it():
    """torch's sdpa_kernel sets process-wide switches: two threads' calls that overlapped and left
    out of order left SDPA held to the math kernel for good, for every pipeline of the process."""
    from autotune.knobs.attention import _hold_sdpa_kernel

    first, second = _Denoiser(), _Denoiser()
    for model in (first, second):
        _hold_sdpa_kernel(model, "MATH")
    threads = [threading.Thread(target=model.forward, args=(1,)) for model in (first, second)]
    threads[0].start()
    assert first.inside.wait(10)
    threads[1].start()
    assert second.inside.wait(10)
    first.leave.set()  # the first in leaves first
    threads[0].join(10)
    assert _switches() == (False, False, True)  # the second is still inside: held
    second.leave.set()
    threads[1].join(10)
    assert _switches() == (True, True, True)


def test_a_call_holding_another_kernel_waits_for_the_held_one_to_end():
    from autotune.knobs.attention import _hold_sdpa_kernel

    on_math, on_flash = _Denoiser(), _Denoiser()
    _hold_sdpa_kernel(on_math, "MATH")
    _hold_sdpa_kernel(on_flash, "FLASH_ATTENTION")
    threads = [threading.Thread(target=model.forward, args=(1,)) for model in (on_math, on_flash)]
    threads[0].start()
    assert on_math.inside.wait(10)
    threads[1].start()
    assert not on_flash.inside.wait(0.5)  # it would have run under the math switches
    on_math.leave.set()
    assert on_flash.inside.wait(10) and on_flash.seen == (True, False)
    on_flash.leave.set()
    for t in threads:
        t.join(10)
    assert on_math.seen == (False, True) and _switches() == (True, True, True)


def test_a_stream_of_calls_on_one_kernel_does_not_starve_a_call_on_another():
    # calls on the held kernel kept joining, and a call on another waited for as long as they came
    from autotune.knobs import attention

    first, on_flash, second = _Denoiser(), _Denoiser(), _Denoiser()
    for model, kernel in ((first, "MATH"), (on_flash, "FLASH_ATTENTION"), (second, "MATH")):
        attention._hold_sdpa_kernel(model, kernel)
    threads = {m: threading.Thread(target=m.forward, args=(1,)) for m in (first, on_flash, second)}
    threads[first].start()
    assert first.inside.wait(10)
    threads[on_flash].start()
    deadline = time.monotonic() + 10
    while not attention._held["waiting"][torch.nn.attention.SDPBackend.FLASH_ATTENTION] and time.monotonic() < deadline:
        time.sleep(0.01)
    threads[second].start()
    assert not second.inside.wait(0.5)  # the math kernel is held, but a flash call waits: its turn first
    first.leave.set()
    assert on_flash.inside.wait(10) and not second.inside.is_set()
    on_flash.leave.set()
    assert second.inside.wait(10)
    second.leave.set()
    for t in threads.values():
        t.join(10)
    assert _switches() == (True, True, True)


def test_a_ctrl_c_inside_a_call_or_while_it_waits_leaves_nothing_held():
    """A SIGINT (a real one, to this thread) interrupting a call waiting for another kernel, then
    one interrupting the call held: the hold is left free and SDPA's switches as found."""
    import signal

    assert threading.current_thread() is threading.main_thread()  # where Python raises KeyboardInterrupt
    # Python's own SIGINT handler: a CLI test run in this process before may have left autotune's
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_waiting_and_a_held_call()
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_a_waiting_and_a_held_call():
    import signal

    from autotune.knobs import attention

    on_math, on_flash = _Denoiser(), _Denoiser()
    attention._hold_sdpa_kernel(on_math, "MATH")
    attention._hold_sdpa_kernel(on_flash, "FLASH_ATTENTION")
    holder = threading.Thread(target=on_math.forward, args=(1,))
    holder.start()
    assert on_math.inside.wait(10)
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        on_flash.forward(1)  # waits for the math call to end: interrupted there
    timer.join()
    assert not on_flash.inside.is_set() and not any(attention._held["waiting"].values())
    on_math.leave.set()
    holder.join(10)
    assert not attention._held["holders"] and _switches() == (True, True, True)

    class Interrupted:
        def forward(self, x):
            raise KeyboardInterrupt

    model = Interrupted()
    attention._hold_sdpa_kernel(model, "MATH")
    with pytest.raises(KeyboardInterrupt):
        model.forward(1)
    assert not attention._held["holders"] and attention._held["context"] is None
    assert _switches() == (True, True, True)


def test_a_compiled_call_with_a_graph_break_stays_inside_the_hold(cpp_compiler):
    """dynamo sets the switches of a traced sdpa_kernel context again at run time, around each
    graph break (hooks, caches): outside any hold, where another thread's call held another kernel
    (and left flash held for good). Such a forward now compiles inside an eagerly taken hold."""
    import torch.nn.functional as F

    inside, leave = threading.Event(), threading.Event()
    seen = []

    @torch.compiler.disable
    def graph_break():
        seen.append(_switches())
        if threading.current_thread() is not threading.main_thread():  # the second call waits here
            inside.set()
            assert leave.wait(10)

    class Compiled(torch.nn.Module):
        def forward(self, q):
            out = F.scaled_dot_product_attention(q, q, q)
            graph_break()
            return out * 2

    from autotune.knobs.attention import _hold_sdpa_kernel

    compiled, eager = Compiled(), _Denoiser()
    _hold_sdpa_kernel(compiled, "MATH")
    _hold_sdpa_kernel(eager, "FLASH_ATTENTION")
    compiled.compile()
    q = torch.randn(1, 2, 4, 8)
    compiled(q)  # compiled here, alone
    assert seen == [(False, False, True)]
    holder = threading.Thread(target=eager.forward, args=(1,))
    holder.start()
    assert eager.inside.wait(10)
    runner = threading.Thread(target=compiled, args=(q,))
    runner.start()
    assert not inside.wait(0.5)  # waits for the flash call's hold to end
    eager.leave.set()
    assert inside.wait(10) and seen[-1] == (False, False, True)
    leave.set()
    for t in (holder, runner):
        t.join(10)
    assert _switches() == (True, True, True)


@pytest.mark.parametrize("compile_options", [{"compile": "default"}, {"compile": "default", "compile_regional": True}])
def test_a_compiled_denoiser_runs_the_kernel_chosen(compile_options, cpp_compiler):
    """sdpa-math under compile ran the CPU's flash op (torch's profiler, tiny sd15): dynamo traced
    the sdpa_kernel context inside the forward, and the graph kept SDPA's own kernel. The hold is
    now taken around the compiled forward, which is compiled under the math switches."""
    from torch.profiler import ProfilerActivity, profile

    pipe = build_tiny("sd15", {"attention": "sdpa-math", **compile_options})

    embeds, _ = pipe.encode_prompt("a red cube", "cpu", 1, False)

    def denoise():  # the denoiser alone: the text encoder's and the VAE's attention keep SDPA's own choice
        pipe(prompt_embeds=embeds, height=32, width=32, num_inference_steps=1, guidance_scale=1.0, output_type="latent")

    denoise()  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        denoise()
    ops = {event.key: event.count for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops, {o: n for o, n in ops.items() if "attention" in o}
    assert ops.get("aten::bmm", 0) >= 2  # the math kernel: two matmuls an attention call
    assert _switches() == (True, True, True)


def test_an_sdpa_kernel_choice_is_not_compiled_whole_with_fullgraph():
    fullgraph = {**baseline(), "attention": "sdpa-math", "compile": "default", "compile_fullgraph": True}
    assert "cannot hold an SDPA kernel choice" in conflict(fullgraph)
    assert not conflict({**fullgraph, "compile_regional": True})  # the blocks compile under the hold


def test_cuda_attention_choices_are_dropped_on_the_cpu_with_reasons():
    for value in ("sdpa-efficient", "sdpa-cudnn", "xformers"):
        assert "needs a CUDA GPU" in reason("attention", value, cpu("sdxl")), value
    # torch's CPU SDPA takes its flash kernel already: no trial spent on it, and it runs (helper-15)
    from autotune.knobs.base import NoEffect

    assert isinstance(reason("attention", "sdpa-flash", cpu("sdxl")), NoEffect)
    assert reason("attention", "sdpa-flash", cuda("sdxl")) is None
    assert "8.0" in reason("attention", "sdpa-cudnn", cuda("sdxl", (7, 5)))
    # xFormers on a GPU: the reason this machine's install gives (not installed, as in CI), or none
    assert xformers_said(reason("attention", "xformers", cuda("sd15")))


# what xformers 0.0.35 records when its library was built for another torch (its _cpp_lib.py)
INVALID_LIB = """
class _BuildInfo:
    torch_version = "2.10.0+cu128"
class xFormersInvalidLibException(Exception):
    def __init__(self, build_info):
        self.build_info = build_info
_build_metadata = None
_cpp_library_load_exception = xFormersInvalidLibException(_BuildInfo())
"""


@pytest.mark.parametrize("cpp_lib, usable", [
    ("_cpp_library_load_exception = OSError('undefined symbol')\n_has_cpp_library = False\n", False),
    (INVALID_LIB, False),
    # a build that compiles nothing and takes its kernels from another package: usable
    ("_cpp_library_load_exception = None\n_has_cpp_library = False\n", True),
    (None, True),  # a layout without the private module: taken as usable
])
def test_xformers_is_dropped_only_when_its_kernels_failed_to_load(tmp_path, monkeypatch, cpp_lib, usable):
    # xFormers' wheels pin a torch of their own (installing one here would replace torch): a
    # stand-in package, imported for real, holds what its load records.
    package = tmp_path / "xformers"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '0.0.99'\n")
    if cpp_lib is not None:
        (package / "_cpp_lib.py").write_text(cpp_lib)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("xformers", "xformers._cpp_lib"):  # imported afresh, and forgotten after the test
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
    why = reason("attention", "xformers", cuda("sd15"))
    assert (why is None) == usable, why
    if not usable:
        assert "xFormers 0.0.99 has no CUDA kernels that load with torch" in why
        # the torch it was built for, where it says (helper-22: read from an attribute it lacks)
        assert why.endswith(" (built for torch 2.10.0+cu128)") == (cpp_lib == INVALID_LIB), why


def test_dispatcher_backends_are_flux_only_and_need_their_packages():
    assert "no-op for sdxl" in reason("attention", "flash-attn", cuda("sdxl"))
    assert "no-op for sd3" in reason("attention", "sage", cuda("sd3"))
    # on Flux the reason is diffusers' own requirement check (flash-attn is not installed here)
    assert "flash" in reason("attention", "flash-attn", cuda("flux")).lower()
    assert "Hopper" in reason("attention", "flash-attn-3", cuda("flux", (8, 9)))


def test_attention_slicing_xformers_and_fused_qkv_exclude_each_other():
    fused = {**baseline(), "fuse_qkv": True}
    assert conflict({**fused, "attention": "sliced"})
    assert conflict({**fused, "attention": "xformers"}, "sdxl")
    assert conflict({**fused, "attention": "xformers"}, "sd3")
    assert conflict({**fused, "attention": "xformers"}, "flux") is None  # a dispatcher backend there
    assert conflict({**fused, "attention": "sdpa-flash", "dtype": "bfloat16"}) is None
    # slicing and xFormers are choices of one knob: they exclude each other by construction
    assert {"sliced", "xformers", "sdpa-flash", "flash-attn"} <= set(CATALOGUE["attention"].choices)


# ---- caches ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice, hook", [
    ("first-block", "fbc_leader_block_hook"),
    ("taylorseer", "taylorseer_cache"),
    ("magcache", "mag_cache_leader_block_hook"),
])
def test_caches_hook_the_flux_transformer(choice, hook):
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    pipe = build_configured(resolve_model("tiny-flux"), {"cache": choice}, cpu("flux", steps=2))
    pipe.set_progress_bar_config(disable=True)
    wanted = {"first-block": FirstBlockCacheConfig, "taylorseer": TaylorSeerCacheConfig, "magcache": MagCacheConfig}
    assert isinstance(pipe.transformer._cache_config, wanted[choice])
    assert hook in hooks_of(pipe.transformer)
    first, second = small_call(pipe, steps=2), small_call(pipe, steps=2)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, second)  # the cache's state is reset between calls


def test_magcache_takes_the_workload_steps():
    pipe = build_configured(resolve_model("tiny-flux"), {"cache": "magcache"}, cpu("flux", steps=7))
    assert pipe.transformer._cache_config.num_inference_steps == 7
    assert len(pipe.transformer._cache_config.mag_ratios) == 7
    with pytest.raises(ValueError, match="step count"):
        build_configured(resolve_model("tiny-flux"), {"cache": "magcache"}, Target(device="cpu", family="flux"))


def test_caches_are_dropped_where_the_model_has_no_enable_cache():
    for family in ("sdxl", "sd15", "sd3"):
        why = reason("cache", "first-block", cpu(family))
        assert "has no enable_cache" in why, family
    assert reason("cache", "taylorseer", cpu("flux")) is None


# ---- memory: offload, placement ---------------------------------------------------------------------
def test_vae_slicing_is_left_out_at_batch_size_one():
    # the same pipeline as without it at batch size 1: a trial on it would measure noise
    assert "at batch size 1 it changes nothing" in reason("vae_slicing", True, cpu("sdxl", batch_size=1))
    assert reason("vae_slicing", True, cpu("sdxl", batch_size=2)) is None
    assert reason("vae_slicing", True, Target("cpu", "sdxl")) is None  # no workload known (a listing): kept
    assert reason("vae_slicing", False, cpu("sdxl", batch_size=1)) is None


def test_vae_tiling_acts_at_sizes_the_vae_would_not_tile_itself():
    # The tiny VAE's sample size is 128 px: at 128x128 diffusers would decode the whole image, so
    # the knob halves the tile (SDXL at its own 1024x1024 is the same case, with 512 px tiles).
    spec = resolve_model("tiny-sd15")
    plain = build_configured(spec, {}, cpu("sd15", size=128))
    tiled = build_configured(spec, {"vae_tiling": True}, cpu("sd15", size=128))
    assert tiled.vae.use_tiling and (tiled.vae.tile_sample_min_size, tiled.vae.tile_latent_min_size) == (64, 8)
    for pipe in (plain, tiled):
        pipe.set_progress_bar_config(disable=True)
    whole, in_tiles = small_call(plain, size=128), small_call(tiled, size=128)
    assert np.isfinite(in_tiles).all() and not np.allclose(whole, in_tiles, atol=1e-3)  # it acted: seams
    # above the sample size diffusers' own tiles are kept
    larger = build_configured(spec, {"vae_tiling": True}, cpu("sd15", size=256))
    assert larger.vae.tile_sample_min_size == 128


def test_group_offload_is_cuda_only_and_ranked_where_known():
    offload = CATALOGUE["offload"]
    for value in ("group-block-1", "group-block-1-stream", "group-leaf", "group-leaf-stream", "group-leaf-stream-lowmem"):
        assert "needs a CUDA GPU" in offload.unavailable(value, cpu("sdxl"))
        assert offload.unavailable(value, cuda("sdxl")) is None
    assert offload.needs_no_less_memory("model", "group-block-1")
    assert offload.needs_no_less_memory("group-block-1", "sequential")
    assert not offload.needs_no_less_memory("group-block-1", "model")
    # prefetching kinds are not ranked: nothing is pruned on their account
    assert not offload.needs_no_less_memory("none", "group-leaf-stream")
    assert CATALOGUE["layerwise_casting"].needs_no_less_memory("none", "fp8-e4m3")


def test_offload_kinds_exclude_each_other_and_keep_the_pipeline_off_the_gpu():
    from autotune.knobs.memory import places_on_device

    # one knob: model, sequential and group offload can never be combined
    assert {"model", "sequential", "group-block-1", "group-leaf-stream"} <= set(CATALOGUE["offload"].choices)
    for value in CATALOGUE["offload"].choices:
        assert places_on_device({"offload": value}) == (value == "none")
    assert not places_on_device({"placement": "balanced"})


def test_configs_that_shrink_weights_are_built_on_the_host_for_a_gpu():
    from autotune.knobs import build_device

    assert build_device({"dtype": "bfloat16"}, cuda("sdxl")) == "cuda"
    for shrinks in ({"fuse_qkv": True}, {"quantize": "int8wo"}, {"quantize_text_encoders": "int8wo"},
                    {"layerwise_casting": "fp8-e4m3"}, {"offload": "model"}):
        assert build_device({"dtype": "bfloat16", **shrinks}, cuda("sdxl")) == "cpu", shrinks


def _rewritten(pipe) -> bool:
    linears = [m.weight for m in [*pipe.unet.modules(), *pipe.text_encoder.modules()]
               if isinstance(m, torch.nn.Linear)]
    fused = any(getattr(m, "fused_projections", False) for m in pipe.unet.modules())
    return fused or any(type(w).__module__.startswith("torchao") or w.dtype == torch.float8_e4m3fn for w in linears)


@pytest.mark.parametrize("config", [{"fuse_qkv": True}, {"quantize": "int8wo"}, {"quantize_text_encoders": "int8wo"},
                                    {"dtype": "bfloat16", "layerwise_casting": "fp8-e4m3"}])
def test_the_pipeline_moves_to_the_device_once_its_weights_are_rewritten(config):
    # On a GPU the move is what puts weights in device memory: made before quantization, the
    # full-precision weights would set the trial's peak. Here the CPU is the target, and the
    # pipeline's own `to` is wrapped to record the weights' state at each move.
    pipe = build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16 if "dtype" in config else torch.float32)
    moves, move = [], pipe.to

    def recording_to(*args, **kwargs):
        moves.append(_rewritten(pipe))
        return move(*args, **kwargs)

    pipe.to = recording_to
    apply_config(pipe, config, cpu("sd15"))
    assert moves == [True]


def test_quantize_runs_on_the_gpu_only_where_the_pipeline_will_live_there():
    from autotune.knobs.quantize import _quantize_on

    assert _quantize_on(cuda("sdxl"), {"dtype": "bfloat16"}) == "cuda"
    assert _quantize_on(cuda("sdxl"), {"offload": "model"}) is None  # the hooks keep weights on the host
    assert _quantize_on(cpu("sdxl"), {"dtype": "bfloat16"}) is None


def test_a_pipeline_already_on_the_device_is_warned_about_before_it_is_quantized():
    # The meta device stands in for a GPU (none here).
    pipe = build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16).to("meta")
    with pytest.warns(UserWarning, match="peak memory will be higher than the profile measured"):
        apply_config(pipe, {"dtype": "bfloat16", "layerwise_casting": "fp8-e4m3"},
                     Target(device="meta", family="sd15"))


def test_offload_refuses_a_pipeline_that_is_not_on_the_host():
    # The meta device stands in for a GPU (none here): the check is "anywhere but the CPU".
    pipe = build_tiny("sd15").to("meta")
    for value in ("model", "sequential", "group-leaf"):
        with pytest.raises(ValueError, match="load it on the CPU"):
            CATALOGUE["offload"].apply(pipe, value, cuda("sd15"), {})


def test_balanced_placement_needs_more_than_one_gpu():
    why = reason("placement", "balanced", cuda("sdxl"))
    assert "more than one CUDA GPU" in why and "(0 here)" in why
    assert conflict({**baseline(), "placement": "balanced", "offload": "model"})



def test_balanced_placement_counts_the_gpus_this_process_may_use(monkeypatch):
    """A --gpus worker sees its one GPU through CUDA_VISIBLE_DEVICES; its space, and the parent's
    restricted as the worker sees the machine, must both drop balanced placement, or the worker's
    study is refused as measured under another space. The NVIDIA driver cannot exist here: NVML's
    count of two GPUs is mocked, the count of the visible ones is autotune's own."""
    import types

    from autotune import fingerprint

    monkeypatch.setattr(fingerprint, "cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlDeviceGetCount=lambda: 2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert reason("placement", "balanced", cuda("sdxl")) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert "(1 here)" in reason("placement", "balanced", cuda("sdxl"))


def test_balanced_placement_counts_quantized_weights_at_their_stored_size():
    # diffusers' assignment sends a component larger than a GPU's free memory to the CPU: an
    # int8 denoiser counted as bfloat16 (what torchao's tensors report) would be sent there.
    from autotune.knobs.memory import stored_bytes

    plain = build_tiny("sdxl", {"dtype": "bfloat16"})
    quantized = build_tiny("sdxl", {"dtype": "bfloat16", "quantize": "int8wo"})
    linear = {n for n, m in plain.unet.named_modules() if isinstance(m, torch.nn.Linear)}
    linear_bytes = sum(p.numel() * 2 for n, m in plain.unet.named_modules() if n in linear for p in m.parameters())
    int8_weights = sum(m.weight.numel() for n, m in quantized.unet.named_modules()
                       if n in linear and type(m.weight).__module__.startswith("torchao"))
    assert int8_weights > 0
    saved = stored_bytes(plain.unet) - stored_bytes(quantized.unet)
    # an int8 weight takes 1 byte of 2, less the per-row scales it adds
    assert 0.8 * int8_weights <= saved <= int8_weights and saved < linear_bytes


def test_balanced_placement_attaches_the_hooks_that_align_inputs():
    # Two GPUs cannot be had here: the dispatch of one component runs for real, with accelerate,
    # to the CPU. Without force_hooks a one-device map attaches no hook, and a component fed
    # activations from another GPU would fail.
    from accelerate.hooks import AlignDevicesHook

    from autotune.knobs.memory import dispatch_whole

    pipe = build_tiny("sd15")
    expected = small_call(pipe)
    dispatch_whole(pipe.text_encoder, "cpu")
    assert isinstance(pipe.text_encoder._hf_hook, AlignDevicesHook)
    np.testing.assert_allclose(small_call(pipe), expected, atol=1e-6)

# ---- compile -----------------------------------------------------------------------------------------
def compiled(module) -> bool:
    return module._compiled_call_impl is not None


def test_compile_modes_and_what_needs_cuda():
    from autotune.knobs.compile import _no_cpp_compiler

    assert "CUDA graphs" in reason("compile", "reduce-overhead", cpu("sdxl"))
    assert "CUDA graphs" in reason("compile", "max-autotune", cpu("sdxl"))
    # nothing else keeps it from the CPU (None where inductor finds a C++ compiler)
    assert reason("compile", "max-autotune-no-cudagraphs", cpu("sdxl")) == _no_cpp_compiler()
    for mode in ("reduce-overhead", "max-autotune"):
        assert conflict({**baseline(), "compile": mode, "offload": "model"})
        assert conflict({**baseline(), "compile": mode, "offload": "group-leaf-stream"})


def test_regional_compile_wraps_the_repeated_blocks_only():
    # compiled, never called: compiling takes minutes per pipeline on this CPU
    pipe = build_tiny("flux", {"compile": "default", "compile_regional": True})
    blocks = [m for m in pipe.transformer.modules()
              if type(m).__name__ in ("FluxTransformerBlock", "FluxSingleTransformerBlock")]
    assert blocks and all(compiled(b) for b in blocks)
    assert not compiled(pipe.transformer)
    assert "_repeated_blocks" in reason("compile_regional", True, cpu("sd3"))
    assert reason("compile_regional", True, cpu("sdxl")) is None


def test_compile_vae_and_fullgraph():
    pipe = build_tiny("sd15", {"compile": "max-autotune-no-cudagraphs", "compile_vae": True, "compile_fullgraph": True})
    assert compiled(pipe.unet) and compiled(pipe.vae.decoder)
    assert not compiled(build_tiny("sd15", {"compile": "default"}).vae.decoder)
    for rule in ({"offload": "sequential"}, {"cache": "first-block"}, {"layerwise_casting": "fp8-e4m3"}):
        assert conflict({**baseline(), "compile": "default", "compile_fullgraph": True, **rule}), rule
    # the compile sub-knobs only mean something when compiling
    for knob in ("compile_fullgraph", "compile_regional", "compile_vae", "inductor_flags", "compile_freezing"):
        assert conflict({**baseline(), knob: True}), knob


def test_inductor_flags_set_the_guides_settings(inductor_config):
    build_tiny("sd15", {"compile": "default", "inductor_flags": True, "quantize": "int8dq"})
    assert inductor_config.conv_1x1_as_mm is True
    assert inductor_config.coordinate_descent_tuning is True
    assert inductor_config.epilogue_fusion is False
    if hasattr(inductor_config, "force_fuse_int_mm_with_mul"):
        assert inductor_config.force_fuse_int_mm_with_mul is True


def test_compile_freezing_sets_inductors_freezing_and_keeps_off_hooks_that_move_weights(inductor_config):
    build_tiny("sd15", {"dtype": "bfloat16", "compile": "default", "compile_freezing": True})
    assert inductor_config.freezing is True
    for rule in ({"offload": "model"}, {"offload": "group-block-1-stream"}, {"compile_regional": True}):
        assert "freezing" in conflict({**baseline(), "compile": "default", "compile_freezing": True, **rule}), rule


def test_a_false_global_flag_puts_back_what_the_process_had(inductor_config):
    # TF32, the cuDNN autotuner and the inductor flags are process-wide. In a serving process a
    # second profile that says False must get the state its own trial measured (a fresh
    # process's), not the first profile's True. Applied knob by knob: tf32 and the cuDNN
    # autotuner are CUDA-only choices, but what they set is readable on any machine.
    fresh = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
             inductor_config.save_config())
    on = complete({"compile": "default", "quantize": "int8dq", "tf32": True, "cudnn_benchmark": True,
                   "inductor_flags": True, "compile_freezing": True})
    off = complete({"compile": "default"})
    try:
        for config in (on, off):
            for knob in (CATALOGUE["tf32"], CATALOGUE["cudnn_benchmark"], CATALOGUE["inductor_flags"],
                         CATALOGUE["compile_freezing"]):
                knob.apply(None, config[knob.name], cpu("sdxl"), config)
            if config is on:
                assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.benchmark
                assert inductor_config.coordinate_descent_tuning is True and inductor_config.freezing is True
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark, inductor_config.save_config()) == fresh
    finally:
        torch.set_float32_matmul_precision(fresh[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = fresh[1], fresh[2]


# A child process: the threshold, once held, stays held for the rest of the process (glibc has
# no call that gives back its rising threshold). It reads glibc's own count of bytes in mapped
# blocks (mallinfo2's hblkhd) around a 2 MiB allocation made after a 16 MiB block was freed, which
# with glibc's default raises the threshold above 2 MiB. (A free heap chunk of 2 MiB would serve
# it under any threshold; after building a tiny pipeline glibc's heap holds a few hundred KiB free.)
_MAPPED_AFTER_A_FREE = """
import ctypes, sys, torch
sys.path.insert(0, {tests!r})
from helpers import build_tiny

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
import autotune.models
from autotune.knobs import host

build_pipeline = autotune.models.build_pipeline
held_at_build = []
def watched_build(*args, **kwargs):  # the real build, noting what was held when it began
    held_at_build.append(host._held)
    return build_pipeline(*args, **kwargs)
autotune.models.build_pipeline = watched_build
pipe = build_tiny("sd15", {{"malloc_mmap_threshold": {value!r}}})
print(held_at_build)
large = torch.empty(16 << 20, dtype=torch.uint8)  # mapped (above any threshold held here); freed, it raises glibc's default to 16 MiB
del large
before = mallinfo2().hblkhd
block = torch.empty(2 << 20, dtype=torch.uint8)
print(mallinfo2().hblkhd - before)
"""


def _child_env(**extra) -> dict:
    """This environment without what would set glibc's allocator from outside the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")}
    return {**env, **extra}


@pytest.mark.parametrize("value, mapped", [("dynamic", False), ("1MiB", True), ("4MiB", False)])
def test_malloc_mmap_threshold_holds_glibcs_threshold(value, mapped):
    if CATALOGUE["malloc_mmap_threshold"].unavailable("1MiB", cpu("sd15")):
        pytest.skip("no glibc malloc in this process")
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc before 2.33: no mallinfo2")
    code = _MAPPED_AFTER_A_FREE.format(tests=str(Path(__file__).parent), value=value)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_child_env())
    assert out.returncode == 0, out.stderr[-2000:]
    held_at_build, grew = out.stdout.strip().splitlines()[-2:]
    # held before the weights were allocated, so that they follow it too
    assert held_at_build == str([None if value == "dynamic" else value])
    grew = int(grew)
    # 2 MiB gets its own mapping only below a threshold held at 1 MiB; glibc's default has risen
    # to 16 MiB, and a threshold held at 4 MiB keeps it on the heap
    assert (grew >= 2 << 20) if mapped else (grew == 0), (value, grew)


def test_malloc_mmap_threshold_is_dropped_where_another_allocator_takes_malloc(tmp_path):
    """jemalloc or tcmalloc preloaded (common in serving images) takes every malloc; glibc's
    mallopt would still say yes. A real preloaded allocator, built here: one that forwards to glibc."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or CATALOGUE["malloc_mmap_threshold"].unavailable("1MiB", cpu("sd15")):
        pytest.skip("needs a C compiler and glibc")
    source = tmp_path / "forward.c"
    source.write_text("#include <stddef.h>\nextern void *__libc_malloc(size_t);\n"
                      "void *malloc(size_t n) { return __libc_malloc(n); }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "forward.so"), str(source)], check=True)
    code = ("from autotune.knobs import CATALOGUE, Target; "
            "print(CATALOGUE['malloc_mmap_threshold'].unavailable('1MiB', Target('cpu', 'sd15')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=_child_env(LD_PRELOAD=str(tmp_path / "forward.so")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "this process's malloc is not glibc's (an allocator preloaded in front of it)"


# A child process, as above: a threshold held for real stays held for the rest of the process, and
# this test's pytest worker runs other tests after it. A fresh process holds nothing yet.
_HELD_THEN_DEFAULT = """
import warnings
from autotune.knobs import CATALOGUE, Target, baseline, host

knob = CATALOGUE["malloc_mmap_threshold"]
cpu, cuda = Target("cpu", "sd15"), Target("cuda", "sdxl", capability=(9, 0))
with warnings.catch_warnings():
    warnings.simplefilter("error")
    knob.apply(None, "1MiB", cuda, baseline())  # a CPU profile's choice on a GPU: not held
    print(host._held)
    knob.apply(None, "dynamic", cpu, baseline())  # nothing held by autotune: nothing to say
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    knob.apply(None, "1MiB", cpu, baseline())  # held, by glibc's mallopt: the pipeline before runs under it
    knob.apply(None, "4MiB", cpu, baseline())  # another threshold, for both
    for _ in range(2):  # a profile measured with glibc's default, applied after it: said once
        knob.apply(None, "dynamic", cpu, baseline())
print([str(w.message) for w in said])
"""


def test_malloc_mmap_threshold_is_host_only_and_warns_where_it_cannot_be_undone(monkeypatch):
    from autotune.knobs import host, unrunnable

    knob = CATALOGUE["malloc_mmap_threshold"]
    assert "device memory" in knob.unavailable("1MiB", cuda("sdxl"))
    assert knob.unavailable("dynamic", cuda("sdxl")) is None
    # not searched on a GPU, yet a CPU profile holding it loads there: apply passes it by (helper-15)
    assert unrunnable({"malloc_mmap_threshold": "1MiB"}, cuda("sdxl")) == []
    if knob.unavailable("1MiB", cpu("sd15")) is None:  # glibc here: held for real, in a child
        out = subprocess.run([sys.executable, "-c", _HELD_THEN_DEFAULT], capture_output=True, text=True,
                             timeout=300, env=_child_env())
        assert out.returncode == 0, out.stderr[-2000:]
        held_on_a_gpu, said = out.stdout.strip().splitlines()[-2:]
        assert held_on_a_gpu == "None"
        other = ("glibc's mmap threshold: a pipeline configured earlier in this process was measured with another "
                 "setting; it is process-wide, so that pipeline now runs (and compiles, if it has not yet) under "
                 "this one's: serve the two from separate processes")
        assert said == str([other, other, "glibc's mmap threshold stays held at 4MiB in this process, held by a "
                            "configuration applied before; this one was measured with glibc's default"])
    # A C library other than glibc cannot exist in this process: its answer is scripted here.
    monkeypatch.setattr(host, "_glibc", lambda: (None, "mallopt's M_MMAP_THRESHOLD is glibc's (this C library: musl)"))
    assert knob.unavailable("1MiB", cpu("sd15")) == "mallopt's M_MMAP_THRESHOLD is glibc's (this C library: musl)"
    with pytest.raises(AutotuneError, match=r"^malloc_mmap_threshold=1MiB cannot be held here: mallopt's "):
        knob.apply(None, "1MiB", cpu("sd15"), baseline())


def test_tracing_is_documented_as_superseded():
    from autotune.knobs import compile as compile_knobs

    assert "torch.jit.trace" in compile_knobs.__doc__ and "superseded" in compile_knobs.__doc__


# ---- the order and the rules ----------------------------------------------------------------------------
def test_apply_order_puts_weight_rewrites_after_fusion_and_hooks_after_module_changes():
    order = [k.name for k in APPLY_ORDER]
    at = order.index
    assert at("fuse_qkv") < at("quantize") < at("layerwise_casting")
    assert at("attention") < at("cache") < at("offload") < at("compile")
    assert at("placement") < at("offload")
    assert order.index("compile") == min(at(n) for n in order if n.startswith("compile"))
    assert len(order) == len(set(order)) == len(CATALOGUE)


def test_every_conflict_names_known_knobs_and_choices():
    for rule, why in CONFLICTS:
        assert why and "\n" not in why
        for name, wanted in rule.items():
            if name == "family":
                assert set(wanted) <= set(FAMILIES)
                continue
            for value in wanted if isinstance(wanted, list) else [wanted]:
                CATALOGUE[name].check(value)


# ---- every pair each shipped space allows ---------------------------------------------------------
COMPILE_KNOBS = ("compile", "compile_fullgraph", "compile_regional", "compile_vae", "inductor_flags", "compile_freezing")


def allowed_pairs(space):
    """Every single choice and every pair of choices (of two knobs) away from the baseline that
    `space` can propose, as full configs; a knob searched under `when` brings the condition it
    needs (compile_fullgraph=True comes with compile=default), and a pair forbidden in float32
    alone comes in half precision. Pairs the space can never propose (their `when` conditions
    disagree) are left out. Returns [(pair, config)]."""
    values = [(d.name, v) for d in space.dimensions for v in d.choices if v != CATALOGUE[d.name].default]
    dims = {d.name: d for d in space.dimensions}
    out = []
    for combo in itertools.chain(((p,) for p in values), itertools.combinations(values, 2)):
        if len({name for name, _ in combo}) < len(combo):
            continue
        partial = dict(combo)
        for name, _ in combo:
            for other, wanted in (dims[name].when or {}).items():
                partial.setdefault(other, wanted[0] if isinstance(wanted, list) else wanted)
        config = space.normalize(partial)
        if "dtype" not in partial and "dtype" in dims and space.forbidden(config):
            # a choice that takes half precision only (a flash kernel, float8 or int4, the
            # fp16-fix VAE) would otherwise meet nothing but the precision, forbidden in the
            # baseline's float32: it comes with the first half precision the rules allow
            for half in ("bfloat16", "float16"):
                if half in dims["dtype"].choices:
                    candidate = space.normalize({**partial, "dtype": half})
                    if not space.forbidden(candidate):
                        config = candidate
                        break
        if all(config[name] == value for name, value in combo):
            out.append((dict(combo), config))
    return out


def key(config) -> str:
    return str(sorted(config.items(), key=str))


def split_compile(config):
    """The config without its compile knobs, and the compile knobs alone."""
    rest = {k: (CATALOGUE[k].default if k in COMPILE_KNOBS else v) for k, v in config.items()}
    return rest, {k: config[k] for k in COMPILE_KNOBS}


def by_rest(configs):
    """{key of a config without its compile knobs: (that config, [(pair, compile knobs), ...])}:
    each group is applied and called once, its compile variants applied to that copy after."""
    groups = {}
    for pair, config in configs:
        rest, compile_part = split_compile(config)
        groups.setdefault(key(rest), (rest, []))[1].append((pair, compile_part))
    return groups


def compile_variant_problem(pipe, full, target, denoiser) -> str | None:
    """Apply the compile knobs of `full` to a pipeline its other knobs were applied to (compile is
    last in APPLY_ORDER: the same sequence); what they wrapped, wrong, or None. The pipeline is
    unwrapped after, for the next variant."""
    try:
        for knob in APPLY_ORDER:
            if knob.name in COMPILE_KNOBS:
                knob.apply(pipe, full[knob.name], target, full)
        model = getattr(pipe, denoiser)
        if full["compile_regional"]:
            if not any(m._compiled_call_impl is not None for m in model.modules()):
                return "no block of the denoiser wrapped for regional compilation"
        elif model._compiled_call_impl is None:
            return "the denoiser not wrapped for compilation"
        if (pipe.vae.decoder._compiled_call_impl is not None) != full["compile_vae"]:
            return f"the VAE decoder wrapped or not against compile_vae={full['compile_vae']}"
        return None
    finally:
        uncompile(pipe)


def uncompile(pipe):
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for m in module.modules():
                m._compiled_call_impl = None


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pair_a_shipped_space_allows_applies_cleanly_or_is_ruled_out(family, inductor_config):
    """Both the family's space and default.yaml, restricted to this CPU. Each allowed pair is
    applied (apply_config, the path trials and production share) to a copy of the family's tiny
    pipeline, followed by one call (1 step, 32x32). Compile pairs are applied but never called:
    compiling takes minutes here. Their compile knobs are applied last onto the copy that the rest
    of the config was applied to (compile is last in APPLY_ORDER, so this is the same sequence),
    and the test checks the modules are wrapped (`_compiled_call_impl`); the copy is then
    un-wrapped for the next compile variant."""
    started = time.perf_counter()
    spec = resolve_model(f"tiny-{family}")
    target = cpu(family)
    spaces = [SearchSpace.from_file(SHIPPED_DIR / f"{name}.yaml").restrict(target) for name in (family, "default")]
    configs, forbidden = {}, {}
    for space in spaces:
        for pair, config in allowed_pairs(space):
            why = space.forbidden(config)
            if why:
                forbidden[key(config)] = (pair, why)
            else:
                configs[key(config)] = (pair, config)
    # what was dropped on this machine is reported with a reason, and never proposed
    dropped = {(d.knob, d.value) for space in spaces for d in space.dropped}
    assert all(d.reason for space in spaces for d in space.dropped)
    for pair, config in configs.values():
        assert not any((k, v) in dropped for k, v in config.items() if v != CATALOGUE[k].default), pair

    bases = {}
    calls = compiled_checks = 0
    for rest, variants in by_rest(configs.values()).values():
        if not bases:
            bases["float32"] = build_pipeline(spec)  # not configured: each copy is configured once
        if rest["dtype"] not in bases:  # a cast copy: cheaper than building tiny-sdxl again
            bases[rest["dtype"]] = apply_config(copy.deepcopy(bases["float32"]), {"dtype": rest["dtype"]}, target)
        base = bases[rest["dtype"]]
        # the denoiser and the VAE are what knobs change; the text encoders are shared, except
        # with a config that quantizes them
        denoiser = "unet" if family in ("sdxl", "sd15") else "transformer"
        own = [denoiser, "vae"]
        if rest["quantize_text_encoders"] != "none":
            own += [name for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
                    if getattr(base, name, None) is not None]
        pipe = type(base).from_pipe(base, **{name: copy.deepcopy(getattr(base, name)) for name in own})
        pipe.set_progress_bar_config(disable=True)
        apply_config(pipe, rest, target)
        assert np.isfinite(small_call(pipe)).all(), (family, variants[0][0])
        calls += 1
        for pair, compile_part in variants:
            if compile_part["compile"] == "none":
                continue
            assert compile_variant_problem(pipe, {**rest, **compile_part}, target, denoiser) is None, pair
            compiled_checks += 1
    elapsed = time.perf_counter() - started
    print(f"{family}: {len(configs)} allowed configs ({calls} called, {compiled_checks} compile checks), "
          f"{len(forbidden)} forbidden, {len(dropped)} choices dropped, {elapsed:.1f} s")
    # compile is dropped, with its reason, where inductor finds no C++ compiler (a slim image)
    assert calls > 20 and (compiled_checks > 10 or ("compile", "default") in dropped)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pair_on_a_cuda_target_is_allowed_only_if_its_choices_run_there(family, cuda_host_compiler):
    """The same spaces restricted to a CUDA GPU of capability 9.0 (a value: nothing runs on CUDA
    here): every pair is built from choices available there, and the known-invalid ones are ruled
    out with a reason."""
    target = cuda(family)
    space = SearchSpace.from_file(SHIPPED_DIR / f"{family}.yaml").restrict(target)
    dropped = {(d.knob, d.value): d.reason for d in space.dropped}
    assert "more than one CUDA GPU" in dropped[("placement", "balanced")]
    assert xformers_said(dropped.get(("attention", "xformers")))
    pairs = allowed_pairs(space)
    ruled_out = {}
    for pair, config in pairs:
        complete(config)
        for k, v in config.items():
            assert CATALOGUE[k].unavailable(v, target) is None, (pair, k, v)
        why = space.forbidden(config)
        if why:
            ruled_out[key(pair)] = why
    assert len(pairs) > 200

    def out(**pair):
        return ruled_out.get(key(pair))

    assert "CUDA-graph" in out(compile="reduce-overhead", offload="model")
    assert "fullgraph" in out(compile_fullgraph=True, offload="group-leaf-stream")
    assert "bfloat16" in out(dtype="float16", quantize="float8dq")
    assert "rewrite" in out(quantize="int8dq", layerwise_casting="fp8-e4m3")
    # a half-precision-only choice meets the other knobs in half precision, not ruled out by
    # the baseline's float32 alone (else the GPU pair test would never apply it with another knob)
    flash = next(config for pair, config in pairs if pair == {"attention": "sdpa-flash", "channels_last": True})
    assert flash["dtype"] == "bfloat16" and out(attention="sdpa-flash", channels_last=True) is None
    assert "float16/bfloat16" in space.forbidden({**flash, "dtype": "float32"})
    assert out(quantize="int4wo", fuse_qkv=True) is None
    assert out(offload="model", vae_slicing=True) is None
    if family == "flux":
        assert "cache hooks" in out(compile_fullgraph=True, cache="first-block")
    print(f"{family} on cuda (9, 0): {len(pairs)} pairs, {len(ruled_out)} ruled out, {len(dropped)} dropped")
