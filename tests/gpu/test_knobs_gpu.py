"""The CUDA-only knobs of the catalogue (#4), applied for real on a tiny pipeline, each followed by a
call. Skipped without CUDA (conftest.py); a choice this GPU cannot run (xFormers not installed,
float8 below SM 8.9, one GPU for balanced placement) skips with the catalogue's own reason.

Run on a GPU machine with `python -m pytest tests/gpu/test_knobs_gpu.py -q -rs`.
"""

import copy
import gc
import time

import numpy as np
import pytest
import torch

from autotune.console import config_changes
from autotune.knobs import CATALOGUE, Target, apply_config, build_configured, conflict
from autotune.knobs.compile import CUDA_GRAPH_MODES
from autotune.knobs.precision import DTYPES
from autotune.models import build_pipeline, resolve_model
from autotune.space import SHIPPED_DIR, SearchSpace
from autotune.workload import Workload
from test_catalogue import allowed_pairs, by_rest, compile_variant_problem, hooks_named, hooks_of, key


def target(family, steps=2):
    return Target(device="cuda", family=family, capability=torch.cuda.get_device_capability(),
                  workload=Workload(64, 64, steps))


def needs(knob, value, family="sdxl"):
    why = CATALOGUE[knob].unavailable(value, target(family))
    if why:
        pytest.skip(f"{knob}={value}: {why}")


def run(config, family="sdxl", steps=2):
    spec = resolve_model(f"tiny-{family}")
    pipe = build_configured(spec, config, target(family, steps))
    pipe.set_progress_bar_config(disable=True)
    w = spec.default_workload
    out = pipe(prompt="a cube", height=w.height, width=w.width, num_inference_steps=steps,
               generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    assert np.isfinite(out.images).all(), config
    return pipe


def test_tf32_and_cudnn_benchmark():
    run({"tf32": True, "cudnn_benchmark": True})
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.get_float32_matmul_precision() == "high"  # readable: inductor reads it
    assert torch.backends.cudnn.benchmark


def compiles(config, family, steps=2, calls=1):
    """Run the config and return its outputs, asserting dynamo compiled at least one graph
    (a wrapper alone is set by .compile() before anything runs, and proves nothing)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # nothing cached from an earlier test: what this one runs compiles here
    counters.clear()
    pipe = run(config, family, steps)
    w = resolve_model(f"tiny-{family}").default_workload
    outs = [pipe(prompt="a cube", height=w.height, width=w.width, num_inference_steps=steps,
                 generator=torch.Generator("cpu").manual_seed(0), output_type="np").images
            for _ in range(calls - 1)]
    assert counters["stats"]["unique_graphs"] > 0, config
    return pipe, outs


@pytest.mark.timeout(500)
def test_tf32_with_max_autotune_compiles_and_runs():
    # The per-backend TF32 setter made inductor's autotuning raise (pytorch#196728). Regional:
    # the transformer blocks' matmuls are what it autotunes; the whole UNet's convolutions would
    # add minutes.
    compiles({"tf32": True, "compile": "max-autotune-no-cudagraphs", "compile_regional": True}, "sd15", steps=1)


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
@pytest.mark.parametrize("kernel", ["sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math"])
def test_sdpa_kernel_holds_the_denoiser_to_one_kernel(kernel, family):
    needs("attention", kernel, family)
    pipe = run({"dtype": "bfloat16", "attention": kernel}, family)
    from torch.nn.attention import SDPBackend

    from autotune.knobs.attention import _SDPA_BACKENDS

    model = pipe.unet if family == "sdxl" else pipe.transformer
    assert model.forward.sdpa_kernel == getattr(SDPBackend, _SDPA_BACKENDS[kernel])


@pytest.mark.parametrize("family", ["sd15", "sd3", "flux"])
def test_xformers(family):
    needs("attention", "xformers", family)
    pipe = run({"dtype": "float16", "attention": "xformers"}, family)
    if family == "sd15":
        assert any("XFormers" in type(p).__name__ for p in pipe.unet.attn_processors.values())


@pytest.mark.parametrize("backend", ["flash-attn", "flash-attn-3", "sage"])
def test_flux_dispatcher_backends(backend):
    needs("attention", backend, "flux")
    pipe = run({"dtype": "bfloat16", "attention": backend}, "flux")
    pinned = {m.processor._attention_backend for m in pipe.transformer.modules()
              if hasattr(getattr(m, "processor", None), "_attention_backend")}
    assert len(pinned) == 1 and None not in pinned  # on the processors, not the process default


@pytest.mark.parametrize("kind", ["group-block-1", "group-block-2", "group-block-1-stream", "group-leaf",
                                  "group-leaf-stream", "group-leaf-stream-lowmem"])
def test_group_offload_keeps_weights_on_the_host(kind):
    pipe = run({"dtype": "bfloat16", "offload": kind})
    assert "group_offloading" in hooks_of(pipe.unet)
    # the GroupOffloadingConfig each hook was set up with
    assert {h.config.low_cpu_mem_usage for h in hooks_named(pipe.unet, "group_offloading")} == {kind.endswith("-lowmem")}
    if "stream" not in kind:  # streamed groups keep pinned host copies; the plain ones go back
        assert next(pipe.unet.parameters()).device.type == "cpu"


def test_offload_refuses_a_pipeline_already_on_the_gpu():
    spec = resolve_model("tiny-sd15")
    pipe = build_pipeline(spec, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="load it on the CPU"):
        apply_config(pipe, {"dtype": "bfloat16", "offload": "sequential"}, target("sd15"))


def test_layerwise_casting_with_group_offload():
    pipe = run({"dtype": "bfloat16", "layerwise_casting": "fp8-e4m3", "offload": "group-leaf-stream"})
    assert {"layerwise_casting", "group_offloading"} <= hooks_of(pipe.unet)


@pytest.mark.parametrize("choice", ["float8dq", "int4wo", "int8dq"])
def test_quantize_on_cuda(choice):
    needs("quantize", choice)
    pipe = run({"dtype": "bfloat16", "quantize": choice})
    assert any(type(m.weight).__module__.startswith("torchao") for m in pipe.unet.modules()
               if isinstance(m, torch.nn.Linear))


def _peak_of_build(spec, config):
    gc.collect()  # the last pipeline's blocks back to torch's cache, and the cache emptied
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pipe = build_configured(spec, config, target(spec.family))
    peak = torch.cuda.max_memory_allocated()  # exact, where reserved adds the cache's rounding
    return pipe, peak


def test_rewritten_weights_reach_the_gpu_only_rewritten():
    # SD1.5's full architecture (random weights): large enough that the weights dominate the
    # allocator's peak. Built to the GPU first and quantized there, the bfloat16 weights would set
    # the peak, and int8 could never bring a config under a budget.
    spec = resolve_model("sd15", random_weights=True)
    pipe, plain_peak = _peak_of_build(spec, {"dtype": "bfloat16"})
    int8_bytes_saved = sum(m.weight.numel() for m in pipe.unet.modules() if isinstance(m, torch.nn.Linear))
    del pipe
    pipe, int8_peak = _peak_of_build(spec, {"dtype": "bfloat16", "quantize": "int8wo"})
    assert pipe.unet.device.type == "cuda" and pipe.vae.device.type == "cuda"
    # built on the GPU first, int8's peak would be the bfloat16 one or more; quantize_'s
    # transients (one layer at a time) take part of the saving
    assert int8_peak <= plain_peak - 0.5 * int8_bytes_saved, (plain_peak, int8_peak, int8_bytes_saved)
    del pipe
    pipe, fp8_peak = _peak_of_build(spec, {"dtype": "bfloat16", "layerwise_casting": "fp8-e4m3"})
    assert fp8_peak < plain_peak - 0.5 * int8_bytes_saved, (plain_peak, fp8_peak)
    del pipe
    # fused on the host, the separate projections dropped: SD1.5's 56M parameters (112 MB) that
    # diffusers keeps for unfusing never reach the GPU
    pipe, fused_peak = _peak_of_build(spec, {"dtype": "bfloat16", "fuse_qkv": True})
    assert fused_peak <= plain_peak * 1.02, (plain_peak, fused_peak)


@pytest.mark.parametrize("choice", ["int8wo", "int8dq", "float8dq"])
def test_quantized_on_the_host_then_offloaded(choice):
    # With offload the weights are quantized on the host and the hooks move the quantized
    # tensors to the GPU for each call (int4 is ruled out: it packs on a GPU only).
    needs("quantize", choice)
    pipe = run({"dtype": "bfloat16", "quantize": choice, "offload": "model"})
    assert pipe.unet.device.type == "cpu"
    assert any(type(m.weight).__module__.startswith("torchao") for m in pipe.unet.modules()
               if isinstance(m, torch.nn.Linear))


def test_text_encoders_in_int8_on_flux():
    run({"dtype": "bfloat16", "quantize_text_encoders": "int8wo"}, "flux")


@pytest.mark.parametrize("cache", ["first-block", "taylorseer", "magcache"])
def test_flux_caches_on_cuda(cache):
    run({"dtype": "bfloat16", "cache": cache}, "flux", steps=4)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_modes_regional_and_vae(mode):
    # CUDA-graph modes compile the whole denoiser: on regional blocks they are forbidden
    # (knobs.CONFLICTS, pytorch#152887; this test hit it on an H100 before the rule). Three calls
    # of 4 steps: CUDA graphs are recorded after a warm-up call and replayed after that, and a
    # replay that overwrote an output still held would make the later calls differ.
    regional = mode not in CUDA_GRAPH_MODES
    config = {"dtype": "bfloat16", "compile": mode, "compile_regional": regional, "compile_vae": True}
    assert conflict(config, "flux") is None
    _, (second, third) = compiles(config, "flux", steps=4, calls=3)
    assert np.isfinite(third).all()
    assert np.abs(second - third).max() < 1e-2, mode  # same seed, same graphs: the same image


@pytest.mark.timeout(500)  # the guide's flags turn on coordinate-descent tuning
def test_compile_fullgraph_with_fused_qkv_and_inductor_flags():
    from torch._inductor import config

    saved = config.save_config()
    try:
        compiles({"dtype": "bfloat16", "fuse_qkv": True, "channels_last": True, "compile": "default",
                  "compile_fullgraph": True, "inductor_flags": True}, "sd15")
    finally:
        config.load_config(saved)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("quantize", ["none", "int8wo"])  # torchao's weights under freezing failed in torch 2.4-2.5
def test_compile_freezing_freezes_and_matches_the_unfrozen_output(monkeypatch, quantize):
    # freezing folds the weights into the graph: the same image, within bfloat16's rounding; and
    # inductor's freezing pass ran (the same output alone would pass with the flag ignored)
    import torch._inductor.freezing as freezing

    frozen_graphs = []
    real = freezing.freeze
    monkeypatch.setattr(freezing, "freeze", lambda *a, **k: frozen_graphs.append(1) or real(*a, **k))
    config = {"dtype": "bfloat16", "channels_last": True, "compile": "default", "quantize": quantize}
    (plain,) = compiles(config, "sd15", calls=2)[1]
    assert not frozen_graphs
    (frozen,) = compiles({**config, "compile_freezing": True}, "sd15", calls=2)[1]
    assert frozen_graphs and np.isfinite(frozen).all() and np.abs(plain - frozen).max() < 0.05


def test_balanced_placement_spreads_components():
    needs("placement", "balanced")
    pipe = run({"dtype": "bfloat16", "placement": "balanced"})
    assert len(set(pipe.hf_device_map.values())) > 1


@pytest.mark.timeout(500)  # several hundred configs; the whole GPU visit runs under 10 minutes
@pytest.mark.parametrize("family", ["sdxl", "sd15", "sd3", "flux"])
def test_every_pair_the_family_space_allows_here_applies_and_runs(family):
    """The CPU pair test's CUDA half: every pair the family's space allows on this GPU, applied to
    a copy of the tiny pipeline. As on the CPU, configs are grouped by what they set besides the
    compile knobs: each group's copy is called once (1 step), and its compile variants are applied
    to that copy afterwards (compile is last in APPLY_ORDER, so this is the same sequence) and
    checked for their wrappers, never called: test_compile_modes_regional_and_vae calls them."""
    started = time.perf_counter()
    t = target(family, steps=1)
    space = SearchSpace.from_file(SHIPPED_DIR / f"{family}.yaml").restrict(t)
    configs = {key(config): (pair, config) for pair, config in allowed_pairs(space) if not space.forbidden(config)}
    groups = by_rest(configs.values())
    spec = resolve_model(f"tiny-{family}")
    denoiser = "unet" if family in ("sdxl", "sd15") else "transformer"
    bases = {}
    failures = []  # every failing pair, named: the first one alone does not say which rule is missing
    calls = compile_checks = 0
    for rest, variants in groups.values():
        first_pair = variants[0][0]
        if rest["dtype"] not in bases:  # on the host: offload must find nothing on the GPU
            bases[rest["dtype"]] = build_pipeline(spec, dtype=DTYPES[rest["dtype"]])  # not configured yet
        pipe = copy.deepcopy(bases[rest["dtype"]])  # whole: applying for CUDA moves every component
        pipe.set_progress_bar_config(disable=True)
        try:
            apply_config(pipe, rest, t)
            out = pipe(prompt="a", height=64, width=64, num_inference_steps=1, output_type="np")
            calls += 1
            if not np.isfinite(out.images).all():
                failures.append(f"{first_pair} ({config_changes(rest)}): NaN or inf in the output")
            for pair, compile_part in variants:
                if compile_part["compile"] == "none":
                    continue
                full = {**rest, **compile_part}
                try:
                    problem = compile_variant_problem(pipe, full, t, denoiser)
                    if problem:
                        failures.append(f"{pair}: {problem}")
                    compile_checks += 1
                except Exception as exc:  # noqa: BLE001 - collected, reported below
                    failures.append(f"{pair} ({config_changes(full)}): {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:200]}")
        except Exception as exc:  # noqa: BLE001 - collected, reported below
            failures.append(f"{first_pair} ({config_changes(rest)}): {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]}")
        finally:
            del pipe
            gc.collect()  # hooks and wrappers hold reference cycles: the cache frees only after this
            torch.cuda.empty_cache()
    print(f"{family}: {len(configs)} allowed configs ({calls} called, {compile_checks} compile checks), "
          f"{time.perf_counter() - started:.1f} s")
    assert not failures, f"{len(failures)} of {len(configs)} configs failed:\n" + "\n".join(failures)
    # and something ran: every group called once, every compiled variant checked
    compiled = sum(part["compile"] != "none" for _, variants in groups.values() for _, part in variants)
    assert groups and calls == len(groups) and compile_checks == compiled, (len(groups), calls, compiled, compile_checks)
