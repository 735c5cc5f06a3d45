"""Replay fidelity: tune three profiles, then replay each with `autotune verify` in a fresh process.

The claims: replayed latency within 10% of the recorded one, and replayed peak memory never above
the profile's budget (the study kept --margin free for the difference between a trial forked from
the preloaded server and a fresh serving process).

    python benchmarks/replay_fidelity.py
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CASES = [  # model, budget: budgets that bite (float32 does not fit under the first)
    ("tiny-sdxl", "650MB"),
    ("tiny-sd15", "1GB"),
    ("tiny-sd3", "2GB"),
]


def autotune(*args: str, cwd: Path, ok=(0,)) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autotune", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=3600)
    if proc.returncode not in ok:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def replayed(stdout: str, label: str) -> float:
    # the verify table: "| label | recorded | replayed | ratio |"
    row = next(line for line in stdout.splitlines() if line.strip("│| ").startswith(label))
    return float(re.split(r"[│|]", row)[-2].strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", default="8")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="autotune-replay-") as tmp:
        cwd = Path(tmp)
        for model, budget in CASES:
            autotune("--model", model, "--vram", budget, "--trials", args.trials, "--sampler-seed", "0",
                     "--output", f"{model}.yaml", cwd=cwd)
            profile = yaml.safe_load((cwd / f"{model}.yaml").read_text())
            verify = autotune("verify", f"{model}.yaml", cwd=cwd, ok=(0, 3))  # 3: over budget
            latency_ratio = replayed(verify.stdout, "latency (median)")
            peak_ratio = replayed(verify.stdout, "peak memory")
            peak = profile["best"]["peak_memory_bytes"] * peak_ratio
            rows.append((model, budget, profile["best"]["latency_s"], latency_ratio,
                         profile["best"]["peak_memory_bytes"], peak, profile["budget"]["memory_bytes"]))
    print("| model | budget | recorded latency | replayed / recorded latency | recorded peak | "
          "replayed peak | within budget |")
    print("|---|---|---|---|---|---|---|")
    for model, budget, latency, ratio, peak, replay_peak, budget_bytes in rows:
        print(f"| {model} | {budget} | {latency:.3f} s | {ratio:.3f} | {peak / 2**20:.0f} MiB | "
              f"{replay_peak / 2**20:.0f} MiB | {'yes' if replay_peak <= budget_bytes else 'NO'} |")


if __name__ == "__main__":
    main()
