"""Each knob's effect on the state of a real tiny pipeline, and that the pipeline still runs."""

import numpy as np
import pytest
import torch
from diffusers.models.attention_processor import FusedAttnProcessor2_0, SlicedAttnProcessor

from autotune.knobs import CATALOGUE, Target, apply_config, baseline
from helpers import build_tiny, generate

CPU = Target(device="cpu", family="sdxl")


def finite(images) -> bool:
    return bool(np.isfinite(images).all())


def is_torchao(tensor) -> bool:
    return type(tensor).__module__.startswith("torchao")


def quantizes_activations(weight) -> bool:
    """Whether a torchao int8 weight quantizes its layer's input to int8 at each call."""
    from torchao.quantization import Int8Tensor

    assert type(weight) is Int8Tensor, type(weight)
    return weight.act_quant_kwargs is not None


def test_baseline_is_float32_with_default_processors():
    pipe = build_tiny("sdxl", baseline())
    assert pipe.unet.dtype == torch.float32 and pipe.vae.dtype == torch.float32
    assert not any(isinstance(p, (SlicedAttnProcessor, FusedAttnProcessor2_0)) for p in pipe.unet.attn_processors.values())
    assert finite(generate(pipe, "sdxl"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_casts_every_component(dtype):
    pipe = build_tiny("sdxl", {"dtype": dtype})
    want = getattr(torch, dtype)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert getattr(pipe, name).dtype == want, name


@pytest.mark.parametrize("choice, slice_size", [("sliced", "auto"), ("sliced-max", "max")])
def test_attention_slicing_installs_sliced_processors(choice, slice_size):
    pipe = build_tiny("sdxl", {"attention": choice})
    processors = list(pipe.unet.attn_processors.values())
    assert processors and all(isinstance(p, SlicedAttnProcessor) for p in processors)
    # diffusers' set_attention_slice: "auto" halves each layer's heads (two steps), "max" runs one
    # head at a time. The tiny SDXL UNet has 12 and 24 heads, so the two differ in every layer.
    layers = [m for m in pipe.unet.modules() if hasattr(m, "sliceable_head_dim") and hasattr(m, "processor")]
    assert layers and all(m.sliceable_head_dim >= 4 for m in layers)
    want = (lambda heads: heads // 2) if slice_size == "auto" else (lambda heads: 1)
    assert [m.processor.slice_size for m in layers] == [want(m.sliceable_head_dim) for m in layers]
    assert finite(generate(pipe, "sdxl"))


def test_attention_slicing_is_unavailable_for_transformers():
    reason = CATALOGUE["attention"].unavailable("sliced", Target(device="cpu", family="flux"))
    assert reason and "no-op" in reason


def test_channels_last_reaches_unet_and_vae_convolutions():
    pipe = build_tiny("sdxl", {"channels_last": True})
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert pipe.vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert finite(generate(pipe, "sdxl"))


def test_channels_last_on_a_transformer_model_touches_the_vae():
    pipe = build_tiny("flux", {"channels_last": True})
    assert pipe.vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)


def test_fuse_qkv_fuses_unet_and_vae_attention():
    pipe = build_tiny("sdxl", {"fuse_qkv": True})
    processors = list(pipe.unet.attn_processors.values())
    assert all(isinstance(p, FusedAttnProcessor2_0) for p in processors)
    assert all(isinstance(p, FusedAttnProcessor2_0) for p in pipe.vae.attn_processors.values())
    assert finite(generate(pipe, "sdxl"))


@pytest.mark.parametrize("choice", ["sdpa", "sdpa-math"])
def test_flux_with_sdpa_is_pinned_to_native_and_leaves_the_process_default(choice, caplog):
    # diffusers' set_attention_backend also sets a process-wide default, which every processor
    # that names no backend follows: a Flux pipeline configured before or after another pipeline
    # chose a backend (a serving process with two profiles) must keep native SDPA, and the other
    # pipeline its own choice.
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    def backends(pipe):
        return {getattr(m.processor, "_attention_backend", None) for m in pipe.transformer.modules()
                if hasattr(m, "processor")}

    import logging

    diffusers_logger = logging.getLogger("diffusers")  # its own handler, no propagation: listen there
    diffusers_logger.addHandler(caplog.handler)
    try:
        before = build_tiny("flux", {"attention": choice})
        assert "experimental" not in caplog.text  # the dispatcher's notice: noise in a serving process
        other = build_tiny("flux")
        other.transformer.set_attention_backend("_native_math")  # the other pipeline's choice
        after = build_tiny("flux", {"attention": choice})
        assert backends(before) == backends(after) == {AttentionBackendName.NATIVE}
        assert _AttentionBackendRegistry._active_backend == AttentionBackendName._NATIVE_MATH  # left alone
        assert finite(generate(after, "flux"))
    finally:
        diffusers_logger.removeHandler(caplog.handler)
        _AttentionBackendRegistry._active_backend = AttentionBackendName.NATIVE


def test_pinning_a_backend_drops_diffusers_notice_and_nothing_else(caplog):
    # Another warning logged while the backend is pinned (another thread's, in a serving
    # process) still shows; only the dispatcher's "experimental" notice goes.
    import logging

    from autotune.knobs.attention import _pin_backend

    pipe = build_tiny("flux")
    logger = logging.getLogger("diffusers.models.modeling_utils")
    set_backend = pipe.transformer.set_attention_backend

    def set_backend_while_another_thread_warns(backend):
        logger.warning("a warning from another thread")
        set_backend(backend)

    pipe.transformer.set_attention_backend = set_backend_while_another_thread_warns
    diffusers_logger = logging.getLogger("diffusers")  # its own handler, no propagation: listen there
    diffusers_logger.addHandler(caplog.handler)
    try:
        _pin_backend(pipe.transformer, "native")
    finally:
        diffusers_logger.removeHandler(caplog.handler)
    assert "a warning from another thread" in caplog.text
    assert "experimental" not in caplog.text


@pytest.mark.parametrize("family", ["sdxl", "sd15", "sd3", "flux"])
def test_fuse_qkv_drops_the_separate_projections_and_changes_no_output(family):
    from autotune.knobs.layout import drop_unfused_projections

    def count(pipe):
        return sum(p.numel() for name in ("unet", "transformer", "vae") if getattr(pipe, name, None) is not None
                   for p in getattr(pipe, name).parameters())

    unfused = count(build_tiny(family))
    pipe = build_tiny(family)  # fused by diffusers alone: the separate projections kept
    if family in ("sdxl", "sd15"):
        pipe.fuse_qkv_projections()
        models = [pipe.unet, pipe.vae]
    else:
        pipe.transformer.fuse_qkv_projections()
        models = [pipe.transformer]
    fused = count(pipe)
    assert fused > unfused
    kept = generate(pipe, family)
    assert sum(drop_unfused_projections(m) for m in models) == fused - unfused
    assert count(pipe) == unfused  # the fused projections hold exactly what the separate ones did
    assert np.array_equal(generate(pipe, family), kept)  # the fused processors never called them
    knob = build_tiny(family, {"fuse_qkv": True})
    assert count(knob) == unfused and np.array_equal(generate(knob, family), kept)


def test_the_full_sdxl_unet_sheds_a_quarter_of_its_parameters_when_fused():
    # The figure in drop_unfused_projections' docstring and the README, on SDXL's shipped
    # architecture with its parameters on the meta device (no storage).
    from autotune.knobs.layout import drop_unfused_projections
    from autotune.models import MODEL_CONFIGS, _empty_model

    unet = _empty_model("diffusers", "UNet2DConditionModel", MODEL_CONFIGS / "sdxl" / "unet" / "config.json")
    unfused = sum(p.numel() for p in unet.parameters())
    unet.fuse_qkv_projections()
    assert drop_unfused_projections(unet) == 647_987_200 and unfused == 2_567_463_684
    assert sum(p.numel() for p in unet.parameters()) == unfused


def test_fuse_qkv_on_flux_fuses_the_transformer():
    pipe = build_tiny("flux", {"fuse_qkv": True})
    fused = [m for m in pipe.transformer.modules() if getattr(m, "fused_projections", False)]
    assert fused
    assert finite(generate(pipe, "flux"))


def test_vae_slicing_and_tiling_flags():
    pipe = build_tiny("sdxl", {"vae_slicing": True, "vae_tiling": True})
    assert pipe.vae.use_slicing and pipe.vae.use_tiling
    plain = build_tiny("sdxl")
    assert not plain.vae.use_slicing and not plain.vae.use_tiling


@pytest.mark.parametrize("choice", ["int8wo", "int8dq"])
def test_quantize_replaces_denoiser_linear_weights(choice):
    pipe = build_tiny("sdxl", {"quantize": choice})
    linears = [m for m in pipe.unet.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_torchao(m.weight) for m in linears)
    # torchao 0.18 stores both as an Int8Tensor: what tells them apart is whether it quantizes the
    # activations at each call (int8dq: per-row symmetric int8) or keeps them as they are (int8wo)
    assert all(quantizes_activations(m.weight) == (choice == "int8dq") for m in linears)
    assert not any(is_torchao(p) for p in pipe.vae.parameters())
    assert finite(generate(pipe, "sdxl"))


def test_every_torchao_choice_builds_its_config_here():
    # The CUDA-only choices cannot run on this CPU, but their torchao configs are built from this
    # torchao's API: a renamed or moved class fails here, not on a GPU (int4wo's packing-format
    # import did, on an H100).
    from autotune.knobs.quantize import _torchao_config

    for choice in CATALOGUE["quantize"].choices:
        if choice != "none":
            assert type(_torchao_config(choice)).__module__.startswith("torchao"), choice
    assert _torchao_config("float8dq").activation_value_lb > 0  # zero rows would quantize to NaN


def test_sdxl_float16_with_streamed_group_offload_is_forbidden_unless_its_vae_is_not_upcast():
    from autotune.knobs import complete, conflict

    streamed = complete({"dtype": "float16", "offload": "group-leaf-stream"})
    assert "host copies it made when it was set up" in conflict(streamed, "sdxl")
    assert conflict({**streamed, "offload": "group-leaf-stream-lowmem"}, "sdxl")  # the same copies, pinned later
    assert conflict({**streamed, "vae_fp16_fix": True}, "sdxl") is None  # the fp16-fix VAE is not upcast
    assert conflict(streamed, "sd15") is None and conflict({**streamed, "dtype": "bfloat16"}, "sdxl") is None


def test_cuda_graph_compile_modes_on_regional_blocks_are_forbidden():
    from autotune.knobs import conflict

    for mode in ("reduce-overhead", "max-autotune"):
        assert "pytorch#152887" in conflict({"compile": mode, "compile_regional": True}, "flux")
    assert conflict({"compile": "max-autotune-no-cudagraphs", "compile_regional": True}, "flux") is None


def test_cuda_graph_modes_never_meet_outputs_held_across_replays():
    from autotune.knobs import complete, conflict

    for mode in ("reduce-overhead", "max-autotune"):
        compiled_vae = complete({"compile": mode, "compile_vae": True})
        assert conflict(compiled_vae) is None
        assert "tiles" in conflict({**compiled_vae, "vae_tiling": True})
        assert "batch" in conflict({**compiled_vae, "vae_slicing": True})
        for cache in ("first-block", "taylorseer", "magcache"):
            assert "caches" in conflict(complete({"compile": mode, "cache": cache}), "flux")
    no_graphs = complete({"compile": "max-autotune-no-cudagraphs", "compile_vae": True, "vae_tiling": True})
    assert conflict(no_graphs) is None and conflict({**no_graphs, "cache": "first-block"}, "flux") is None


def test_compiling_under_offload_hooks_on_every_layer_is_forbidden_in_every_mode():
    from autotune.knobs import CATALOGUE, complete, conflict

    for mode in CATALOGUE["compile"].choices[1:]:
        for offload in ("sequential", "group-leaf", "group-leaf-stream", "group-leaf-stream-lowmem"):
            assert conflict(complete({"compile": mode, "offload": offload})), (mode, offload)
    assert "every matmul and convolution would run uncompiled" in conflict(
        complete({"compile": "default", "offload": "group-leaf"}))
    # hooks on whole models or groups of blocks leave the blocks' insides to the compiler
    for offload in ("model", "group-block-1", "group-block-1-stream"):
        assert conflict(complete({"compile": "default", "offload": offload})) is None, offload


def test_int4_weights_are_never_quantized_on_the_host():
    from autotune.knobs import complete, conflict

    # the reason, as this torch has it: the tile packing int4wo uses has no CPU kernel
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.aten._convert_weight_to_int4pack(torch.zeros(64, 32, dtype=torch.uint8), 2)
    int4 = complete({"dtype": "bfloat16", "quantize": "int4wo"})
    assert conflict(int4) is None
    for hosted in ({"offload": "model"}, {"offload": "group-leaf-stream"}, {"placement": "balanced"}):
        assert "_convert_weight_to_int4pack" in conflict({**int4, **hosted}), hosted
    assert conflict({**int4, "quantize": "int8wo", "offload": "model"}) is None


def test_fuse_then_quantize_in_one_config_works():
    pipe = build_tiny("sdxl", {"fuse_qkv": True, "quantize": "int8wo", "dtype": "bfloat16"})
    assert any(is_torchao(m.weight) for m in pipe.unet.modules() if isinstance(m, torch.nn.Linear))
    assert finite(generate(pipe, "sdxl"))


def test_compile_wraps_the_denoiser_in_place():
    pipe = build_tiny("sd15", {"compile": "default"})
    assert pipe.unet._compiled_call_impl is not None
    assert build_tiny("sd15").unet._compiled_call_impl is None


@pytest.mark.slow
def test_compiled_denoiser_runs_on_the_cpu(cpp_compiler):
    # A real inductor compile and call on the CPU, through the compile knob. Regional: the UNet's
    # repeated transformer block is compiled once (about 30 s cold on 2 cores, against about 60 s
    # for the whole UNet); test_catalogue.py checks what every compile choice wraps, and the GPU
    # suite runs the whole-model modes.
    pipe = build_tiny("sd15", {"compile": "default", "compile_regional": True})
    assert pipe.unet._compiled_call_impl is None
    assert any(m._compiled_call_impl is not None for m in pipe.unet.modules())
    assert finite(generate(pipe, "sd15", steps=1))


def test_offload_needs_an_accelerator():
    for choice in ("model", "sequential"):
        assert "accelerator" in CATALOGUE["offload"].unavailable(choice, CPU)
    assert CATALOGUE["offload"].unavailable("none", CPU) is None


def test_unknown_knobs_and_choices_are_rejected():
    with pytest.raises(ValueError, match="unknown knob"):
        apply_config(None, {"warp": 9}, CPU)
    with pytest.raises(ValueError, match="no choice"):
        apply_config(None, {"dtype": "float64"}, CPU)
