"""The profile file: atomic writes, validation with one-line errors, fingerprints, choosing."""

import copy
import io
import os
import re
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from autotune import AutotuneError, ProfileError, ProfileMismatchWarning, __version__, fingerprint, load_profile
from autotune import profile as profile_io
from autotune.knobs import APPLIED, CATALOGUE, Target, baseline
from autotune.models import resolve_model
from helpers import run_cli

GiB = 2**30


def point(trial, latency, peak, **config):
    return {"trial": trial, "config": {**baseline(), **config}, "latency_s": latency, "peak_memory_bytes": peak}


def document():
    spec = resolve_model("tiny-sd15")
    fast = point(3, 0.10, 3 * GiB, dtype="bfloat16", channels_last=True)
    small = point(5, 0.20, 1 * GiB, dtype="bfloat16", attention="sliced")
    return {
        "autotune_profile": profile_io.FORMAT_VERSION,
        "model": spec.to_dict(),
        "workload": spec.default_workload.to_dict(),
        "budget": {"memory_bytes": 4 * GiB},
        "machine": fingerprint.machine("cpu"),
        "software": fingerprint.software(),
        "best": fast,
        "baseline": point(0, 0.30, 2 * GiB),
        "pareto": [small, fast],
        "study": {"name": "s", "trials": 6, "choice": None},
    }


@pytest.fixture
def written(tmp_path) -> Path:
    return profile_io.save(document(), tmp_path / "p.yaml")


def test_save_then_load_round_trips(written):
    profile = load_profile(written)
    assert profile.data == document()
    assert profile.config["dtype"] == "bfloat16" and profile.config["channels_last"] is True
    assert not list(written.parent.glob("*.tmp"))


def test_a_failed_write_leaves_the_old_file_whole(written):
    before = written.read_text()
    bad = document() | {"best": object()}  # not representable by the safe dumper
    with pytest.raises(yaml.YAMLError):
        profile_io.save(bad, written)
    assert written.read_text() == before
    assert not list(written.parent.glob("*.tmp"))


def test_a_write_killed_before_its_rename_leaves_no_temporary_for_long(written):
    # a SIGKILL between mkstemp and the rename leaves p.yaml.XXXXXXXX.tmp; the next write of the
    # same profile removes it once no writer can still be on it, and leaves a fresh one alone
    import os
    import time

    stale, fresh = written.parent / "p.yaml.4_wlinpf.tmp", written.parent / "p.yaml.abcdefgh.tmp"
    other = written.parent / "q.yaml.4_wlinpf.tmp"  # another profile's, not this one's
    for path in (stale, fresh, other):
        path.write_text("")
    hours_ago = time.time() - 2 * profile_io.STALE_TEMPORARY_S
    for path in (stale, other):
        os.utime(path, (hours_ago, hours_ago))
    profile_io.save(document(), written)
    assert not stale.exists() and fresh.exists() and other.exists()


def test_choose_takes_the_fastest_point_that_fits(written):
    profile = load_profile(written)
    assert profile.choose()["trial"] == 3
    assert profile.choose(2 * GiB)["trial"] == 5
    with pytest.raises(ProfileError, match="smallest measured peak"):
        profile.choose(GiB // 2)


def test_choose_takes_a_size_as_the_cli_does(written):
    # "6GB" was a TypeError deep in parse_margin (can't multiply sequence by non-int)
    profile = load_profile(written)
    assert profile.choose("2GB")["trial"] == profile.choose("2048MiB")["trial"] == 5
    assert profile.choose("6GB")["trial"] == profile.choose(6 * GiB)["trial"] == 3
    assert profile.choose(2.5 * GiB)["trial"] == 5  # bytes as a float: 2.5 * 2**30
    assert profile.fits(3 * GiB, "3GB") and not profile.fits(3 * GiB, "2GB")
    with pytest.raises(ProfileError, match="no configuration in this profile fits 512.00 MiB"):
        profile.choose("512MB")
    for peak in (-1, "x", None):  # -1 fitted every budget, "x" was a TypeError
        with pytest.raises(ProfileError, match="peak_bytes must be a number of bytes, 0 or more"):
            profile.fits(peak)


@pytest.mark.parametrize("budget, message", [
    (-1, "budget_bytes must be a positive number of bytes or a size such as '6GB', not -1"),
    (0, "not 0"),
    (True, "not True"),
    (float("nan"), "not nan"),
    ("0", "budget_bytes: '0' is not a positive memory size"),
    ("-1GB", "budget_bytes: '-1GB' is not a positive memory size"),
    ("lots", "budget_bytes: 'lots' is not a memory size (examples: 8GB, 7.5GiB, 8000MiB)"),
    ("6", "budget_bytes: '6' has no unit: did you mean 6GB?"),  # as --vram reads it, not 6 bytes
    (10**400, "budget_bytes must be a positive number of bytes or a size such as '6GB', not 1000"),  # an OverflowError
    (1e308, "budget_bytes is too large for a memory size (over 2**63 - 1 bytes)"),
    ("1" + "0" * 400 + "GB", "budget_bytes: '10000000000000000000...' is too large"),
])
def test_a_budget_that_is_not_a_positive_size_is_one_line(written, budget, message):
    # -1 said "no configuration in this profile fits -1 B", as if a smaller config might
    profile = load_profile(written)
    for call in (profile.choose, lambda b: profile.load_pipeline(budget_bytes=b)):
        with pytest.raises(ProfileError) as exc:
            call(budget)
        assert message in str(exc.value) and "\n" not in str(exc.value), exc.value


def test_an_unlimited_budget_as_a_serving_script_may_pass_it_takes_the_best(written):
    # sys.maxsize, or cgroup v1's "no limit" (2**63 - 4096), read and passed on (helper-14)
    import sys

    profile = load_profile(written)
    assert profile.choose(sys.maxsize) == profile.choose(2**63 - 4096) == profile.best


def test_load_pipeline_takes_a_size(written):
    import torch
    from diffusers.models.attention_processor import SlicedAttnProcessor

    pipe = load_profile(written).load_pipeline(budget_bytes="2GB")  # trial 5: bfloat16, sliced attention
    assert pipe.unet.dtype == torch.bfloat16
    assert all(isinstance(p, SlicedAttnProcessor) for p in pipe.unet.attn_processors.values())


def test_apply_says_a_setting_held_before_the_build_now_holds_only_from_now_on(written):
    """The trial held glibc's mmap threshold before it built the pipeline, so its weights as
    loaded followed it; on a pipeline the caller loaded, that part of the measured peak is lost."""
    from autotune.models import build_pipeline

    doc = document()
    # held for real in this test process (glibc cannot give it back): 4 MiB, which changes little
    doc["best"]["config"]["quantize"] = "int8wo"
    doc["best"]["config"]["malloc_mmap_threshold"] = "4MiB"
    doc["pareto"][1] = doc["best"]
    profile = load_profile(profile_io.save(doc, written))
    with pytest.warns(UserWarning, match=r"malloc_mmap_threshold=4MiB: the trial held it before building the "
                                         r"pipeline.*may exceed the measured one: use profile.load_pipeline\(\)"):
        profile.apply(build_pipeline(resolve_model("tiny-sd15")))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*the trial held it before building")
        profile.load_pipeline()  # holds it before it builds, as the trial did


def test_a_model_folder_that_is_gone_changes_nothing_in_the_serving_process(tmp_path):
    """load_pipeline set torch's threads and glibc's mmap threshold (which nothing puts back),
    then failed to find the model (helper 66): a refused load changed the process."""
    import torch

    from autotune.errors import ModelError

    if fingerprint.usable_cores() < torch.get_num_threads() + 1:  # else the count set would be the one there
        pytest.skip("needs a core more than this process's threads, to tell a thread count that was set")
    doc = document()
    doc["model"] = {**doc["model"], "kind": "pretrained", "source": str(tmp_path / "gone")}
    doc["measurement"] = {"threads": torch.get_num_threads() + 1}
    doc["best"]["config"]["malloc_mmap_threshold"] = "1MiB"  # if set, held for the rest of this test process
    doc["pareto"][1] = doc["best"]
    threads = torch.get_num_threads()
    with pytest.raises(ModelError, match="no such model folder"):
        load_profile(profile_io.save(doc, tmp_path / "p.yaml")).load_pipeline()
    assert torch.get_num_threads() == threads


def test_a_model_folder_that_holds_another_pipeline_now_is_refused(tmp_path):
    """A SD1.5 profile whose folder was replaced by a SDXL pipeline loaded it without a word
    (helper 66): the folder's model_index.json names its class, read before loading."""
    from autotune.models import build_pipeline

    folder = tmp_path / "model"
    build_pipeline(resolve_model("tiny-sdxl")).save_pretrained(folder)
    doc = document()
    doc["model"] = {**doc["model"], "kind": "pretrained", "source": str(folder), "name": str(folder)}
    with pytest.raises(ProfileError, match=f"^{re.escape(str(folder))} holds a StableDiffusionXLPipeline now, and this "
                                           "profile was measured on a StableDiffusionPipeline: tune it again"):
        load_profile(profile_io.save(doc, tmp_path / "p.yaml")).load_pipeline()


def test_the_denoiser_is_compared_with_the_one_measured_not_with_the_files_as_they_are_now(tmp_path):
    """The architecture check read the model's files at serving time: a folder replaced since by
    another model of the same class passed, and "profiled" named today's values (helper 66). A
    profile records the denoiser's config as measured; serving compares the pipeline with it, and
    load_pipeline the files it loads."""
    from autotune.models import build_pipeline, denoiser_config

    measured = {**denoiser_config(resolve_model("tiny-sd15")), "layers_per_block": 2}
    doc = document()
    doc["denoiser_config"] = profile_io.recorded_config(measured)
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    with pytest.warns(ProfileMismatchWarning, match=r"this pipeline's UNet2DConditionModel is not tiny-sd15's "
                                                    r"\(layers_per_block 1 here, 2 profiled\)"):
        profile.apply(build_pipeline(resolve_model("tiny-sd15")))

    folder = tmp_path / "model"
    build_pipeline(resolve_model("tiny-sd15")).save_pretrained(folder)  # the folder now: 1 layer per block
    doc["model"] = {**doc["model"], "kind": "pretrained", "source": str(folder), "name": str(folder)}
    with pytest.warns(ProfileMismatchWarning, match=r"'s unet is not the one profiled \(layers_per_block 1 here, 2 "
                                                    r"profiled\): the profile's figures were measured on another model"):
        load_profile(profile_io.save(doc, tmp_path / "q.yaml")).load_pipeline()
    # as measured: nothing to say
    doc["denoiser_config"] = profile_io.recorded_config(denoiser_config(resolve_model("tiny-sd15")))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(not the one profiled|is not .*'s \\()")
        load_profile(profile_io.save(doc, tmp_path / "r.yaml")).load_pipeline()


def test_a_component_swapped_in_the_folder_since_is_said_and_a_knob_it_breaks_fails_in_one_line(tmp_path):
    """The classes checked were read from the folder's model_index.json at serving time: a tiny VAE
    put in the folder since the study passed in silence, and the profile's fused QKV then failed
    inside diffusers with a traceback (helper-12). A profile records the classes as measured."""
    from diffusers import AutoencoderTiny

    from autotune.models import build_pipeline, component_classes

    folder = tmp_path / "model"
    pipe = build_pipeline(resolve_model("tiny-sd15"))
    pipe.save_pretrained(folder)
    doc = document()
    doc["model"] = {**doc["model"], "kind": "pretrained", "source": str(folder), "name": str(folder)}
    doc["component_classes"] = component_classes(resolve_model(str(folder)))  # as build() records them
    doc["best"]["config"]["fuse_qkv"] = True
    doc["pareto"][1] = doc["best"]
    pipe.vae = AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                               num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1),
                               latent_channels=pipe.vae.config.latent_channels)
    pipe.save_pretrained(folder)  # the folder now: its index names the tiny VAE
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    with pytest.warns(ProfileMismatchWarning, match=r": its vae is AutoencoderTiny now, AutoencoderKL when profiled: "
                                                    "the profile's figures were measured with the components as profiled"), \
            pytest.raises(ProfileError, match=r"^loading the profiled pipeline failed \(ValueError: "
                                              r".fuse_qkv_projections\(\). is only supported for the VAE of type"):
        profile.load_pipeline()
    # a pipeline loaded from that folder and handed to apply: compared with the record, not the folder
    with pytest.warns(ProfileMismatchWarning, match=r"this pipeline's vae is a AutoencoderTiny, where .*'s is a "
                                                    "AutoencoderKL"), pytest.raises(ProfileError):
        profile.apply(pipe.from_pretrained(folder))
    # a record that is no mapping of names to class names is refused when read
    doc["component_classes"] = {"vae": ["diffusers", "AutoencoderKL"]}
    with pytest.raises(ProfileError, match=r"component_classes maps a component's name to its class name"):
        load_profile(profile_io.save(doc, tmp_path / "odd.yaml"))


def test_running_out_of_memory_while_loading_is_passed_through_as_raised(tmp_path, monkeypatch):
    """load_pipeline said every failure as a ProfileError: a serving process that catches
    torch.OutOfMemoryError, to load a smaller point, no longer saw one (helper-13). No memory runs
    out on purpose here: the build stands in for one that did (knobs.build_configured reads
    models.build_pipeline at each call)."""
    from autotune import models

    def build_raising(error):
        def build(*args, **kwargs):
            raise error
        return build

    profile = load_profile(profile_io.save(document(), tmp_path / "p.yaml"), check_fingerprint=False)
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError()):
        monkeypatch.setattr(models, "build_pipeline", build_raising(error))
        with pytest.raises(type(error)):
            profile.load_pipeline()
    monkeypatch.setattr(models, "build_pipeline", build_raising(KeyError("vae")))  # others: one line
    with pytest.raises(ProfileError, match=r"^loading the profiled pipeline failed \(KeyError: 'vae'\)$"):
        profile.load_pipeline()


def test_a_choice_that_runs_and_changes_nothing_here_is_served_as_written(tmp_path):
    """The search drops VAE slicing at batch size 1 (no trial spent on what changes nothing); a
    profile edited to hold it was refused as "cannot run" (helper 66), though it runs."""
    from autotune.knobs import unrunnable

    doc = document()
    doc["best"]["config"]["vae_slicing"] = True
    doc["pareto"][1] = doc["best"]
    pipe = load_profile(profile_io.save(doc, tmp_path / "p.yaml")).load_pipeline()
    assert pipe.vae.use_slicing
    # what does not run is still named
    assert unrunnable({"attention": "sdpa-efficient"}, Target(device="cpu", family="sd15")) == [
        "attention=sdpa-efficient: sdpa-efficient needs a CUDA GPU"]


def test_a_choice_that_cannot_run_here_is_named_with_its_reason_before_the_build(tmp_path, monkeypatch):
    """A profile's choices that cannot run on this machine (CUDA-only on a CPU, a package missing,
    one GPU for a balanced placement) failed inside diffusers, torchao or accelerate: a
    ZeroDivisionError for balanced placement, accelerate's TypeError for sequential offload. Now one
    ProfileError names each with the reason the search drops it for, before any weight is loaded."""
    from autotune import models
    from autotune.models import build_pipeline

    doc = document()
    doc["best"]["config"].update(offload="sequential", quantize="float8dq", tf32=True)
    doc["pareto"][1] = doc["best"]
    profile = load_profile(profile_io.save(doc, tmp_path / "gpu.yaml"))
    pipe = build_pipeline(resolve_model("tiny-sd15"))
    # The real build, noted: what is checked is that a refused profile loads no weights (with a
    # full-size model, minutes), which nothing else shows; that the spy sees the builds that do
    # happen is checked at the end (knobs.build_configured reads models.build_pipeline at each call).
    built = []
    monkeypatch.setattr(models, "build_pipeline", lambda *a, **k: built.append(a) or build_pipeline(*a, **k))
    for attempt in (profile.load_pipeline, lambda: profile.apply(pipe)):
        with pytest.raises(ProfileError) as raised:
            attempt()
        said = str(raised.value)
        assert said.startswith("this profile's configuration cannot run on cpu here (it was measured on cpu, ")
        for choice in ("offload=sequential: CPU offload needs an accelerator", "quantize=float8dq: ",
                       "tf32=True: TF32 needs a CUDA GPU"):
            assert choice in said, said
    assert not built and not hasattr(pipe, APPLIED)
    placed = copy.deepcopy(doc)  # placement excludes offload (a rule): a config of its own
    placed["best"]["config"].update(offload="none", placement="balanced")
    placed["pareto"][1] = placed["best"]
    with pytest.raises(ProfileError, match="placement=balanced: balanced placement needs more than one CUDA GPU"):
        load_profile(profile_io.save(placed, tmp_path / "placed.yaml")).load_pipeline()
    assert not built
    if not torch.cuda.is_available():  # a GPU's profile on this CPU: "pass device='cpu'" would not load it either
        doc["machine"] = {**doc["machine"], "device": "cuda"}
        gpu = load_profile(profile_io.save(doc, tmp_path / "cuda.yaml"), check_fingerprint=False)
        with pytest.raises(ProfileError, match=r"measured on cuda, and no CUDA GPU is usable here; its configuration "
                                               r"cannot run on the CPU either \(tf32=True: TF32 needs a CUDA GPU; "):
            gpu.load_pipeline()
    # the choices this machine runs load as before, and build through the spy
    doc = document()
    assert load_profile(profile_io.save(doc, tmp_path / "cpu.yaml")).apply(pipe) is pipe
    assert not built
    assert hasattr(load_profile(tmp_path / "cpu.yaml").load_pipeline(), APPLIED)
    assert len(built) == 1


def _loaded_quantized(unet, library: str):
    """`unet` saved, then loaded again quantized by `library`, as from_pretrained's
    quantization_config does it (int8 weights)."""
    import tempfile

    from diffusers import QuantoConfig, TorchAoConfig, UNet2DConditionModel
    from torchao.quantization import Int8WeightOnlyConfig

    # set_inductor_config=False: torchao's default sets process-wide inductor flags, for good
    config = (TorchAoConfig(Int8WeightOnlyConfig(set_inductor_config=False)) if library == "torchao"
              else QuantoConfig(weights_dtype="int8"))
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # diffusers 0.42 deprecates its quanto quantizer (for 1.0)
        unet.save_pretrained(folder)
        return UNet2DConditionModel.from_pretrained(folder, quantization_config=config)


@pytest.mark.parametrize("configure, said", [
    (lambda pipe: (pipe.enable_attention_slicing(), pipe.vae.enable_tiling()),
     "VAE tiling; unet attention processors (SlicedAttnProcessor)"),
    (lambda pipe: pipe.fuse_qkv_projections(), "unet fused projections; vae fused projections"),
    (lambda pipe: pipe.unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32),
     "unet hooks (layerwise_casting)"),
    (lambda pipe: pipe.unet.to(memory_format=torch.channels_last), "unet in channels_last"),
    # a part of a model (its first convolution left as it was) was taken, that part left converted
    (lambda pipe: pipe.vae.decoder.to(memory_format=torch.channels_last), "vae in channels_last"),
    (lambda pipe: (pipe.unet.compile_repeated_blocks(), pipe.vae.decoder.compile()),
     "unet blocks compiled; vae blocks compiled"),
    # a method swapped for its compiled form, as the guides compile the VAE's decode: passed as fresh
    (lambda pipe: (setattr(pipe.vae, "decode", torch.compile(pipe.vae.decode)),
                   setattr(pipe.unet, "forward", torch.compile(pipe.unet.forward))),
     "unet.forward compiled; vae.decode compiled"),
    (lambda pipe: setattr(pipe.vae.decoder, "forward", torch.compile(pipe.vae.decoder.forward)),
     "vae.decoder.forward compiled"),
    (lambda pipe: setattr(pipe, "unet", torch.compile(pipe.unet)), "unet compiled"),  # once, not its forward too
    (lambda pipe: pipe.unet.set_default_attn_processor(), "unet attention processors (AttnProcessor)"),
    (lambda pipe: setattr(pipe, "unet", _loaded_quantized(pipe.unet, "torchao")), "unet quantized when loaded (torchao)"),
    # quanto's weights are no torchao tensors: such a pipeline took the profile in silence
    (lambda pipe: setattr(pipe, "unet", _loaded_quantized(pipe.unet, "quanto")), "unet quantized when loaded (quanto)"),
    # torch's own dynamic quantization: apply failed inside its dtype cast, "partly configured"
    (lambda pipe: torch.ao.quantization.quantize_dynamic(pipe.unet, {torch.nn.Linear}, dtype=torch.qint8, inplace=True),
     "unet weights quantized (torch.ao)"),
])
def test_apply_refuses_a_pipeline_its_user_configured_before(written, configure, said):
    """Settings made on a pipeline before apply survived under the profile's (slicing for its
    SDPA, a fused QKV or fp8 hooks it did not measure): another configuration than the one whose
    figures the profile holds, in silence. A fresh pipeline is what apply takes."""
    from autotune.models import build_pipeline

    profile = load_profile(written)  # bfloat16 + channels_last
    pipe = build_pipeline(resolve_model("tiny-sd15"))
    configure(pipe)
    with pytest.raises(ProfileError, match=f"this pipeline holds settings of its own \\({re.escape(said)}\\): apply "
                                           "the profile to a freshly loaded pipeline, or use profile.load_pipeline"):
        profile.apply(pipe)


def test_apply_warns_when_the_pipelines_denoiser_is_another_models(written):
    """Only the pipeline's class was checked: an SD1.5 pipeline of another size took the profile in
    silence, beside figures measured on another model."""
    from diffusers import UNet2DConditionModel

    from autotune.models import build_pipeline

    profile = load_profile(written)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileMismatchWarning)
        profile.apply(build_pipeline(resolve_model("tiny-sd15")))  # the profiled model: no word
    other = build_pipeline(resolve_model("tiny-sd15"))
    other.unet = UNet2DConditionModel.from_config({**other.unet.config, "layers_per_block": 2})
    with pytest.warns(ProfileMismatchWarning, match=r"this pipeline's UNet2DConditionModel is not tiny-sd15's "
                                                    r"\(layers_per_block 2 here, 1 profiled\): the profile's figures were "
                                                    "measured on another model"):
        profile.apply(other)


def _profile_with(path, **config):
    doc = document()
    doc["best"]["config"].update(config)
    doc["pareto"][1] = doc["best"]
    return load_profile(profile_io.save(doc, path))


def test_a_swapped_vae_is_said_and_a_failure_part_way_is_one_line(tmp_path):
    """A tiny VAE in place of the measured one took a fused-QKV profile: diffusers' raw ValueError
    part-way, the UNet already cast and fused, and a second apply said the pipeline was configured
    (helper 66)."""
    from diffusers import AutoencoderTiny

    from autotune.models import build_pipeline

    profile = _profile_with(tmp_path / "p.yaml", fuse_qkv=True)
    pipe = build_pipeline(resolve_model("tiny-sd15"))
    pipe.vae = AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                               num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1))
    with pytest.warns(ProfileMismatchWarning, match="this pipeline's vae is a AutoencoderTiny, where tiny-sd15's is "
                                                    "a AutoencoderKL: the profile's figures were measured with that one"):
        with pytest.raises(ProfileError, match=r"^applying the profile failed \(ValueError: .*AutoencoderKL.*\); "
                                               "the pipeline is left partly configured: load it again$"):
            profile.apply(pipe)
    with pytest.raises(ProfileError, match=r"configured already \(.*fuse_qkv=True.*, stopped part-way\); apply a "
                                           r"configuration to a freshly loaded pipeline$"):
        profile.apply(pipe)
    # autotune's own error part-way (a setting this machine refuses once begun) says it too

    def refused(pipe, value, target, config):
        raise AutotuneError("channels_last=True cannot be held here")

    fresh = build_pipeline(resolve_model("tiny-sd15"))
    knob = CATALOGUE["channels_last"]
    original, knob_apply = knob, knob.apply
    object.__setattr__(knob, "apply", refused)  # the one knob stands in for a refusal glibc cannot be made to give
    try:
        with pytest.raises(ProfileError, match="cannot be held here; the pipeline is left partly configured: load it again$"):
            profile.apply(fresh)
    finally:
        object.__setattr__(original, "apply", knob_apply)


def test_what_a_user_added_is_kept_or_refused_where_the_profile_would_undo_it(tmp_path):
    """LoRA adapters, an IP-Adapter's processors and FreeU went unnoticed: fused QKV dropped a
    LoRA's q/k/v layers and fused or sliced processors replaced an IP-Adapter's, in silence
    (helper 66). A real LoRA (peft) and real IP-Adapter processors, on tiny-sd15."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0
    from peft import LoraConfig

    from autotune.models import build_pipeline

    def with_lora():
        pipe = build_pipeline(resolve_model("tiny-sd15"))
        pipe.unet.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v"]), adapter_name="style")
        return pipe

    fused, sliced = _profile_with(tmp_path / "f.yaml", fuse_qkv=True), _profile_with(tmp_path / "s.yaml", attention="sliced")
    with pytest.raises(ProfileError, match=r"holds LoRA layers on the unet q/k/v projections, which the profile's "
                                           r"fused QKV would drop: fuse the LoRA into the weights first"):
        fused.apply(with_lora())
    # a LoRA on other layers keeps them under fused QKV: taken, and said (helper 69)
    elsewhere = build_pipeline(resolve_model("tiny-sd15"))
    elsewhere.unet.add_adapter(LoraConfig(r=2, target_modules=["proj_in", "proj_out"]), adapter_name="edges")
    with pytest.warns(ProfileMismatchWarning, match=r"holds unet LoRA adapters \(edges\): the profile's figures"):
        fused.apply(elsewhere)
    with pytest.warns(ProfileMismatchWarning, match=r"holds unet LoRA adapters \(style\): the profile's figures were "
                                                    "measured without it"):
        sliced.apply(with_lora())  # slicing keeps the LoRA layers: kept, and said

    pipe = build_pipeline(resolve_model("tiny-sd15"))
    attn = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2
    attn.set_processor(IPAdapterAttnProcessor2_0(hidden_size=attn.inner_dim, cross_attention_dim=attn.cross_attention_dim))
    with pytest.raises(ProfileError, match="holds unet IP-Adapter attention processors, and the profile installs "
                                           "attention processors of its own"):
        sliced.apply(pipe)

    # xFormers keeps an IP-Adapter's processors (diffusers converts them); slicing a transformer's is a no-op
    from autotune.knobs.attention import replaces_processors
    assert not replaces_processors({"attention": "xformers"}, "sdxl")
    assert not replaces_processors({"attention": "sliced"}, "flux") and replaces_processors({"attention": "sliced"}, "sd15")

    pipe = build_pipeline(resolve_model("tiny-sd15"))
    pipe.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    with pytest.warns(ProfileMismatchWarning, match="holds unet FreeU: the profile's figures were measured without it"):
        fused.apply(pipe)


def test_a_lora_loaded_after_fused_qkv_on_the_dropped_projections_is_refused(tmp_path):
    """A LoRA loaded after a fused-QKV apply lost its self-attention q/k/v and cross-attention k/v
    layers in silence (peft skips a target it does not find): diffusers said nothing and the LoRA
    changed only the layers left. A placeholder now stands where each projection was, which peft
    refuses to wrap. A real LoRA saved by diffusers and loaded with load_lora_weights."""
    import copy
    import io

    import torch
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from autotune.models import build_pipeline

    source = build_pipeline(resolve_model("tiny-sd15"))
    source.unet.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                       init_lora_weights=False), adapter_name="style")
    StableDiffusionPipeline.save_lora_weights(tmp_path / "lora", unet_lora_layers=get_peft_model_state_dict(
        source.unet, adapter_name="style"))

    def image(pipe):
        return pipe("a", num_inference_steps=2, height=64, width=64, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = _profile_with(tmp_path / "f.yaml", fuse_qkv=True).apply(build_pipeline(resolve_model("tiny-sd15")))
    before = image(pipe)
    dropped = r"DroppedProjection\(fused into to_k?v? ?\w* and dropped by an autotune profile's fuse_qkv; a LoRA for it " \
              r"must be fused into the weights \(pipe\.fuse_lora\(\), then pipe\.unload_lora_weights\(\)\) before"
    with pytest.raises(ValueError, match=dropped):
        pipe.load_lora_weights(tmp_path / "lora")
    assert not getattr(pipe.unet, "peft_config", None)
    assert not any(hasattr(m, "lora_A") for m in pipe.unet.modules())
    assert torch.equal(image(pipe), before)  # nothing of it is left to change the images

    # a LoRA on layers the fusion kept loads as before; one on a dropped projection is refused
    pipe.unet.add_adapter(LoraConfig(r=2, target_modules=["proj_in"]), adapter_name="edges")
    assert list(pipe.unet.peft_config) == ["edges"]
    with pytest.raises(ValueError, match=dropped):
        pipe.unet.add_adapter(LoraConfig(r=2, target_modules=["to_k"]), adapter_name="keys")
    # the placeholders hold no reference that keeps a model alive, copies, or stops it pickling
    torch.save(copy.deepcopy(pipe.vae), io.BytesIO())
    # unfused, the pipeline says why it cannot run rather than calling None
    pipe.unfuse_qkv_projections()
    said = "dropped by an autotune profile's fuse_qkv: what calls it \\(unfusing, or an attention processor set after"
    with pytest.raises(RuntimeError, match=said):
        image(pipe)
    # as does one whose attention slicing, set after the profile, calls the separate projections
    # (the error named a LoRA and unfusing, neither of which had happened: helper-1)
    sliced = _profile_with(tmp_path / "f.yaml", fuse_qkv=True).apply(build_pipeline(resolve_model("tiny-sd15")))
    sliced.enable_attention_slicing()
    with pytest.raises(RuntimeError, match=said):
        image(sliced)


def test_a_pipeline_made_of_a_configured_ones_parts_is_refused(tmp_path):
    """StableDiffusionPipeline(**configured.components) had no mark of its configuration: a
    baseline profile took it, and SDPA stayed held to the first profile's kernel (helper 66)."""
    from diffusers import StableDiffusionPipeline

    configured = _profile_with(tmp_path / "m.yaml", attention="sdpa-math").load_pipeline()
    again = StableDiffusionPipeline(**configured.components)
    # the hold alone: its torch.compiler.disable wrapper is no compiled forward
    with pytest.raises(ProfileError, match=r"settings of its own \(unet in channels_last; unet held to SDPA's MATH "
                                           r"kernel \(by an autotune configuration\); vae in channels_last\): apply"):
        _profile_with(tmp_path / "b.yaml").apply(again)


def test_apply_takes_a_fresh_pipeline_of_the_profiles_class(written):
    """apply() twice met a pipeline whose q, k, v layers fused QKV had dropped (a raw
    AttributeError), and a pipeline of another class, or no pipeline, was configured silently or
    failed inside torch; each is one ProfileError now."""
    from autotune.models import build_pipeline

    doc = document()
    doc["best"]["config"]["fuse_qkv"] = True
    doc["pareto"][1] = doc["best"]
    profile = load_profile(profile_io.save(doc, written))
    pipe = profile.apply(build_pipeline(resolve_model("tiny-sd15")))
    assert pipe.unet.dtype.is_floating_point
    for configured in (pipe, profile.load_pipeline()):  # load_pipeline's pipeline is configured too
        with pytest.raises(ProfileError, match=r"this pipeline is configured already \(dtype=bfloat16, "
                                                r"fuse_qkv=True, channels_last=True\); apply a configuration "
                                                "to a freshly loaded pipeline"):
            profile.apply(configured)
    with pytest.raises(ProfileError, match="measured on a StableDiffusionPipeline; apply it to one, not to "
                                           "'StableDiffusionXLPipeline'"):
        profile.apply(build_pipeline(resolve_model("tiny-sdxl")))
    with pytest.raises(ProfileError, match="not to 'str'"):
        profile.apply("x")
    with pytest.raises(ProfileError, match="device 'tpu': expected cpu, cuda or cuda:N"):  # was torch's RuntimeError
        profile.load_pipeline(device="tpu")
    # a torch.device was refused, and 0, torch's cuda:0, was taken for no device (the profile's)
    assert profile.load_pipeline(device=torch.device("cpu")).device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError, match=r"device='cuda:0' was asked for \(the profile was measured on cpu\)"):
            profile.load_pipeline(device=0)
    if not torch.cuda.is_available():  # a CPU profile, the GPU asked by the caller: said so, not "measured on cuda"
        with pytest.raises(ProfileError, match=r"device='cuda' was asked for \(the profile was measured on cpu\), "
                                               "but no CUDA GPU is usable here; leave device out"):
            profile.load_pipeline(device="cuda")


def test_a_gpu_index_beyond_the_gpus_here_is_refused_before_loading(tmp_path, monkeypatch):
    # `autotune verify --device cuda:3` refused it; load_pipeline went on to torch's "invalid
    # device ordinal" after the pipeline was built. The driver is faked: no NVIDIA GPU exists here.
    from autotune import fingerprint

    monkeypatch.setattr(fingerprint, "cuda_available", lambda: True)
    monkeypatch.setattr(fingerprint, "cuda_device_count", lambda: 1)
    profile = load_profile(profile_io.save(document(), tmp_path / "p.yaml"))
    with pytest.raises(ProfileError, match=r"device 'cuda:3': no such GPU \(GPUs usable here: 1\)"):
        profile.load_pipeline(device="cuda:3")


def test_choose_keeps_the_studys_pick_where_it_fits(tmp_path):
    """A study may keep a simpler config over a front point with a lower median its trials did not
    back (study.choose_best): a budget the pick fits gets the pick, not that point."""
    doc = document()
    doc["best"] = point(0, 0.12, 3 * GiB)  # the default, kept over trial 3's 0.10 s median
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.choose()["trial"] == 0
    assert profile.choose(8 * GiB)["trial"] == 0
    assert profile.choose(2 * GiB)["trial"] == 5  # the pick does not fit: the fastest point that does


def test_a_smaller_budget_keeps_the_simpler_point_its_trials_do_not_set_apart(tmp_path):
    """Below the pick, the front points that fit are chosen by the study's own rule: trial 7's
    median (0.18 s) is lower than trial 5's (0.19 s), but its slowest trial (0.21 s) is slower
    than trial 5's median; trial 5 changes fewer knobs, so it is kept. Unconfirmed, the fastest
    point stands on its one measurement."""
    doc = document()
    simple = point(5, 0.19, 1 * GiB, dtype="bfloat16") | {"latencies_s": [0.19, 0.18, 0.20]}
    busier = point(7, 0.18, int(1.5 * GiB), dtype="bfloat16", attention="sliced", vae_tiling=True) \
        | {"latencies_s": [0.17, 0.18, 0.21]}
    doc["pareto"] = [simple, busier, doc["best"]]
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.choose(2 * GiB)["trial"] == 5
    assert profile.choose(int(1.2 * GiB))["trial"] == 5  # trial 7 does not fit: trial 5 alone

    busier["latencies_s"] = [0.17, 0.18, 0.185]  # faster in every trial than trial 5's median
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.choose(2 * GiB)["trial"] == 7

    busier["latencies_s"] = None  # one measurement: the fastest, as without confirmation
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.choose(2 * GiB)["trial"] == 7


def test_choose_keeps_the_safety_margin_free(tmp_path):
    doc = document()
    doc["budget"]["margin"] = "10%"
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    # 3 GiB fits 3.2 GiB, but not with 10% of it (0.32 GiB) kept free.
    assert profile.choose(int(3.2 * GiB))["trial"] == 5
    assert profile.choose(int(3.4 * GiB))["trial"] == 3


def edit(path, change):
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_an_empty_profile_path_is_named_so():
    with pytest.raises(ProfileError, match="^profile path is empty: give the file autotune wrote$"):
        load_profile("")
    # pathlib's "ValueError: embedded null byte" (helper 66)
    with pytest.raises(ProfileError, match=r"^profile '/tmp/no\\x00pe.yaml': a path cannot hold a NUL byte$"):
        load_profile("/tmp/no\x00pe.yaml")


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda p: p.unlink(), "no such file"),
        (lambda p: p.write_text(""), "empty"),
        (lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]), "truncated"),
        (lambda p: p.write_text("best: [1, 2\n"), "not valid YAML"),
        (lambda p: p.write_text("autotune_profile: 1\nmodel: " + "[" * 100000), "not valid YAML (nested too deeply)"),
        (lambda p: p.write_text("just: a mapping\n"), "not an autotune profile"),
        (lambda p: p.write_text(p.read_text().replace("autotune_profile: 1", "autotune_profile: 2")), "format version 2"),
        (lambda p: p.write_text(p.read_text().replace("channels_last: true", "warp_drive: true", 1)), "unknown knob"),
        # a knob an autotune newer than this one added: said so (helper 66)
        (lambda p: edit(p, lambda d: (d["software"].update(autotune="99.0"), d["best"]["config"].update(warp_drive=True))),
         f"best.config: unknown knob(s): 'warp_drive' (written by autotune 99.0, newer than this {__version__}: upgrade autotune"),
        (lambda p: p.write_text("autotune_profile: !!python/object/apply:os.getpid []\n"),
         "uses the tag !!python/object/apply:os.getpid at line 1, which safe loading refuses"),
        # a key YAML reads as a number: a TypeError from the message's join, where it was said
        (lambda p: p.write_text(p.read_text().replace("channels_last: true", "1: true", 1)), "unknown knob(s): 1"),
        (lambda p: edit(p, lambda d: d["budget"].update(margin="99GB")),
         "budget.margin 99GB leaves nothing of the budget (4.00 GiB)"),
        # a budget edited below the best's peak: it loaded, and choose() gave the best for it (helper-10)
        (lambda p: edit(p, lambda d: d["budget"].update(memory_bytes=512 * 2**20)),
         "best peaks at 3.00 GiB, over the budget of 512.00 MiB less its margin of 0 B: autotune writes only points that fit"),
        # a tiny model is built from its family alone: another name loaded tiny-sd15 in silence
        (lambda p: edit(p, lambda d: d["model"].update(name="tiny-nonexistent")),
         "a tiny model of family sd15 is named tiny-sd15, not 'tiny-nonexistent'"),
    ],
)
def test_bad_profiles_give_one_clear_line(written, mangle, message):
    mangle(written)
    with pytest.raises(ProfileError) as exc:
        load_profile(written)
    text = str(exc.value)
    assert message in text or (message == "truncated" and ("truncated" in text or "not valid YAML" in text))
    assert "\n" not in text


def test_a_different_library_version_warns(tmp_path):
    doc = copy.deepcopy(document())
    doc["software"]["diffusers"] = "0.0.1"
    path = profile_io.save(doc, tmp_path / "old.yaml")
    with pytest.warns(ProfileMismatchWarning, match="diffusers"):
        load_profile(path)


def test_a_saved_profile_has_no_yaml_aliases(written):
    # safe_dump wrote "&id001" and "*id001" for an object the document holds twice (build()
    # shares a config between the best and its front point; document() shares the whole point)
    doc = document()
    assert doc["best"] is doc["pareto"][1]
    text = written.read_text()
    assert "&id" not in text and "*id" not in text
    assert text.count("trial: 3") == 2  # written out in both places
    assert load_profile(written).data == doc


@pytest.mark.parametrize("old, new, message", [
    # valid YAML whose value the constructor cannot convert: its ValueError was a traceback in
    # every reader (show, verify, report, load_profile, --warm-start, --space)
    ("name: s\n", "name: 2026-02-30\n",
     "not valid YAML at line 150 ('2026-02-30' cannot be read as !!timestamp: day is out of range for month)"),
    ("trials: 6\n", "trials: !!int abc\n", "not valid YAML at line 151 ('abc' cannot be read as !!int)"),
    ("trials: 6\n", "trials: !!float abc\n", "not valid YAML at line 151 ('abc' cannot be read as !!float)"),
    ("trials: 6\n", "trials: !!bool abc\n", "not valid YAML at line 151 ('abc' cannot be read as !!bool)"),  # a KeyError
    ("trials: 6\n", f"trials: {'1' * 5000}\n",
     f"not valid YAML at line 151 ('{'1' * 36}...' cannot be read as !!int: 5000 digits, over the 4300 Python reads)"),
    # a collection its tag cannot take: a TypeError from the constructor's unpacking
    ("trials: 6\n", "trials: !!map [1]\n", "not valid YAML (cannot unpack non-iterable ScalarNode object)"),
])
def test_a_value_yaml_cannot_convert_is_one_line(written, old, new, message):
    text = written.read_text()
    assert text.splitlines()[149:151] == ["  name: s", "  trials: 6"]
    written.write_text(text.replace(old, new))
    with pytest.raises(ProfileError) as exc:
        load_profile(written)
    assert str(exc.value) == f"profile {written}: {message} (corrupt or truncated?)"
    assert "set_int_max_str_digits" not in str(exc.value)


def test_a_value_yaml_cannot_convert_is_one_line_from_the_cli(written):
    written.write_text(written.read_text().replace("name: s\n", "name: 2026-02-30\n"))
    proc = run_cli("show", written.name, cwd=written.parent)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"autotune: error: profile {written.name}: not valid YAML at line 150 ")
    assert len(proc.stderr.strip().splitlines()) == 1


LAUGHS = "".join(f"x{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else 'lol'] * 10)}]\n" for i in range(9))


@pytest.mark.parametrize("change, message", [
    # nine nested aliases in 1.3 KB: a billion strings when `show` printed the choice (memory
    # exhausted), or when load_profile compared a machine name
    (lambda text: LAUGHS + text.replace("choice: null", "choice: *a8"),
     'with the alias *a4 at line 6, aliases repeat over 1,000,000 values and characters (a "billion laughs"?): '
     "write the values out"),
    # a cycle: it loaded, and apply() raised "Circular reference detected"
    (lambda text: "denoiser_config: &d {in_channels: 4, self: *d}\n" + text,
     "the alias *d at line 1 is inside the value it names: a cycle, which no reader can follow"),
])
def test_yaml_aliases_that_expand_far_or_make_a_cycle_are_refused(written, change, message):
    written.write_text(change(written.read_text()))
    with pytest.raises(ProfileError) as exc:
        load_profile(written)
    assert str(exc.value) == f"profile {written}: {message}"


def test_yaml_aliases_that_repeat_little_are_read(tmp_path):
    # yaml.safe_dump writes one for an object a document holds twice: a profile a script wrote
    doc = document()
    text = yaml.safe_dump(doc, sort_keys=False)
    assert "&id001" in text and "*id001" in text
    (tmp_path / "p.yaml").write_text(text)
    assert load_profile(tmp_path / "p.yaml").data == doc
    # the loader is the search spaces' too
    from autotune.errors import SpaceError, read_yaml

    space = tmp_path / "space.yaml"
    space.write_text("dtype: &d [float32, bfloat16]\nchannels_last: *d\n")
    assert read_yaml(space, "search space", SpaceError) == {"dtype": ["float32", "bfloat16"]} | {
        "channels_last": ["float32", "bfloat16"]}
    space.write_text(LAUGHS)
    with pytest.raises(SpaceError, match=r"^search space .*space.yaml: with the alias \*a4 at line 6, aliases repeat"):
        read_yaml(space, "search space", SpaceError)


def test_repr_is_one_short_line(written):
    # the dataclass repr printed the whole document
    assert repr(load_profile(written)) == f"<Profile tiny-sd15, budget 4.00 GiB, cpu, best 0.100 s, {written}>"
    assert repr(profile_io.Profile({})) == "<Profile ?, budget ?, ?, best ?, no file>"


def test_sizes_in_a_mismatch_warning_are_human(tmp_path):
    # "memory_bytes: profiled on 25276510208, ..."
    here = fingerprint.machine("cpu")["memory_bytes"]
    doc = document()
    doc["machine"]["memory_bytes"] = here + 3 * GiB
    path = profile_io.save(doc, tmp_path / "p.yaml")
    with pytest.warns(ProfileMismatchWarning) as caught:
        load_profile(path)
    (line,) = [str(w.message) for w in caught if "memory_bytes" in str(w.message)]
    from autotune.sizes import format_size

    assert line == (f"profile {path}: memory_bytes: profiled on {format_size(here + 3 * GiB)}, "
                    f"here {format_size(here)}")
    assert "GiB" in line and str(here) not in line
    # a size the other side rounds to the same text keeps its bytes, or the line would say nothing
    assert fingerprint.differences({"memory_bytes": 25276510208}, {"memory_bytes": 25276510000},
                                   ["memory_bytes"]) == [
        "memory_bytes: profiled on 23.54 GiB (25276510208 bytes), here 23.54 GiB (25276510000 bytes)"]


def test_a_best_config_that_does_not_name_every_knob_warns(tmp_path):
    """A knob missing from best.config is taken at its default, silently before: right for a
    profile written before the knob was added, not for one whose dtype was deleted by hand, whose
    figures stood beside a float32 pipeline with no word."""
    doc = document()
    for knob in ("dtype", "channels_last"):
        del doc["best"]["config"][knob]
    path = profile_io.save(doc, tmp_path / "edited.yaml")
    with pytest.warns(ProfileMismatchWarning) as caught:
        profile = load_profile(path)
    (line,) = [str(w.message) for w in caught if "best.config" in str(w.message)]
    assert "taken at their defaults: dtype=float32, channels_last=False" in line
    assert profile.config["dtype"] == "float32"


def test_the_same_machine_does_not_warn(written):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileMismatchWarning)
        load_profile(written)


def test_a_cuda_profile_on_a_machine_without_cuda_says_so(tmp_path):
    if fingerprint.cuda_available():
        pytest.skip("this machine has a GPU")
    doc = document()
    doc["machine"] = {**doc["machine"], "device": "cuda", "name": "NVIDIA H100", "memory_bytes": 25276510208}
    path = profile_io.save(doc, tmp_path / "gpu.yaml")
    with pytest.warns(ProfileMismatchWarning) as caught:
        profile = load_profile(path)
    said = [str(w.message) for w in caught]
    assert f"profile {path}: memory_bytes: profiled on 23.54 GiB, unknown here" in said
    assert f"profile {path}: name: profiled on 'NVIDIA H100', unknown here" in said  # not "here None"
    with pytest.raises(ProfileError, match="device='cpu'"):
        profile.load_pipeline()


def test_gpu_numbering_follows_cuda_visible_devices(monkeypatch):
    # torch numbers the visible GPUs from 0; NVML numbers every GPU on the machine
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert fingerprint.visible_gpus() is None and fingerprint._nvml_id("cuda:1") == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert fingerprint.visible_gpus() == ["2", "3"]
    assert fingerprint._nvml_id("cuda") == 2 and fingerprint._nvml_id("cuda:1") == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a1f,MIG-77c2")  # named by UUID: NVML finds them so
    assert fingerprint._nvml_id("cuda:1") == "MIG-77c2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert fingerprint.visible_gpus() == []  # no GPU visible at all


def test_a_serving_process_that_started_cuda_in_its_own_order_is_asked_for_the_gpus_uuid(monkeypatch):
    # CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID (as trials run); NVML
    # by PCI bus: on a machine of mixed GPUs, cuda:1 there and NVML's 1 were different GPUs
    # (helper-22). There is no CUDA here: torch's answers stand in for a driver's.
    import torch

    class Properties:
        uuid = "8a1f0c2e-0000-1111-2222-333344445555"

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or Properties())
    assert fingerprint._nvml_id("cuda:1") == 1  # CUDA not started: no CUDA context made here
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert fingerprint._nvml_id("cuda:1") == Properties.uuid and asked == [1]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # NVML's order: its index
    assert fingerprint._nvml_id("cuda:1") == 1 and asked == [1]


# ---- writing: the mode, and one-line errors ------------------------------------------------------
@pytest.fixture
def umask():
    """Set the process umask for one test, and put the old one back."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_a_new_profile_gets_the_mode_open_would_give(tmp_path, umask, mask, mode):
    # mkstemp made every profile 0600: a serving process running as another user could not read it
    umask(mask)
    path = profile_io.save(document(), tmp_path / "p.yaml")
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_an_overwritten_profile_keeps_its_mode(written, umask):
    umask(0o077)
    written.chmod(0o640)
    profile_io.save(document(), written)
    assert stat.S_IMODE(written.stat().st_mode) == 0o640


def unwritable_paths(tmp_path):
    (tmp_path / "a-file").write_text("x")
    os.mkfifo(tmp_path / "a-fifo")  # as /dev/null is a device: renamed over, it became a plain file
    (tmp_path / "to-fifo").symlink_to("a-fifo")  # as /dev/stdout is a link to a pipe
    return [
        (tmp_path, "is a folder"),  # -o /tmp
        (tmp_path / "a-fifo", "is not a regular file (a device, FIFO or socket)"),
        (tmp_path / "to-fifo", "is not a regular file (a device, FIFO or socket)"),
        (tmp_path / "a-file" / "p.yaml", "a file is in the way"),  # a parent that is a file
        (tmp_path / "a-file" / "sub" / "p.yaml", "Not a directory"),
        (Path("/proc/autotune-test.yaml"), "cannot write in /proc"),  # a folder nothing can be made in
    ]


def test_a_profile_that_cannot_be_written_is_one_line(tmp_path):
    for path, reason in unwritable_paths(tmp_path):
        with pytest.raises(ProfileError) as exc:
            profile_io.save(document(), path)
        text = str(exc.value)
        assert str(path) in text and reason in text and "\n" not in text, text
        with pytest.raises(ProfileError) as exc:
            profile_io.check_writable(path)
        assert str(exc.value) == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-fifo", "a-file", "to-fifo"]  # no temporary file left
    assert not (tmp_path / "a-fifo").is_file() and (tmp_path / "to-fifo").is_symlink()  # as they were


# A disk that fills during the write, for real: the child's file size limit (RLIMIT_FSIZE) set
# under the profile's size, with SIGXFSZ ignored so that the write fails with EFBIG instead of
# the kernel killing the process. A child: the limit holds for every file this process writes.
_WRITE_PAST_THE_SIZE_LIMIT = """
import os, resource, signal, sys
import yaml
from autotune import ProfileError
from autotune import profile

path = sys.argv[1]
with open(path + ".new") as f:
    doc = yaml.safe_load(f)
os.remove(path + ".new")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    profile.save(doc, path)
except ProfileError as exc:
    print(exc)
"""


def test_a_profile_cut_short_by_a_full_disk_is_one_line_and_leaves_the_old_one(tmp_path):
    path = tmp_path / "p.yaml"
    profile_io.save(document(), path.with_name("p.yaml.new"))
    assert path.with_name("p.yaml.new").stat().st_size > 2048  # well past the 1 KiB limit
    path.write_text("the profile as it was\n")
    out = subprocess.run([sys.executable, "-c", _WRITE_PAST_THE_SIZE_LIMIT, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == f"profile {path}: cannot write it (File too large)\n"
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]  # no temporary file left
    assert path.read_text() == "the profile as it was\n"


def test_a_profile_written_through_a_symlink_keeps_the_link(tmp_path):
    # a deployment's "current" link to a versioned profile: the atomic rename replaced the link
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "p.yaml").write_text("old")
    (tmp_path / "current.yaml").symlink_to(Path("v1") / "p.yaml")
    assert profile_io.save(document(), tmp_path / "current.yaml") == tmp_path / "current.yaml"  # named as given
    assert (tmp_path / "current.yaml").is_symlink()
    assert load_profile(tmp_path / "v1" / "p.yaml").data["best"] == document()["best"]


def test_check_writable_makes_the_folders_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "new" / "deeper" / "p.yaml"
    assert profile_io.check_writable(path) == path
    assert path.parent.is_dir() and not list(path.parent.iterdir())
    profile_io.save(document(), path)
    assert profile_io.check_writable(path) == path and path.exists()  # overwriting is writing


# ---- reading: wrong types are one line too -------------------------------------------------------
def _set(section, key=None, value=None):
    def mangle(doc):
        if key is None:
            doc[section] = value
        else:
            doc[section][key] = value
    return mangle


@pytest.mark.parametrize(
    "mangle, message",
    [
        (_set("machine", value="cpu"), "section 'machine' must be a mapping"),
        (_set("machine", value={}), "machine.device"),
        (_set("machine", "device", 3), "machine.device"),
        (_set("machine", "device", "tpu"), "machine.device must name a device (cpu, cuda, cuda:N), not 'tpu'"),
        (_set("best", "latency_s", -0.03), "best.latency_s must be a positive number"),
        (_set("best", "peak_memory_bytes", -5), "best.peak_memory_bytes must be a positive number"),
        (_set("software", value=[]), "section 'software' must be a mapping"),
        (_set("model", value="tiny-sd15"), "section 'model' must be a mapping"),
        (_set("model", value={"name": "x"}), "section 'model' is malformed"),
        (_set("workload", value=[64, 64]), "section 'workload' must be a mapping"),
        (_set("budget", value="4GB"), "section 'budget' must be a mapping"),
        (_set("budget", "memory_bytes", "4GB"), "budget.memory_bytes"),
        (_set("measurement", value="x"), "section 'measurement' must be a mapping or null"),
        (_set("study", value="x"), "section 'study' must be a mapping, not 'x'"),
        (_set("study", value=None), "section 'study' is empty (null; truncated file?)"),
        (_set("study", value={"name": "s", "trials": 6}), "study.choice is missing, the last key autotune writes"),
        (_set("quality_guard", value=[1]), "section 'quality_guard' must be a mapping or null"),
        (_set("baseline", value="x"), "section 'baseline' must be a mapping or null"),
        (_set("baseline", "latency_s", None), "baseline.latency_s must be a positive number"),
        (_set("best", "latency_s", "fast"), "best.latency_s must be a positive number"),
        (_set("best", "latency_s", True), "best.latency_s must be a positive number"),
        (_set("best", "latency_s", float("nan")), "best.latency_s must be a positive number"),
        (_set("best", "peak_memory_bytes", None), "best.peak_memory_bytes must be a positive number"),
        (_set("best", "p90_s", "slow"), "best.p90_s must be a number or null"),
        (_set("best", "latencies_s", 0.1), "best.latencies_s must be a list of numbers or null"),
        (_set("best", "latencies_s", []), "best.latencies_s must be a list of numbers or null"),
        (_set("best", "latencies_s", [0.1, "x"]), "best.latencies_s must be a list of numbers or null"),
        (_set("best", "config", ["dtype"]), "best.config must be a mapping"),
        (_set("best", "config", {"channels_last": 1}), "best.config: knob 'channels_last' has no choice 1"),
        (_set("best", value=[1]), "best must be a mapping"),
        (_set("pareto", value=[]), "'pareto' must be a non-empty list"),
        (_set("pareto", value={"a": 1}), "'pareto' must be a non-empty list"),
        (_set("pareto", value=["x"]), "pareto[0] must be a mapping"),
        (_set("autotune_profile", value=True), "format version True"),
        (_set("autotune_profile", value=1.0), "format version 1.0"),
        (_set("autotune_profile", value="1"), "format version '1'"),
        # what `autotune verify` replays with: a wrong type was a TypeError inside worker.trial_request
        (_set("measurement", value={"timed_calls_max": "x"}),
         "measurement.timed_calls_max must be a whole number, 1 or more, or null, not 'x'"),
        (_set("measurement", value={"threads": "many"}), "measurement.threads must be a whole number"),
        (_set("measurement", value={"timed_calls_min": 0}), "measurement.timed_calls_min must be a whole number"),
        (_set("measurement", value={"spread_limit": "5%"}), "measurement.spread_limit must be a positive fraction"),
        # the workload: a replay failed late, in string formatting, a division, a reshape
        (_set("workload", "height", "abc"), "workload.height must be a positive multiple of 8 pixels, not 'abc'"),
        (_set("workload", "width", 100), "workload.width must be a positive multiple of 8 pixels, not 100"),
        (_set("workload", "height", 8 * 10**400), "workload.height must be 16384 pixels at most, not 80000"),
        (_set("workload", "steps", 0), "workload.steps must be a whole number, 1 or more, not 0"),
        (_set("workload", "batch_size", 0), "workload.batch_size must be a whole number, 1 or more, not 0"),
        (_set("workload", "seed", 2**64), "workload.seed must be a whole number from -2**63 to 2**64 - 1"),
        (_set("workload", "seed", True), "workload.seed must be a whole number"),
        (_set("workload", "prompt", ["a", "b"]), "workload.prompt must be text"),
        # in user terms, not a Python exception's
        (_set("workload", value={}), "workload lacks height, width, steps"),
        (_set("model", "default_workload", "x"), "section 'model' is malformed: default_workload must be a mapping"),
        (_set("model", "family", "dalle"),
         "section 'model' is malformed: unknown model family 'dalle': use one of sdxl, sd15, sd3, flux"),
        (_set("model", "kind", "pretrained"), "a pretrained model needs a source"),
        (_set("budget", "margin", "lots"), "budget.margin: 'lots' is not a margin"),
        (_set("budget", "margin_bytes", "lots"), "budget.margin_bytes must be a number or null"),
        # a report read them as text: AttributeError tracebacks
        (_set("study", "name", 5), "study.name must be text or null, not 5"),
        (_set("study", "storage", 5), "study.storage must be text or null, not 5"),
        (_set("budget", "memory_bytes", 0), "budget.memory_bytes must be a positive number of bytes"),
    ],
)
def test_wrong_types_give_one_clear_line(tmp_path, mangle, message):
    doc = document()
    mangle(doc)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    assert message in str(exc.value) and str(path) in str(exc.value) and "\n" not in str(exc.value)
    assert "Error" not in str(exc.value) and "__" not in str(exc.value)  # no Python internals


@pytest.mark.parametrize("seed", [-(2**63), 2**64 - 1, -(2**63) - 1, 2**64])
def test_a_workload_seed_is_one_manual_seed_takes(tmp_path, seed):
    import torch

    doc = document()
    doc["workload"]["seed"] = seed
    path = profile_io.save(doc, tmp_path / "p.yaml")
    try:
        torch.Generator("cpu").manual_seed(seed)
    except (ValueError, RuntimeError):
        with pytest.raises(ProfileError, match="workload.seed must be"):
            load_profile(path)
    else:
        assert load_profile(path).workload.seed == seed


def test_a_workload_takes_its_familys_pixel_multiple(tmp_path):
    # SD3 and Flux take multiples of 16, as the CLI's --height and --width checks say
    doc = document()
    doc["model"] = resolve_model("tiny-sd3").to_dict()
    doc["workload"]["height"] = 264
    path = profile_io.save(doc, tmp_path / "p.yaml")
    with pytest.raises(ProfileError, match="workload.height must be a positive multiple of 16 pixels, not 264"):
        load_profile(path)


def test_a_package_not_installed_here_is_said_so(tmp_path):
    # a profile from a GPU read where xformers is absent compared its version with None: "here None"
    if fingerprint.software().get("xformers"):
        pytest.skip("xformers is installed here")
    doc = document()
    doc["software"]["xformers"] = "0.0.30"
    path = profile_io.save(doc, tmp_path / "p.yaml")
    with pytest.warns(ProfileMismatchWarning) as caught:
        load_profile(path)
    lines = [str(w.message) for w in caught if w.category is ProfileMismatchWarning]
    assert lines == [f"profile {path}: xformers: profiled on '0.0.30', not installed here"]


@pytest.mark.parametrize("recorded, said", [
    ("0.1.0", "profiled on '0.1.0'"),
    (None, "not recorded when profiled"),  # written before autotune recorded its version: not "not installed"
])
def test_a_profile_written_by_another_autotune_says_so(tmp_path, recorded, said):
    # a knob's apply may have changed since (how an SDPA kernel is held under compile did): the
    # version that wrote it was recorded and never compared (helper-12)
    doc = document()
    doc["software"].pop("autotune")
    if recorded:
        doc["software"]["autotune"] = recorded
    path = profile_io.save(doc, tmp_path / "p.yaml")
    with pytest.warns(ProfileMismatchWarning) as caught:
        load_profile(path)
    lines = [str(w.message) for w in caught if w.category is ProfileMismatchWarning]
    assert lines == [f"profile {path}: autotune: {said}, here {__version__!r}"]


@pytest.mark.parametrize("section, key, value, message", [
    ("measurement", "timed_calls_max", "x", "measurement.timed_calls_max must be a whole number"),
    ("workload", "steps", 0, "workload.steps must be a whole number, 1 or more, not 0"),
])
def test_verify_of_a_bad_profile_is_one_line(tmp_path, section, key, value, message):
    # verify replayed these, and died with a traceback or a division by zero in the replay
    doc = document()
    doc.setdefault(section, {})[key] = value
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    proc = run_cli("verify", "bad.yaml", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"autotune: error: profile bad.yaml: {message}")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_profile_that_is_not_utf8_is_one_line(written):
    written.write_bytes(written.read_bytes() + "# café\n".encode("latin-1"))
    with pytest.raises(ProfileError, match="not UTF-8 text"):
        load_profile(written)


def show(profile) -> str:
    from rich.console import Console

    from autotune import console

    out = Console(markup=False, file=io.StringIO(), width=200)
    console.print_profile(out, profile)
    return out.file.getvalue()


def test_optional_sections_may_be_null(tmp_path):
    doc = document()
    del doc["workload"]["batch_size"]  # has a default
    doc.update(baseline=None, quality_guard=None, measurement=None)
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.threads is None and "batch 1" in show(profile)
    assert profile.measured_with() == {}  # verify replays with trial_request's defaults
    assert "  study: s: 6 trials measured\n" in show(profile)  # no storage nor infeasible count: left out, not "None"


def test_verify_replays_with_what_the_profile_recorded_of_its_measurement(tmp_path):
    # verify took only the cap and spread, and 3 timed calls where the study timed 5
    from autotune import worker

    doc = document()
    doc["measurement"] = {"threads": 2, "warmup_calls_min": 2, "timed_calls_min": 5, "timed_calls_max": None,
                          "spread_limit": 0.1}
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.measured_with() == {"warmup": 2, "repeats": 5, "spread_limit": 0.1}
    request = worker.trial_request(profile.model, profile.config, profile.workload, "cpu", **profile.measured_with())
    assert (request["warmup"], request["repeats"], request["max_calls"]) == (2, 5, 10)


def test_show_lists_the_best_in_the_front_table_even_when_it_was_kept_within_noise(tmp_path, written):
    # kept over a faster config for changing fewer knobs, the best was named above a table without it
    assert re.search(r"│ 3 \(best\) +│ 0\.100 s", show(load_profile(written)))  # on the front: marked there
    doc = document()
    doc["best"] = point(4, 0.11, 2 * GiB, dtype="bfloat16")
    doc["study"]["choice"] = "kept trial 4 (1 knob changed) over trial 3 (2 knobs changed): within noise"
    text = show(load_profile(profile_io.save(doc, tmp_path / "kept.yaml")))
    assert "feasible Pareto front, and the best (kept within noise, not on it)" in text
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert rows == ["5", "4 (best)", "3"]  # by peak memory


def test_show_finds_the_best_on_the_front_when_a_default_knob_was_deleted_from_it_by_hand(tmp_path):
    # the best was listed twice, once "kept within noise, not on it", as its config no longer
    # matched its front point's to the letter
    doc = document()
    del doc["best"]["config"]["attention"]  # at its default: the same config
    text = show(load_profile(profile_io.save(doc, tmp_path / "edited.yaml")))
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert rows == ["5", "3 (best)"] and "not on it" not in text
    doc["best"] = {k: v for k, v in doc["best"].items() if k != "trial"}  # its trial number removed too (helper-16: listed twice)
    text = show(load_profile(profile_io.save(doc, tmp_path / "edited.yaml")))
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert rows == ["5", "3 (best)"] and "not on it" not in text


def test_a_profile_cut_short_at_any_line_is_refused(tmp_path):
    """A copy that broke off: 5000 of 6641 bytes loaded, with one of two front points and `study`
    null, and `show` printed "study: None in None". Every cut before the last line is refused."""
    lines = profile_io.save(document(), tmp_path / "whole.yaml").read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.yaml"
    for end in range(1, len(lines)):
        cut.write_text("".join(lines[:end]))
        with pytest.raises(ProfileError, match="truncated|missing|must be"):
            load_profile(cut)


def test_show_of_a_bad_profile_is_one_line(tmp_path):
    doc = document()
    doc["best"]["latency_s"] = "fast"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    proc = run_cli("show", "bad.yaml", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "autotune: error: profile bad.yaml: best.latency_s must be a positive number, not 'fast'"


def test_names_in_brackets_are_shown_as_they_are(tmp_path):
    """rich read "[/x]" in a path or a name as a closing tag: `show` of a file in a folder named
    "[" ended in a MarkupError traceback, and "[red]" vanished from what it printed."""
    doc = document()
    doc["machine"]["name"] = "[/bold] box :cross_mark:"  # an emoji code is text too
    doc["study"]["name"] = "[red]s"
    (tmp_path / "[").mkdir()
    (tmp_path / "[" / "x].yaml").write_text(yaml.safe_dump(doc))
    proc = run_cli("show", "[/x].yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "profile [/x].yaml" in proc.stdout and "study: [red]s" in proc.stdout
    assert "[/bold] box :cross_mark:" in proc.stdout + proc.stderr  # the machine, named where it differs


def test_show_prints_no_terminal_escapes_from_a_profile(tmp_path):
    # rich passes ESC through: a machine name retitled the terminal, a choice cleared it
    doc = document()
    doc["machine"]["name"] = "AMD \x1b[31mRED\x1b]0;pwned\a\x1b[0m"
    doc["study"].update(choice="\x1b[2J\x1b[Hcleared", name="s\x9b31m", storage="line\nbreak")
    text = show(load_profile(profile_io.save(doc, tmp_path / "p.yaml"), check_fingerprint=False))
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text)  # no control character but the lines' ends
    assert r"machine: AMD \x1b[31mRED\x1b]0;pwned\x07\x1b[0m (cpu)" in text
    assert "  choice: \\x1b[2J\\x1b[Hcleared\n" in text and r"  study: s\x9b31m in line\nbreak:" in text


def test_a_failed_replay_shows_no_replayed_figures(written):
    """A replay whose model did not load still reported where it stopped (429 MiB), and verify's
    table set it beside the recorded peak as a ratio of 0.877, which reads as a saving."""
    from rich.console import Console

    from autotune import console

    out = Console(markup=False, file=io.StringIO(), width=200)
    failed = {"status": "error", "error": "load: no such model folder", "peak_memory_bytes": 429 * 2**20}
    console.print_verification(out, load_profile(written), failed, fits=None)
    rows = [line for line in out.file.getvalue().splitlines() if "peak memory" in line]
    assert rows and "429" not in rows[0] and rows[0].count("-") >= 2, rows


def test_a_replay_timed_beside_other_work_says_so(written):
    # a replay at 12x the recorded latency, with other processes on its cores, said nothing of them
    from rich.console import Console

    from autotune import console

    replayed = {"status": "ok", "latency_s": 1.2, "peak_memory_bytes": 3 * GiB}
    for taken, warned in ((0.8, True), (0.1, False)):
        out = Console(markup=False, file=io.StringIO(), width=200)
        console.print_verification(out, load_profile(written), {**replayed, "cores_taken_by_others": taken}, fits=True)
        said = "warning: replayed (timed while other processes took 0.8 of its CPU cores)" in out.file.getvalue()
        assert said == warned
    # the title says how the replay ran, not "(ok)" over figures 12x the recorded; ratios read as ratios
    text = out.file.getvalue()
    assert "in a fresh process" in " ".join(text.split()) and "(ok)" not in text, text
    assert re.search(r"latency \(median\) .* \d+\.\d{3}x", text), text


def test_the_readmes_serving_code_runs(written):
    """The README's serving snippet, as a user pastes it (on a tiny profile): it once applied a
    profile to the pipeline load_pipeline had configured, which raises."""
    from autotune.models import build_pipeline

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("In serving code:\n```python\n", 1)[1].split("```", 1)[0]
    assert '"tiny-sdxl-2GB.yaml"' in block  # the quick start's profile
    namespace = {}
    exec(block.replace('"tiny-sdxl-2GB.yaml"', repr(str(written))), namespace)  # noqa: S102 - the README's own code
    assert namespace["pipe"].unet.dtype == torch.bfloat16
    assert len(namespace["images"]) == 1  # called as measured: the profile's size, steps and batch
    commented = [line.lstrip("# ") for line in block.splitlines() if line.startswith("# pipe = ")]
    assert len(commented) == 1
    exec(commented[0], {**namespace, "my_pipeline": build_pipeline(resolve_model("tiny-sd15"))})  # noqa: S102


def test_on_a_cpu_the_profile_holds_the_thread_count_it_was_measured_with(tmp_path):
    # load_pipeline left torch's default (2 here) where the trials had run with 1: part of what
    # was measured, and inductor's CPU kernels keep the count they were compiled with
    before = torch.get_num_threads()
    doc = document()
    doc["measurement"] = {"threads": 1}
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"), check_fingerprint=False)
    try:
        torch.set_num_threads(2)
        profile.load_pipeline()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        profile.apply(build_tiny_unconfigured())
        assert torch.get_num_threads() == 1
        doc["measurement"] = {"threads": 10_000}  # more than this machine has: capped, said
        many = load_profile(profile_io.save(doc, tmp_path / "many.yaml"), check_fingerprint=False)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            many.load_pipeline()
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        said = [str(w.message) for w in said]
        assert any("measured with 10000 CPU threads" in line for line in said)
        # process-wide: the pipeline configured with 1 before now runs with as many (helper-13)
        assert any(line.startswith("torch's CPU thread count: a pipeline configured earlier in this process")
                   for line in said) == (len(os.sched_getaffinity(0)) > 1)
        # a GPU's trials set the count too (worker.run sets the request's threads on any device):
        # served on a GPU, so is it here (it was left at torch's default; helper-12). No GPU here:
        # the step after the build is called with the target load_pipeline would make for one.
        doc["machine"] = {**doc["machine"], "device": "cuda:0"}
        doc["measurement"] = {"threads": 1}
        gpu = load_profile(profile_io.save(doc, tmp_path / "gpu.yaml"), check_fingerprint=False)
        torch.set_num_threads(2)
        gpu._set_measured_threads(Target(device="cpu", family="sd15"))  # another kind of device: left
        assert torch.get_num_threads() == 2
        gpu._set_measured_threads(Target(device="cuda:0", family="sd15"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_serving_process_whose_own_torch_flags_a_false_choice_keeps_is_told(tmp_path):
    # tf32=False and cudnn_benchmark=False keep what the serving process set before (not to
    # override its owner); the trials ran with torch's defaults, and that was said nowhere (helper-12)
    from autotune.knobs.base import ProcessSettings

    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
    profile = load_profile(profile_io.save(document(), tmp_path / "p.yaml"), check_fingerprint=False)
    try:
        with warnings.catch_warnings():  # torch's defaults, as the trials had them: nothing to say
            warnings.filterwarnings("error", message=".*when autotune first configured")
            profile.apply(build_tiny_unconfigured())
        ProcessSettings.forget()  # another serving process, which sets its own first
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.benchmark = True
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            profile.apply(build_tiny_unconfigured())
            profile.load_pipeline()
        said = [w for w in said if "when autotune first configured" in str(w.message)]
        # each names the serving code's line, however deep in autotune it was found (a fixed
        # stacklevel named this file from apply and a line of autotune from load_pipeline)
        assert [w.filename for w in said] == [__file__, __file__]
        said = [str(w.message) for w in said][:1]
        # cuDNN's benchmark is no CPU pipeline's: not said of a CPU profile
        assert said == [
            "the float32 matmul precision was 'medium' in this process when autotune first configured a pipeline in it, "
            "and tf32: false keeps that; its trials ran with torch's default 'highest', so this pipeline may run faster "
            "or slower and compute slightly otherwise than measured (torch.set_float32_matmul_precision('highest') "
            "before the first profile is applied, to serve what was measured)"]
        # on a GPU it is (no GPU here: the knob applied with the target a GPU's profile makes)
        with pytest.warns(UserWarning, match=r"^torch.backends.cudnn.benchmark was True in this process when autotune "
                                             r"first configured a pipeline in it, and cudnn_benchmark: false keeps that"):
            CATALOGUE["cudnn_benchmark"].apply(None, False, Target(device="cuda:0", family="sd15"), {})
        assert torch.get_float32_matmul_precision() == "medium"  # kept, as before
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.benchmark = saved[1]


def test_applying_a_profile_to_a_pipeline_loaded_in_another_dtype_says_the_load_differed(written, tmp_path):
    # cast to the profile's dtype, the state is the trial's; the load held float32 weights first
    from autotune.models import build_pipeline

    profile = load_profile(written)  # bfloat16
    with pytest.warns(UserWarning, match="denoiser was loaded in float32 and cast to bfloat16: its load may have "
                                         "held more memory than the trial's; the trial loaded it in bfloat16, as "
                                         r"from_pretrained\(..., torch_dtype=torch.bfloat16\) does"):
        profile.apply(build_tiny_unconfigured())
    # loaded narrower than measured: the cast back does not restore the weights (the message's
    # "which loaded it" referred to nothing on this branch: helper-10)
    wide = _profile_with(tmp_path / "f32.yaml", dtype="float32")
    with pytest.warns(UserWarning, match="loaded in bfloat16 and cast to float32: what its weights lost in the "
                                         "narrower dtype is not restored by the cast; the trial loaded it in float32"):
        wide.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("ignore", profile_io.ProfileMismatchWarning)
        profile.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))


def test_two_profiles_in_one_process_that_set_a_process_wide_setting_otherwise_are_said(tmp_path, cpp_compiler, inductor_config):
    """Inductor's flags and freezing, TF32 and cuDNN's benchmark are process-wide: a second
    profile's apply set them for the first's pipeline too, in silence (helper 66)."""
    from autotune.models import build_pipeline

    first, second = (_profile_with(tmp_path / f"{n}.yaml", compile="default", inductor_flags=flags)
                     for n, flags in (("a", True), ("b", False)))
    said = ".*configured earlier in this process"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=said)
        first.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))
        first.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))  # the same settings: no word
    with pytest.warns(UserWarning, match="inductor's flags: a pipeline configured earlier in this process was measured "
                                         "with another setting; it is process-wide"):
        second.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))


def test_a_first_profile_at_the_defaults_is_said_too_when_a_second_sets_freezing(tmp_path, cpp_compiler, inductor_config):
    """Left at their defaults in an untouched process, freezing and the flags returned before
    being recorded: a second profile that set them warned of nothing (helper 69)."""
    from autotune.models import build_pipeline

    plain = _profile_with(tmp_path / "a.yaml", compile="default")
    frozen = _profile_with(tmp_path / "b.yaml", compile="default", compile_freezing=True)
    plain.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="inductor's freezing: a pipeline configured earlier in this process"):
        frozen.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))


def test_an_uncompiled_profile_leaves_inductors_settings_to_a_compiled_one_beside_it(tmp_path, cpp_compiler,
                                                                                     inductor_config):
    """An uncompiled profile applied after a compiled one set inductor's flags and freezing back:
    the compiled pipeline, compiling at its first call, compiled without what it was measured
    with. In the other order it warned of a conflict that changes nothing (helper-13)."""
    from autotune.models import build_pipeline

    compiled = _profile_with(tmp_path / "a.yaml", compile="default", inductor_flags=True, compile_freezing=True)
    plain = load_profile(profile_io.save(document(), tmp_path / "b.yaml"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*configured earlier in this process")
        plain.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))
        compiled.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))
        plain.apply(build_pipeline(resolve_model("tiny-sd15"), dtype=torch.bfloat16))
    assert inductor_config.freezing is True and inductor_config.coordinate_descent_tuning is True


def test_a_combination_a_rule_forbids_reads_but_is_not_built(written):
    """Edited into fuse_qkv + attention slicing (or measured before a rule was made), a profile's
    replay failed with "'NoneType' object is not callable". It still reads (show, report and
    --warm-start take it), and building it names the rule."""
    edit(written, lambda d: d["best"]["config"].update(fuse_qkv=True, attention="sliced"))
    profile = load_profile(written)
    for attempt in (profile.load_pipeline, lambda: profile.apply(build_tiny_unconfigured())):
        with pytest.raises(ProfileError, match=r"a combination autotune rules out \(attention slicing replaces "
                                               r"the fused attention processors, undoing fuse_qkv\); tune again"):
            attempt()
    assert profile.choose("2GB")["trial"] == 5  # the front's other point builds


def build_tiny_unconfigured():
    from autotune.models import build_pipeline

    return build_pipeline(resolve_model("tiny-sd15"))


def test_nvml_finds_a_gpu_by_its_uuid_as_torch_nvml_or_cuda_write_it():
    """torch prints a UUID bare, NVML wants it prefixed (GPU-, or MIG- for a MIG instance), and
    CUDA_VISIBLE_DEVICES takes a prefix of it (a raw NVMLError traceback before). No NVIDIA
    driver here: NVML is a stand-in."""
    class NotFound(Exception):
        pass

    class Nvml:
        NVMLError = NotFound
        uuids = ["GPU-1111aaaa-0000", "GPU-8932f937-1234", "MIG-77c2-5678"]

        def nvmlDeviceGetHandleByUUID(self, uuid):
            if uuid not in self.uuids:
                raise NotFound("Not Found")
            return self.uuids.index(uuid)

        def nvmlDeviceGetCount(self):
            return 2  # a MIG instance is no device of its own in the count

        def nvmlDeviceGetHandleByIndex(self, index):
            return index

        def nvmlDeviceGetUUID(self, handle):
            return self.uuids[handle].encode()

    assert fingerprint.nvml_handle(Nvml(), "GPU-8932f937-1234") == 1
    assert fingerprint.nvml_handle(Nvml(), "8932f937-1234") == 1  # as torch prints it
    assert fingerprint.nvml_handle(Nvml(), "77c2-5678") == 2  # a MIG instance
    assert fingerprint.nvml_handle(Nvml(), "GPU-8932f937") == 1  # a prefix, as CUDA takes it
    with pytest.raises(AutotuneError, match="the NVIDIA driver lists no GPU GPU-ffff"):
        fingerprint.nvml_handle(Nvml(), "GPU-ffff")


@pytest.mark.parametrize("where, value, message", [
    (("budget", "memory_bytes"), 1e308, "budget.memory_bytes is too large for a memory size"),  # an OverflowError
    # past any float: OverflowErrors in math.isfinite (show, report, load_profile) and in the
    # mismatch line's format_size
    (("workload", "guidance_scale"), 10**400, "workload.guidance_scale must be a number or null, not 1000"),
    (("machine", "memory_bytes"), 10**400,
     "machine.memory_bytes must be a positive number of bytes (2**63 - 1 at most) or null, not 1000"),
    (("machine", "memory_bytes"), "16GB", "machine.memory_bytes must be a positive number of bytes"),
    (("best", "trial"), [1], "best.trial must be a trial number (0 or more) or null, not [1]"),  # the report's TypeError
    (("baseline", "trial"), {"a": 1}, "baseline.trial must be a trial number"),
    (("best", "trial"), True, "best.trial must be a trial number"),
    # helper-16: the report's TypeError on an image; "many trials measured", "-1.00x the baseline"
    (("best", "image"), ["a"], "best.image must be a file name or null, not ['a']"),
    (("baseline", "image"), 5, "baseline.image must be a file name or null, not 5"),
    (("best", "quality"), "good", "best.quality must be a mapping (psnr_db, ...) or null, not 'good'"),
    (("best", "speedup_vs_baseline"), -1, "best.speedup_vs_baseline must not be below 0, not -1"),
    (("study", "trials"), "many", "study.trials must be a count (0 or more) or null, not 'many'"),
    (("study", "infeasible"), -3, "study.infeasible must be a count"),
    # one of the two edited (a margin removed reads as 0 beside the 102 MiB the run wrote)
    (("budget", "margin_bytes"), 107374182, "budget.margin_bytes 107374182 is not the margin 0 of the budget (0 bytes)"),
])
def test_a_field_no_autotune_writes_so_is_refused_when_read(tmp_path, where, value, message):
    doc = document()
    doc[where[0]][where[1]] = value
    with pytest.raises(ProfileError, match=re.escape(message)):
        load_profile(profile_io.save(doc, tmp_path / "p.yaml"))


@pytest.mark.parametrize("path", [None, 123, b"p.yaml"])
def test_a_profile_path_that_is_no_path_is_a_profile_error(path):
    # load_profile(os.environ.get("PROFILE")) with the variable unset was a TypeError from pathlib
    with pytest.raises(ProfileError, match="profile path must be a path"):
        load_profile(path)


def test_show_to_a_full_disk_is_one_line(written):
    # `autotune show p.yaml > /dev/full` ended in rich's OSError traceback (helper-11)
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "autotune", "show", str(written)], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr == "autotune: error: cannot write the output: No space left on device\n"


def test_a_profile_of_a_gpu_index_this_machine_lacks_reads_with_a_warning(tmp_path, monkeypatch):
    """Measured on cuda:1 and read where one GPU is visible, load_profile raised NVML's error for
    the index (helper-13). No NVIDIA driver here: torch's CUDA build and NVML are stand-ins, one
    GPU, whose handle exists for index 0 alone."""
    import sys
    import types

    def handle(index):
        if index != 0:
            raise RuntimeError("NVMLError_InvalidArgument")
        return index

    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=handle,
                                 nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0), nvmlDeviceGetName=lambda h: "GPU",
                                 nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * GiB),
                                 nvmlSystemGetDriverVersion=lambda: "570")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    doc = document()
    doc["machine"] = {**doc["machine"], "device": "cuda:1", "name": "GPU"}
    with pytest.warns(profile_io.ProfileMismatchWarning, match=r"here 'no cuda:1 \(1 GPU visible\)'"):
        profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.data["machine"]["device"] == "cuda:1"
