"""Quality calibration: what each setting alone does to the fixed-seed output, against float32.

For each tiny pipeline: the reference (float32, nothing enabled) once, then one trial per
setting, each in its own child process through the real worker, with PSNR and SSIM against the
reference, and whether it passes the default --min-psnr (auto: bfloat16's own PSNR less 6 dB,
at most 40 dB), calibrated per model as a study does. Precision changes alone must pass.

    python benchmarks/quality_calibration.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from autotune import runner, worker
from autotune.knobs import baseline
from autotune.models import resolve_model
from autotune.quality import assess, auto_threshold

SETTINGS = {
    "bfloat16": {"dtype": "bfloat16"},
    "float16": {"dtype": "float16"},
    "bfloat16 + channels_last + fuse_qkv": {"dtype": "bfloat16", "channels_last": True, "fuse_qkv": True},
    "vae_tiling": {"vae_tiling": True},
    "int8 weight-only": {"quantize": "int8wo"},
    "int8 dynamic": {"quantize": "int8dq"},
    "bfloat16 + int8 dynamic": {"dtype": "bfloat16", "quantize": "int8dq"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph, whole
    parser.add_argument("--models", nargs="+", default=["tiny-sd15", "tiny-sdxl", "tiny-sd3", "tiny-flux"])
    args = parser.parse_args()
    print("| model | setting | PSNR (dB) | SSIM | passes --min-psnr auto |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            spec = resolve_model(name)
            def one_call(config, output):
                return worker.trial_request(spec, config, spec.default_workload, "cpu", output_path=output,
                                            repeats=1, max_calls=1, warmup=1, max_warmup=1)

            reference = Path(tmp) / f"{name}-reference.npy"
            result = runner.run_trial(one_call(baseline(), reference), Path(tmp) / f"{name}-ref", 900, launcher="fork")
            assert result["status"] == "ok", result
            threshold = None  # set by bfloat16, the first setting, as a study's calibration does
            for label, changes in SETTINGS.items():
                output = Path(tmp) / f"{name}-{label}.npy"
                result = runner.run_trial(one_call({**baseline(), **changes}, output), Path(tmp) / f"{name}-{label}", 900, launcher="fork")
                q = assess(result, reference) if result["status"] == "ok" else None
                if threshold is None:
                    threshold = auto_threshold(q["psnr_db"] if q and label == "bfloat16" else None)
                if q is None:
                    print(f"| {name} | {label} | {result['status']} | - | no |")
                    continue
                passes = "yes" if q["psnr_db"] >= threshold else "no"
                print(f"| {name} | {label} | {q['psnr_db']:.1f} | {q['ssim']:.3f} | {passes} ({threshold:g} dB) |",
                      flush=True)


if __name__ == "__main__":
    from _script import run  # beside this file: python puts the script's folder on the path

    run(main)
