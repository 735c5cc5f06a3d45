"""GPU memory as the driver sees it, beside what torch's allocator reports, against a budget (#3).

Each configuration is measured in its own child process by autotune's trial harness
(runner.run_trial, the request a study's trial gets): NVML's used memory of the trial process,
polled through load, warm-up and timed calls, beside torch's peak reserved and allocated bytes and
the host's peak resident memory. The table says for each one whether it fits the budget with
autotune's default margin, and the headroom left.

    python benchmarks/gpu_memory.py                      # SDXL, random weights, 1024x1024, 30 steps, 12GB
    python benchmarks/gpu_memory.py --steps 4 --out /tmp  # peaks do not depend on the step count

Needs a CUDA GPU (the driver-level figure is what it is for); exits with one line without one.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

GiB = 2**30

# Points a user at a 12 GB budget chooses between: everything on the GPU in float32 (the default),
# in bfloat16, bfloat16 with fused QKV (fused on the host, the separate projections dropped: a
# quarter of SDXL's UNet that diffusers keeps for unfusing), bfloat16 with the UNet's linear layers
# in int8 (built on the host and quantized on the way to the GPU, so the bfloat16 weights never
# occupy it), and bfloat16 with model offload and a tiled VAE decode.
CONFIGS = {
    "float32 (default)": {},
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16 + fused QKV": {"dtype": "bfloat16", "fuse_qkv": True},
    "bfloat16 + int8 weight-only UNet": {"dtype": "bfloat16", "quantize": "int8wo"},
    "bfloat16 + model offload + VAE tiling": {"dtype": "bfloat16", "offload": "model", "vae_tiling": True},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph, whole
    p.add_argument("--model", default="sdxl")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--budget", default="12GB")
    p.add_argument("--out", type=Path, default=Path("benchmark-results"),
                   help="folder for the results (default ./benchmark-results; the committed ones, in "
                        "benchmarks/results, hold notes a run would replace: give it only to refresh them)")
    p.add_argument("--trial-timeout", type=float, default=900)
    args = p.parse_args(argv)

    import torch

    from autotune import fingerprint, runner, worker
    from autotune.cli import measurement_defaults
    from autotune.knobs import baseline
    from autotune.models import resolve_model
    from autotune.sizes import format_size, parse_margin, parse_size
    from autotune.workload import Workload

    if not fingerprint.cuda_available():
        print("gpu_memory: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    defaults = measurement_defaults()
    margin = defaults["margin"]
    budget = parse_size(args.budget)
    margin_bytes = parse_margin(margin, budget)
    spec = resolve_model(args.model, random_weights=True)
    workload = Workload(args.height, args.width, args.steps)
    # NVML, not torch.cuda: a CUDA context in this process would sit on the GPU beside the trials
    gpu = fingerprint.machine("cuda")["name"]
    capability = fingerprint.capability("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, changes in CONFIGS.items():
            request = worker.trial_request(
                spec, {**baseline(), **changes}, workload, "cuda", capability=capability,
                **{k: defaults[k] for k in ("repeats", "max_calls", "spread_limit", "warmup")},
            )
            started = time.monotonic()
            trial_dir = Path(tmp) / f"{len(rows)}"
            result = runner.run_trial(request, trial_dir, args.trial_timeout)
            result["trial_wall_s"] = time.monotonic() - started
            if result["status"] != worker.OK and (trial_dir / "worker.log").exists():
                # kept beside the tables: a failure must be readable without another GPU run
                log = args.out / f"gpu_memory-trial-{len(rows)}.log"
                log.write_bytes((trial_dir / "worker.log").read_bytes()[-200_000:])
                result["log"] = str(log)
            else:
                result.pop("log", None)  # in the temporary folder, gone after the run
            rows.append({"name": name, "config": changes, **result})
            peak = result.get("peak_memory_bytes")
            print(f"{name}: {result['status']}, peak {format_size(peak)}, torch reserved "
                  f"{format_size(result.get('torch_peak_reserved_bytes'))}, "
                  f"latency {result.get('latency_s', float('nan')):.3f} s"
                  + (f" ({result.get('error', '')[:200]})" if result["status"] != worker.OK else ""), flush=True)
            # after every row: a run stopped at its time limit keeps what it measured
            write_tables(args, rows, gpu, torch.__version__, margin, margin_bytes, budget)
    print((args.out / "gpu_memory.md").read_text())
    return 0


def write_tables(args, rows: list[dict], gpu: str, torch_version: str, margin: str, margin_bytes: int,
                 budget: int) -> None:
    from autotune.sizes import format_size
    from autotune.study import violation

    lines = [
        f"# GPU memory: driver (NVML) against torch, {args.model} random weights, "
        f"{args.width}x{args.height}, {args.steps} steps",
        "",
        f"{gpu}, torch {torch_version}, Python {platform.python_version()}. Budget {args.budget} "
        f"with autotune's default margin ({margin}: {format_size(margin_bytes)}): a configuration fits "
        "when its peak plus the margin is within the budget. The peak is NVML's polled figure for the "
        "trial's process, or torch's reserved peak plus what the driver holds outside torch's cache "
        "where that is higher (source `torch-reserved+outside`).",
        "",
        f"Command: `python benchmarks/gpu_memory.py --model {args.model} --height {args.height} "
        f"--width {args.width} --steps {args.steps} --budget {args.budget}`",
        "",
        "| configuration | status | peak (source) | NVML polled peak | torch reserved peak | "
        "torch allocated peak | outside torch's cache | host peak RSS | fits | headroom | latency (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = r.get("peak_memory_bytes")
        fits = violation(r, budget, margin_bytes) <= 0  # as the study judges a trial
        headroom = budget - peak if peak else None
        latency = r.get("latency_s")
        lines.append(
            f"| {r['name']} | {r['status']} | {format_size(peak)} ({r.get('memory_source')}) | "
            f"{format_size(r.get('nvml_sampled_peak_bytes'))} | {format_size(r.get('torch_peak_reserved_bytes'))} | "
            f"{format_size(r.get('torch_peak_allocated_bytes'))} | {format_size(r.get('outside_torch_bytes'))} | "
            f"{format_size(r.get('host_peak_rss_bytes'))} | {'yes' if fits else 'no'} | "
            f"{format_size(headroom) if headroom is not None and headroom >= 0 else '-'} | "
            f"{f'{latency:.3f}' if latency else '-'} |")
    text = "\n".join(lines) + "\n"
    (args.out / "gpu_memory.md").write_text(text)
    (args.out / "gpu_memory.json").write_text(json.dumps({"gpu": gpu, "budget": args.budget, "rows": rows}, indent=1))


if __name__ == "__main__":
    from _script import run  # beside this file: python puts the script's folder on the path

    run(main, kept="the rows measured before are in gpu_memory.md/.json under --out")
