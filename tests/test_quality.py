"""The quality guard: broken outputs fail, lossy settings need a looser tolerance, bfloat16 passes."""

import numpy as np
import optuna
import pytest
import torch
import yaml

from autotune import quality

TINY_SPACE = "knobs:\n  dtype: [float32, bfloat16]\n  vae_tiling: [false, true]\n"
FP16_SPACE = "knobs:\n  dtype: [float32, float16]\n"


def trials_by_config(tmp_path):
    url = f"sqlite:///{tmp_path / 'autotune-studies' / 'studies.db'}"
    trials = {}
    for summary in optuna.get_all_study_summaries(url):
        study = optuna.load_study(study_name=summary.study_name, storage=url)
        for t in study.trials:
            if "result" in t.user_attrs and "duplicate_of" not in t.user_attrs:
                c = t.user_attrs["config"]
                trials[(summary.study_name, c["dtype"], c["vae_tiling"])] = t.user_attrs
    return trials


def test_defects_and_metrics():
    rng = np.random.default_rng(0)
    image = rng.random((1, 32, 32, 3), dtype=np.float32)
    assert quality.defect(image) is None
    assert quality.defect(np.full_like(image, np.nan)) == "nan_output"
    assert quality.defect(np.zeros_like(image)) == "blank_output"  # the black image of an overflow
    same = quality.compare(image, image)
    assert same == {"psnr_db": quality.PSNR_CAP_DB, "ssim": 1.0}
    noisy = quality.compare(np.clip(image + rng.normal(0, 0.1, image.shape), 0, 1), image)
    assert 15 < noisy["psnr_db"] < 25 and noisy["ssim"] < 0.99
    assert quality.violation(noisy, 30.0) > 0 and quality.violation(same, 30.0) < 0
    assert quality.violation(None, 30.0) == 0 and quality.violation(noisy, None) == 0



def test_the_auto_threshold_is_bfloat16s_psnr_less_its_slack_never_above_the_ceiling():
    assert quality.auto_threshold(36.5) == 30.5  # 6 dB under what bfloat16 alone reached
    assert quality.auto_threshold(46.0) == 40.0  # at the ceiling
    # bfloat16 almost lossless here (a tiny model): a threshold past 40 dB would reject what loses little
    assert quality.auto_threshold(80.0) == quality.auto_threshold(quality.PSNR_CAP_DB) == quality.AUTO_MAX_DB == 40.0
    assert quality.auto_threshold(None) == quality.DEFAULT_MIN_PSNR_DB == 30.0  # bfloat16 could not run here


def test_an_output_of_another_shape_than_the_reference_is_refused():
    rng = np.random.default_rng(0)
    reference = rng.random((1, 32, 32, 3))
    for other in (rng.random((1, 32, 48, 3)), rng.random((1, 32, 32, 4))):
        with pytest.raises(ValueError, match=r"^output shape \(32, \d+, \d\) differs from the reference's \(32, 32, 3\)$"):
            quality.compare(other, reference)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sdxl", "sd15", "sd3", "flux"])
def test_every_precision_starts_from_the_float32_references_noise(family):
    """The starting latents are drawn in float32 for every config (workload.initial_noise), in
    the shape and layout the pipeline draws them in itself. Drawn by the pipeline in its dtype,
    torch 2.11 (the GPU image's) gave bfloat16 other noise than float32: PSNR 13-14 dB in every
    family, and the quality guard compared unrelated images. torch 2.13 draws the same values in
    both dtypes: that the pipeline is given its latents, and does not draw them, is checked too."""
    from autotune.models import build_pipeline, resolve_model
    from autotune.workload import Workload

    spec = resolve_model(f"tiny-{family}")
    workload = Workload(height=64, width=64, steps=1)
    first = {}
    for dtype in (torch.float32, torch.bfloat16):
        pipe = build_pipeline(spec).to(dtype)
        pipe.set_progress_bar_config(disable=True)
        denoiser = pipe.unet if family in ("sdxl", "sd15") else pipe.transformer
        seen = []
        denoiser.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
            (args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))).detach().clone()), with_kwargs=True)
        given = []
        prepare = pipe.prepare_latents  # the pipeline's own, called through: what it was given is noted
        pipe.prepare_latents = lambda *args, **kwargs: given.append(
            kwargs["latents"] if "latents" in kwargs else args[7]) or prepare(*args, **kwargs)
        workload.call(pipe)
        assert given[0] is not None  # drawn by the pipeline, it came in the pipeline's dtype
        ours = seen[0]
        # the pipeline's own draw, for its shape: ours must be what it takes in its place
        pipe(**workload.pipeline_kwargs(), generator=torch.Generator().manual_seed(0), output_type="np")
        assert ours.shape == seen[-1].shape and ours.dtype == seen[-1].dtype == dtype
        first[dtype] = ours
    # one noise: bfloat16's first input is float32's rounded (CFG batches it twice in UNet families)
    assert torch.equal(first[torch.bfloat16], first[torch.float32].to(torch.bfloat16))


def test_vae_tiling_is_rejected_by_default_and_accepted_when_loosened_bfloat16_passes(cli, tmp_path):
    (tmp_path / "space.yaml").write_text(TINY_SPACE)
    # The tiny model's own resolution (tiling acts above the VAE's sample size), 2 steps.
    common = ["--model", "tiny-sd3", "--space", "space.yaml", "--trials", "4", "--repeats", "1",
              "--max-calls", "2", "--steps", "2", "--vram", "4GB", "--threads", "1"]
    strict = cli(*common, "--study-name", "strict", "-o", "strict.yaml")
    assert strict.returncode == 0, strict.stderr + strict.stdout
    assert "quality guard: PSNR against the float32 reference at least" in strict.stdout
    loose = cli(*common, "--study-name", "loose", "--min-psnr", "15", "-o", "loose.yaml")
    assert loose.returncode == 0, loose.stderr + loose.stdout

    trials = trials_by_config(tmp_path)
    for study in ("strict", "loose"):
        bf16 = trials[(study, "bfloat16", False)]
        assert bf16["result"]["quality"]["psnr_db"] > 30 and bf16["violations"]["quality"] <= 0
        assert trials[(study, "float32", False)]["result"]["quality"]["psnr_db"] == quality.PSNR_CAP_DB
    tiled = trials[("strict", "float32", True)]
    assert tiled["result"]["status"] == "ok" and tiled["violations"]["quality"] > 0  # seams
    assert trials[("loose", "float32", True)]["violations"]["quality"] <= 0

    profile = yaml.safe_load((tmp_path / "strict.yaml").read_text())
    assert profile["quality_guard"]["bfloat16_psnr_db"] > profile["quality_guard"]["min_psnr_db"]
    assert not profile["best"]["config"]["vae_tiling"]
    assert all(p["quality"]["psnr_db"] >= profile["quality_guard"]["min_psnr_db"] for p in profile["pareto"])
    assert (tmp_path / profile["best"]["image"]).exists()  # the chosen point's output, as PNG
    assert "PSNR" in strict.stdout and "SSIM" in strict.stdout


@pytest.mark.slow
def test_a_float16_overflow_is_rejected(cli, tmp_path):
    # A pipeline whose VAE overflows float16 (activations past 65504 become inf, then NaN);
    # float32 normalizes them away. Built offline and saved as a local model folder.
    from autotune.models import build_pipeline, resolve_model

    pipe = build_pipeline(resolve_model("tiny-sd15"))
    with torch.no_grad():
        pipe.vae.post_quant_conv.weight.mul_(1e5)
        pipe.vae.post_quant_conv.bias.fill_(1e5)
    pipe.save_pretrained(tmp_path / "overflowing")
    (tmp_path / "space.yaml").write_text(FP16_SPACE)
    # 64x64, 2 steps: float16 runs slowly on a CPU, and the overflow happens at any size.
    proc = cli("--model", "overflowing", "--space", "space.yaml", "--trials", "2", "--repeats", "1",
               "--max-calls", "2", "--height", "64", "--width", "64", "--steps", "2",
               "--vram", "4GB", "--threads", "1", "-o", "p.yaml")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "nan_output" in proc.stdout
    profile = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert profile["best"]["config"]["dtype"] == "float32"
    assert all(p["config"]["dtype"] != "float16" for p in profile["pareto"])
