"""The quality guard: a trial's fixed-seed output against the study's reference output.

The reference is generated once per study with the configuration that loses nothing (float32,
nothing enabled). Every trial generates with the same seed and prompt; its first output is
- a hard failure when it holds NaN/inf or is blank (every pixel the same: the black image of an
  fp16 overflow in the VAE),
- otherwise compared with the reference: PSNR (dB) and SSIM (scikit-image), in the parent
  process (the worker saves its output; comparing there would add to its measured memory).
The study turns `min_psnr_db` into a constraint the sampler sees, beside the memory budget.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .worker import BLANK_OUTPUT, NAN_OUTPUT, OK

# The "auto" threshold: the PSNR bfloat16 alone reaches against the float32 reference, less this
# slack (6 dB: four times its squared error), and never above AUTO_MAX_DB. On the tiny pipelines
# (benchmarks/quality_calibration.py) precision changes alone stay within 3 dB of bfloat16 or
# above it; VAE tiling's seams fall 8-27 dB below it.
AUTO_SLACK_DB = 6.0
AUTO_MAX_DB = 40.0
DEFAULT_MIN_PSNR_DB = 30.0  # when bfloat16 cannot run to calibrate against
PSNR_CAP_DB = 100.0  # identical outputs: infinite PSNR, capped so that it stays a number
# bfloat16 alone scores 39.5-46.8 dB on the tiny pipelines: below this, the "auto" guard
# calibrated on it lets through most changes, and the run says so (study._say_if_weak)
WEAK_BFLOAT16_DB = 30.0
BLANK_STD = 1e-3  # an image whose pixels vary less than this (on a 0..1 scale) is blank
# How a study's trials draw their starting noise, recorded with its guard: "float32" for every
# config since 2026-11-29 (workload.initial_noise); before, each config drew it in its own dtype.
NOISE = "float32"


def precision_changes_the_draw() -> bool:
    """Whether this torch's CPU generator draws other values in bfloat16 or float16 than in
    float32 rounded (torch 2.11 does, 2.13 does not): a guard of a study measured before NOISE,
    with this torch, compared half-precision configs with an image of other noise."""
    import torch

    drawn = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        generator = torch.Generator("cpu").manual_seed(0)
        drawn[dtype] = torch.randn(64, generator=generator, dtype=dtype)  # past 16 values, where they part
    return any(not torch.equal(drawn[torch.float32].to(d), drawn[d]) for d in (torch.bfloat16, torch.float16))


def auto_threshold(bfloat16_psnr_db: float | None) -> float:
    """--min-psnr auto: from what bfloat16 alone scored (None: it did not run here)."""
    if bfloat16_psnr_db is None:
        return DEFAULT_MIN_PSNR_DB
    return round(min(bfloat16_psnr_db - AUTO_SLACK_DB, AUTO_MAX_DB), 2)


def defect(images: np.ndarray) -> str | None:
    """Why an output is unusable (its trial status: worker.NAN_OUTPUT or BLANK_OUTPUT), or None."""
    if not np.isfinite(images).all():
        return NAN_OUTPUT
    if any(float(image.std()) < BLANK_STD for image in images):
        return BLANK_OUTPUT
    return None


def compare(images: np.ndarray, reference: np.ndarray) -> dict:
    """PSNR and SSIM of the first image against the reference's first image (values in 0..1)."""
    from skimage.metrics import structural_similarity

    a = np.clip(images[0].astype(np.float64), 0, 1)
    b = np.clip(reference[0].astype(np.float64), 0, 1)
    if a.shape != b.shape:
        raise ValueError(f"output shape {a.shape} differs from the reference's {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    psnr = PSNR_CAP_DB if mse == 0 else min(PSNR_CAP_DB, 10 * np.log10(1.0 / mse))
    ssim = structural_similarity(a, b, channel_axis=-1, data_range=1.0)
    return {"psnr_db": round(float(psnr), 3), "ssim": round(float(ssim), 5)}


def save_png(images: np.ndarray, path: Path) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = (np.nan_to_num(np.clip(images[0], 0, 1)) * 255).round().astype(np.uint8)
    # atomically, as save_output: a trial killed while writing left a PNG cut short
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    Image.fromarray(pixels).save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def save_output(images: np.ndarray, path: Path) -> None:
    """Atomically, as float32 .npy (two workers of one study may write the reference at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, images.astype(np.float32))
    os.replace(tmp, path)


def readable(path: Path) -> bool:
    """Whether `path` holds a whole saved output: its header parses and its data is all there
    (mapped, not read). A file cut short (a full disk, a copy stopped) is not."""
    try:
        np.load(path, mmap_mode="r")
        return True
    except (OSError, ValueError, EOFError):
        return False


def assess(result: dict, reference: Path) -> dict | None:
    """PSNR/SSIM of a trial's saved output against the reference, or None when either is missing."""
    output = result.get("output")
    if result.get("status") != OK or not output or not Path(output).exists() or not reference.exists():
        return None
    return compare(np.load(output), np.load(reference))


def violation(quality: dict | None, min_psnr_db: float | None) -> float:
    """Relative shortfall of PSNR under the threshold (> 0: rejected); 0 without a threshold."""
    if not min_psnr_db or not quality or quality.get("psnr_db") is None:
        return 0.0
    return (min_psnr_db - quality["psnr_db"]) / min_psnr_db
