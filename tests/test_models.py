"""The model registry: resolving names, tiny offline pipelines, local directories, random-weight builds."""

import json
import socket

import numpy as np
import pytest
import torch
import yaml
from huggingface_hub import try_to_load_from_cache

from autotune.errors import ModelError
from autotune.models import (
    ALIASES,
    MODEL_CONFIGS,
    ModelSpec,
    _empty_model,
    build_pipeline,
    check_weights_here,
    model_names,
    resolve_model,
)

TINY = ["tiny-sdxl", "tiny-sd15", "tiny-sd3", "tiny-flux"]
UNCACHED_HUB_ID = "autotune-tests/no-such-model"


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def render(pipe, height, width, steps):
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt="a red cube", height=height, width=width, num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(0), output_type="np",
    )
    return out.images


def state(pipe) -> dict:
    return {
        f"{name}.{key}": tensor
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for key, tensor in component.state_dict().items()
    }


def error_of(call) -> str:
    with pytest.raises(ModelError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


# --- tiny pipelines -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_pipeline_renders_its_default_workload_offline(name, offline):
    spec = resolve_model(name)
    assert (spec.kind, spec.source, spec.name) == ("tiny", None, name)
    pipe = build_pipeline(spec)
    assert type(pipe).__name__ == spec.pipeline_class
    modules = [m for c in pipe.components.values() if isinstance(c, torch.nn.Module) for m in c.modules()]
    assert not any(m.training for m in modules)
    w = spec.default_workload
    images = render(pipe, w.height, w.width, w.steps)
    assert images.shape == (1, w.height, w.width, 3)
    assert np.isfinite(images).all()


def test_tiny_sdxl_has_the_real_sdxl_structure():
    pipe = build_pipeline(resolve_model("tiny-sdxl"))
    assert type(pipe.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    assert pipe.unet.config.addition_embed_type == "text_time"
    assert pipe.unet.config.cross_attention_dim == (
        pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
    )
    assert pipe.vae.config.force_upcast
    assert pipe.vae_scale_factor == 8
    processors = {type(p).__name__ for p in pipe.unet.attn_processors.values()}
    assert processors == {"AttnProcessor2_0"}


def test_generated_tokenizers_stay_inside_the_encoders_vocabularies(offline):
    pipe = build_pipeline(resolve_model("tiny-sd3"))
    for suffix in ("", "_2", "_3"):
        tokenizer, encoder = getattr(pipe, f"tokenizer{suffix}"), getattr(pipe, f"text_encoder{suffix}")
        ids = tokenizer("A photograph of an astronaut, riding a horse!").input_ids
        assert len(set(ids)) > 10 and max(ids) < encoder.config.vocab_size
        assert ids[-1] == tokenizer.eos_token_id
    clip = pipe.tokenizer
    # <|endoftext|> has the highest id: CLIP configs with eos_token_id 2 pool at argmax(input_ids).
    assert (len(clip), clip.model_max_length, clip.eos_token_id) == (514, 77, 513)
    assert (pipe.tokenizer_3.pad_token_id, pipe.tokenizer_3.eos_token_id) == (0, 1)


def test_tiny_build_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    first = state(build_pipeline(resolve_model("tiny-sd3")))
    assert torch.equal(torch.random.get_rng_state(), before)
    second = state(build_pipeline(resolve_model("tiny-sd3")))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_tiny_build_in_half_precision_keeps_what_from_pretrained_keeps_in_float32():
    pipe = build_pipeline(resolve_model("tiny-flux"), dtype=torch.float16)
    assert pipe.transformer.dtype == torch.float16
    t5 = pipe.text_encoder_2
    for name, param in t5.named_parameters():
        # T5's feed-forward output projections stay float32 in float16, as from_pretrained does.
        assert param.dtype == (torch.float32 if ".wo." in name else torch.float16), name
    pipe = build_pipeline(resolve_model("tiny-flux"), dtype=torch.bfloat16)
    assert {p.dtype for p in pipe.text_encoder_2.parameters()} == {torch.bfloat16}


# --- resolving names ------------------------------------------------------------------------------


def test_aliases_resolve_case_insensitively_and_by_hub_id():
    assert {"sdxl", "sd15", "sd3", "flux-dev", "flux-schnell", *TINY} <= set(model_names())
    sdxl = resolve_model(" SDXL ")
    assert (sdxl.name, sdxl.family, sdxl.kind, sdxl.denoiser) == ("sdxl", "sdxl", "pretrained", "unet")
    assert sdxl.source == "stabilityai/stable-diffusion-xl-base-1.0"
    assert (sdxl.default_workload.height, sdxl.default_workload.steps) == (1024, 30)
    assert resolve_model("black-forest-labs/FLUX.1-schnell") == ALIASES["flux-schnell"]
    schnell = ALIASES["flux-schnell"].default_workload
    assert (schnell.steps, schnell.guidance_scale) == (4, 0.0)


def test_random_weights_resolution():
    random_sdxl = resolve_model("sdxl", random_weights=True)
    assert random_sdxl.kind == "random"
    assert random_sdxl.source == "stabilityai/stable-diffusion-xl-base-1.0"
    assert resolve_model("tiny-sd15", random_weights=True) == ALIASES["tiny-sd15"]
    message = error_of(lambda: resolve_model(UNCACHED_HUB_ID, random_weights=True))
    assert "built-in" in message and "sdxl" in message


def test_unknown_name_lists_what_would_work():
    message = error_of(lambda: resolve_model("stable-diffusion-42"))
    assert "unknown model 'stable-diffusion-42'" in message
    assert "sdxl" in message and "tiny-flux" in message and "hub id" in message


def test_uncached_hub_id_says_how_to_get_it(offline):
    message = error_of(lambda: resolve_model(UNCACHED_HUB_ID))
    assert "not in the local Hugging Face cache" in message
    assert f"hf download {UNCACHED_HUB_ID}" in message
    assert "--random-weights" in message
    uncached = {"name": UNCACHED_HUB_ID, "source": UNCACHED_HUB_ID}
    spec = ModelSpec.from_dict({**ALIASES["sdxl"].to_dict(), **uncached})
    assert "not in the local Hugging Face cache" in error_of(lambda: build_pipeline(spec))


def test_uncached_alias_fails_at_build_with_the_random_weights_hint(offline):
    sd3 = ALIASES["sd3"]
    if isinstance(try_to_load_from_cache(sd3.source, "model_index.json"), str):
        pytest.skip("sd3 is in this machine's cache")
    message = error_of(lambda: build_pipeline(sd3))
    assert f"hf download {sd3.source}" in message and "--model sd3 --random-weights" in message


def test_local_directory_errors(tmp_path):
    message = error_of(lambda: resolve_model(str(tmp_path)))
    assert "model_index.json" in message and "save_pretrained" in message
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    assert "KandinskyPipeline" in error_of(lambda: resolve_model(str(tmp_path)))
    assert "no such directory" in error_of(lambda: resolve_model(str(tmp_path / "missing")))
    # the home of no user here: pathlib's RuntimeError "Could not determine home directory"
    assert error_of(lambda: resolve_model("~nouser/x")).startswith("no such directory '~nouser/x'")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "single-file" in error_of(lambda: resolve_model(str(tmp_path / "model.safetensors")))


@pytest.mark.parametrize("model", ["model", "model/sub"])
def test_a_model_folder_without_search_permission_is_one_line(tmp_path, model):
    # is_file() (and is_dir() below it) raised PermissionError
    from helpers import run_cli_behind_a_locked_folder

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    proc = run_cli_behind_a_locked_folder(folder, "--model", model, "--list-knobs", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == f"autotune: error: cannot read '{model}' (Permission denied)\n"


@pytest.mark.parametrize("index", ["[]", '{"_class_name": ["a"]}', '{"_class_name": null}', "{}"])
def test_a_model_index_that_names_no_pipeline_class_is_one_line(tmp_path, index):
    # valid JSON of another shape: AttributeError ('list' has no get) or TypeError (unhashable list)
    (tmp_path / "model_index.json").write_text(index)
    message = error_of(lambda: resolve_model(str(tmp_path)))
    assert message == (f"cannot read {tmp_path / 'model_index.json'}: not a diffusers model index (a mapping "
                       'whose "_class_name" names the pipeline class)')


@pytest.mark.parametrize("source, message", [
    ("/nonexistent/model", "no such model folder /nonexistent/model"),
    ("./gone", "no such model folder ./gone"),
    ("../gone/model", "no such model folder ../gone/model"),
    ("models/sdxl/base", "no such model folder models/sdxl/base"),  # a path, not an org/name hub id
    ("not a repo!", "'not a repo!' is neither a model folder nor a hub id (org/name)"),
    ("~nouser/model", "no such model folder ~nouser/model"),  # a RuntimeError from expanduser
])
def test_a_source_that_is_no_folder_here_is_one_line(source, message, offline):
    # a path was handed to the hub as a repo id: "HFValidationError: Repo id must be in the form..."
    spec = ModelSpec.from_dict({**ALIASES["sd15"].to_dict(), "source": source})
    for attempt in (lambda: build_pipeline(spec), lambda: check_weights_here(spec)):
        assert error_of(attempt) == message


def test_a_source_that_is_a_file_is_no_model_folder(tmp_path, offline):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    spec = ModelSpec.from_dict({**ALIASES["sd15"].to_dict(), "source": str(tmp_path / "model.safetensors")})
    message = f"no such model folder {tmp_path / 'model.safetensors'} (a file is there)"
    assert error_of(lambda: build_pipeline(spec)) == message


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_saved_tiny_pipeline_directory_resolves_and_builds(family, tmp_path, monkeypatch, offline):
    original = build_pipeline(resolve_model(f"tiny-{family}"))
    original.save_pretrained(tmp_path / "saved")
    monkeypatch.chdir(tmp_path)
    spec = resolve_model("saved")  # relative: normalized to an absolute path
    assert (spec.family, spec.kind) == (family, "pretrained")
    assert spec.name == spec.source == str(tmp_path / "saved")
    pipe = build_pipeline(spec, dtype=torch.bfloat16)
    assert getattr(pipe, spec.denoiser).dtype == torch.bfloat16
    expected = {key: tensor.to(torch.bfloat16) for key, tensor in state(original).items()}
    loaded = state(pipe)
    assert all(torch.equal(loaded[key], tensor) for key, tensor in expected.items())
    assert np.isfinite(render(pipe, 64, 64, 2)).all()


# --- ModelSpec ------------------------------------------------------------------------------------


def test_spec_round_trips_through_json_and_yaml():
    specs = [*ALIASES.values(), resolve_model("sd3", random_weights=True)]
    for spec in specs:
        assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
        assert ModelSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec
    assert "malformed model spec" in error_of(lambda: ModelSpec.from_dict({"name": "sdxl"}))
    broken = {**ALIASES["sdxl"].to_dict(), "family": "kandinsky"}
    assert "unknown model family 'kandinsky'" in error_of(lambda: ModelSpec.from_dict(broken))


@pytest.mark.parametrize("change, message", [
    ({"default_workload": "x"}, "default_workload must be a mapping of height, width, steps"),
    ({"default_workload": {"height": 64}}, "default_workload lacks width, steps"),
    ({"family": ["sdxl"]}, "family must be text, not ['sdxl']"),
    ({"pipeline_class": "FluxPipeline"}, "family sdxl is a StableDiffusionXLPipeline with a unet, not a FluxPipeline"),
    ({"source": None}, "a pretrained model needs a source"),
])
def test_a_malformed_spec_says_what_is_wrong_in_a_users_words(change, message):
    # these were "AttributeError: 'str' object has no attribute 'items'" and the like
    text = error_of(lambda: ModelSpec.from_dict({**ALIASES["sdxl"].to_dict(), **change}))
    assert text.startswith("malformed model spec: ") and message in text and "Error" not in text
    assert error_of(lambda: ModelSpec.from_dict("sdxl")).startswith("malformed model spec: expected a mapping")


# --- full-size architectures with random weights --------------------------------------------------

CLIP_L, CLIP_BIGG, VAE, T5_XXL = 1.23e8, 6.95e8, 8.37e7, 4.76e9
PUBLISHED = [  # (shipped config, component, published parameter count)
    ("sdxl", "unet", 2.567e9), ("sdxl", "vae", VAE),
    ("sdxl", "text_encoder", CLIP_L), ("sdxl", "text_encoder_2", CLIP_BIGG),
    ("sd15", "unet", 8.595e8), ("sd15", "vae", VAE), ("sd15", "text_encoder", CLIP_L),
    ("sd3", "transformer", 2.03e9), ("sd3", "vae", VAE), ("sd3", "text_encoder", CLIP_L),
    ("sd3", "text_encoder_2", CLIP_BIGG), ("sd3", "text_encoder_3", T5_XXL),
    ("flux-dev", "transformer", 1.19e10), ("flux-dev", "vae", VAE), ("flux-dev", "text_encoder", CLIP_L),
    ("flux-dev", "text_encoder_2", T5_XXL), ("flux-schnell", "transformer", 1.19e10),
]


@pytest.mark.parametrize("alias, component, published", PUBLISHED, ids=[f"{a}-{c}" for a, c, _ in PUBLISHED])
def test_shipped_configs_have_the_published_size(alias, component, published):
    library, class_name = json.loads((MODEL_CONFIGS / alias / "model_index.json").read_text())[component]
    model = _empty_model(library, class_name, MODEL_CONFIGS / alias / component / "config.json")
    assert next(model.parameters()).is_meta
    count = sum(p.numel() for p in model.parameters())
    if class_name == "T5EncoderModel" and model.encoder.embed_tokens.weight is not model.shared.weight:
        # transformers 5 ties the encoder's embedding to `shared` only when tie_word_embeddings is set,
        # which T5 v1.1's config does not: a real load holds the embedding twice, and so does this build.
        count -= model.shared.weight.numel()
    assert count == pytest.approx(published, rel=0.01)


def test_every_shipped_alias_resolves_to_random():
    shipped = sorted(p.name for p in MODEL_CONFIGS.iterdir() if p.is_dir())
    assert shipped == ["flux-dev", "flux-schnell", "sd15", "sd3", "sdxl"]
    for alias in shipped:
        assert resolve_model(alias, random_weights=True).kind == "random"


def test_random_sd15_builds_in_bfloat16_and_renders(offline):
    pipe = build_pipeline(resolve_model("sd15", random_weights=True), dtype=torch.bfloat16)
    for component in (pipe.unet, pipe.vae, pipe.text_encoder):
        tensors = list(component.parameters())
        assert {(t.dtype, t.device.type) for t in tensors} == {(torch.bfloat16, "cpu")}
        assert not component.training
    assert sum(p.numel() for p in pipe.unet.parameters()) == 859_520_964
    positions = dict(pipe.text_encoder.named_buffers())["embeddings.position_ids"]
    assert torch.equal(positions, torch.arange(77).expand(1, -1))  # a buffer, computed for real
    norm = pipe.unet.down_blocks[0].resnets[0].norm1
    assert torch.equal(norm.weight, torch.ones_like(norm.weight)) and not norm.bias.any()
    assert pipe.unet.conv_in.weight.float().std().item() == pytest.approx(0.02, rel=0.1)
    images = render(pipe, 64, 64, 1)
    assert images.shape == (1, 64, 64, 3)
    assert np.isfinite(images).all()


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_a_tiny_pipeline_is_made_of_the_classes_component_classes_names(family):
    """Profile.apply warns where a component is of another class than component_classes says,
    which for a tiny model reads its family's full-size index: the tiny builder must match it."""
    import torch

    from autotune.models import build_pipeline, component_classes

    spec = resolve_model(f"tiny-{family}")
    pipe = build_pipeline(spec)
    expected = component_classes(spec)
    modules = {name: type(c).__name__ for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert modules and all(expected[name] == cls for name, cls in modules.items()), (modules, expected)
