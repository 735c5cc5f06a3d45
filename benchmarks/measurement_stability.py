"""Measurement stability: one configuration measured in N separate trials, in one run.

Each trial is a fresh child process (fork launcher) running the study's timing loop: warm-up
until two calls agree, timed calls until the last REPEATS agree within 5% (at most 10). The
claim: the medians of separate trials agree, (max - min) / median under 5%.

    python benchmarks/measurement_stability.py --trials 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from autotune import runner, worker
from autotune.knobs import baseline
from autotune.models import resolve_model

CONFIGS = {
    "baseline": {},
    "bf16+fuse_qkv+channels_last": {"dtype": "bfloat16", "fuse_qkv": True, "channels_last": True},
}


def machine_probe() -> float:
    """Seconds for a fixed bf16 matmul loop: how fast this machine is right now, apart from us."""
    a = torch.ones(1024, 1024, dtype=torch.bfloat16)
    start = time.perf_counter()
    for _ in range(40):
        a @ a
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sdxl")
    parser.add_argument("--trials", type=int, default=5, help="separate trials per configuration")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="which configurations to measure (default: all)")
    args = parser.parse_args()

    spec = resolve_model(args.model)
    configs = {name: CONFIGS[name] for name in args.configs}
    medians: dict[str, list[float]] = {name: [] for name in configs}
    calls: dict[str, list[int]] = {name: [] for name in configs}
    probes: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            for name, changes in configs.items():  # alternate, so drifts of the machine hit both
                probes.append(machine_probe())
                request = worker.trial_request(spec, {**baseline(), **changes}, spec.default_workload, "cpu",
                                               repeats=args.repeats, threads=args.threads)
                result = runner.run_trial(request, Path(tmp) / f"{name}-{i}", 900, launcher="fork")
                assert result["status"] == "ok", result
                medians[name].append(result["latency_s"])
                calls[name].append(result["calls"])

    print(f"{args.model} on cpu, {args.threads} threads, {args.trials} separate trials per configuration")
    print("| configuration | trial medians (s) | timed calls per trial | spread of medians |")
    print("|---|---|---|---|")
    for name, values in medians.items():
        spread = (max(values) - min(values)) / statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | "
              f"{', '.join(map(str, calls[name]))} | {spread:.1%} |")
    spread = (max(probes) - min(probes)) / statistics.median(probes)
    print(f"| (machine probe: fixed bf16 matmul loop before each trial) | "
          f"{', '.join(f'{v:.3f}' for v in probes)} | - | {spread:.1%} |")


if __name__ == "__main__":
    main()
