"""Per-trial overhead: the spawn launcher against the fork server, in one run.

Overhead of a trial = its wall time (as the parent sees it) minus the time spent inside timed
pipeline calls (warm-up and timed calls). Both launchers run the same tiny-sdxl baseline trial, in
alternation so that machine noise hits both alike.

    python benchmarks/trial_overhead.py --trials 5
    python benchmarks/trial_overhead.py --trials 8 --config 'bf16-qkv={"dtype": "bfloat16", "fuse_qkv": true}'

`--config NAME=JSON` times another configuration than the baseline (as measurement_stability.py
takes it): the latency column then says whether a forked trial times it as a fresh process does.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from autotune import measure, runner, worker
from autotune.knobs import baseline, complete
from autotune.models import resolve_model


def figures(result: dict) -> tuple[float, float, float]:
    """The trial's overhead, its wall time and its latency (the median of its timed calls)."""
    inside = sum(result["warmup_s"]) + sum(result["latencies_s"])  # every pipeline call
    return result["wall_s"] - inside, result["wall_s"], result["latency_s"]


def main() -> None:
    from measurement_stability import named_config  # beside this file, as _script
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph, whole
    parser.add_argument("--model", default="tiny-sdxl")
    parser.add_argument("--trials", type=int, default=5, help="trials per launcher")
    parser.add_argument("--repeats", type=int, default=measure.TIMED_CALLS)
    parser.add_argument("--config", metavar="NAME=JSON", help="a configuration to time instead of the baseline")
    args = parser.parse_args()
    name, config = "baseline", baseline()
    if args.config:
        try:
            name, config = named_config(args.config)
        except ValueError as e:
            parser.error(f"--config {args.config!r}: {e}")

    spec = resolve_model(args.model)
    request = worker.trial_request(spec, complete(config), spec.default_workload, "cpu", repeats=args.repeats)
    rows = {launcher: [] for launcher in runner.LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        runner.run_trial(request, Path(tmp) / "server-start", 600, launcher="fork")  # not counted
        for i in range(args.trials):
            for launcher in runner.LAUNCHERS:
                result = runner.run_trial(request, Path(tmp) / f"{launcher}-{i}", 600, launcher=launcher)
                assert result["status"] == "ok", result
                rows[launcher].append(figures(result))

    print(f"{args.model} {name}, {args.trials} trials per launcher, {args.repeats} timed calls + 1 warm-up each")
    # the trials' own latency beside: a forked trial and a fresh interpreter (as `autotune verify`
    # and a serving process run) should time the same call alike
    print(f"{'launcher':8} {'overhead s (median)':>20} {'wall s (median)':>16} {'overhead share':>15} "
          f"{'latency s (median)':>19}")
    medians, latencies = {}, {}
    for launcher, values in rows.items():
        over = statistics.median(v[0] for v in values)
        wall = statistics.median(v[1] for v in values)
        medians[launcher], latencies[launcher] = over, statistics.median(v[2] for v in values)
        print(f"{launcher:8} {over:20.2f} {wall:16.2f} {over / wall:14.0%} {latencies[launcher]:19.3f}")
    print(f"overhead ratio spawn / fork: {medians['spawn'] / medians['fork']:.1f}x; latency spawn / fork: "
          f"{latencies['spawn'] / latencies['fork']:.3f}x (spawn slower in {sum(s[2] > f[2] for f, s in zip(rows['fork'], rows['spawn']))} "
          f"of {args.trials} pairs)")


if __name__ == "__main__":
    from _script import run  # beside this file: python puts the script's folder on the path

    run(main)
