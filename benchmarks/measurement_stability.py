"""Measurement stability: one configuration measured in N separate trials, in one run.

Each trial is a fresh child process (fork launcher) running the study's timing loop: warm-up
until two calls agree, timed calls until the last REPEATS agree within 5% (at most 10). The
claim: the medians of separate trials agree, (max - min) / median under 5%.

    python benchmarks/measurement_stability.py --trials 5
    python benchmarks/measurement_stability.py --trials 5 --configs baseline --control

`--control` tells drift of the host from differences between processes: this script's own process
builds the first configuration once and, before each trial, times 5 calls of it. If its medians
spread as much as the trials' do, the machine drifted; if they hold still while the trials spread,
something differs from one process to the next. `--series N` skips the trials and times N calls
in a row in this one process: the spread of the medians of consecutive blocks of calls shows on
what time scale the machine's speed moves.

    python benchmarks/measurement_stability.py --series 100

Each trial's peak memory (its process's peak RSS on a CPU) is reported beside its median, with
their spread. `--malloc-mmap-threshold BYTES` runs the trials with glibc's mmap threshold held
(MALLOC_MMAP_THRESHOLD_): at 131072 every block of 128 KiB or more is a fresh mapping, returned when
freed, which is how the peaks' spread was traced to where glibc places blocks
(benchmarks/results/measurement_stability.md).

    python benchmarks/measurement_stability.py --model tiny-flux --trials 5 --malloc-mmap-threshold 131072

`--config NAME=JSON` measures a configuration of your own instead (repeatable), and
`--random-weights` with `--height/--width/--steps` a full-size architecture: how the peak of a
frozen SD1.5 stack was traced to glibc's heap, and the `malloc_mmap_threshold` knob measured:

    C='"dtype": "bfloat16", "quantize": "int8dq", "compile": "default", "compile_freezing": true'
    python benchmarks/measurement_stability.py --model sd15 --random-weights --height 128 --width 128 \
        --steps 2 --trials 3 --config "int8dq-frozen={$C}" \
        --config "int8dq-frozen-1MiB={$C, \"malloc_mmap_threshold\": \"1MiB\"}"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from autotune import measure, runner, worker
from autotune.knobs import Target, baseline, build_configured, complete
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


def named_config(item: str) -> tuple[str, dict]:
    """NAME={"knob": choice, ...} as (name, config); ValueError says what is wrong with it."""
    name, _, text = item.partition("=")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not NAME=JSON ({e})") from None
    if not name or not isinstance(config, dict):
        raise ValueError('takes NAME={"knob": choice, ...}')
    complete(config)  # an unknown knob or choice: its ValueError
    return name, config


def in_process_call(spec, workload, configs, args):
    """A function timing one call of the first configuration, built once in this process."""
    torch.set_num_threads(args.threads)
    first = {**baseline(), **next(iter(configs.values()))}
    pipe = build_configured(spec, first, Target(device="cpu", family=spec.family, workload=workload))
    pipe.set_progress_bar_config(disable=True)

    def call() -> float:
        start = time.perf_counter()
        workload.call(pipe)
        return time.perf_counter() - start

    call()  # its cold call
    return call


def series(spec, workload, configs, args) -> None:
    call = in_process_call(spec, workload, configs, args)
    times = [call() for _ in range(args.series)]
    print(f"{args.model} on cpu, {args.threads} threads, {next(iter(configs))}: {args.series} calls in a row "
          f"in one process ({sum(times):.0f} s)")
    print("calls (s): " + ", ".join(f"{t:.3f}" for t in times))
    print("| calls per block | blocks | spread of the blocks' medians |")
    print("|---|---|---|")
    for size in (1, 3, 5, 10, 20):
        medians = [statistics.median(times[i:i + size]) for i in range(0, len(times) - size + 1, size)]
        print(f"| {size} | {len(medians)} | {(max(medians) - min(medians)) / statistics.median(medians):.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph, whole
    parser.add_argument("--model", default="tiny-sdxl")
    parser.add_argument("--trials", type=int, default=5, help="separate trials per configuration")
    parser.add_argument("--repeats", type=int, default=measure.TIMED_CALLS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--series", type=int, default=0, metavar="N",
                        help="instead of trials: N calls in a row in this process, and their drift")
    parser.add_argument("--control", action="store_true",
                        help="time the first configuration in this process too, before each trial")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="which configurations to measure (default: all)")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                        help="measure this configuration (knob: choice, as JSON) instead of --configs; repeatable")
    parser.add_argument("--random-weights", action="store_true", help="a built-in full-size architecture, random weights")
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                        help="fix glibc's mmap threshold in the trials, not in this process's --control "
                             "(MALLOC_MMAP_THRESHOLD_; the malloc_mmap_threshold knob in a --config holds it in "
                             "--control too); default: glibc's own")
    args = parser.parse_args()
    if args.malloc_mmap_threshold is not None:  # before the first trial starts the fork server, which passes it on
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)

    spec = resolve_model(args.model, random_weights=args.random_weights)
    sizes = {k: v for k, v in (("height", args.height), ("width", args.width), ("steps", args.steps)) if v}
    workload = dataclasses.replace(spec.default_workload, **sizes)
    configs = {name: CONFIGS[name] for name in args.configs}
    if args.config:
        configs = {}
        for item in args.config:
            try:
                name, config = named_config(item)
            except ValueError as e:
                parser.error(f"--config {item!r}: {e}")
            if name in configs:
                parser.error(f"--config {name}: given twice")
            configs[name] = config
    if args.series:
        return series(spec, workload, configs, args)
    medians: dict[str, list[float]] = {name: [] for name in configs}
    peaks: dict[str, list[int]] = {name: [] for name in configs}
    calls: dict[str, list[int]] = {name: [] for name in configs}
    busy: dict[str, list[float]] = {name: [] for name in configs}  # the trials' cores others took
    probes: list[float] = []
    control: list[float] = []
    control_call = in_process_call(spec, workload, configs, args) if args.control else None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            for name, changes in configs.items():  # alternate, so drifts of the machine hit both
                probes.append(machine_probe())
                if control_call and name == next(iter(configs)):
                    control.append(statistics.median(control_call() for _ in range(5)))
                request = worker.trial_request(spec, {**baseline(), **changes}, workload, "cpu",
                                               repeats=args.repeats, threads=args.threads)
                result = runner.run_trial(request, Path(tmp) / f"{name}-{i}", 900, launcher="fork")
                assert result["status"] == "ok", result
                medians[name].append(result["latency_s"])
                peaks[name].append(result["peak_memory_bytes"])
                calls[name].append(result["calls"])
                busy[name].append(result["cores_taken_by_others"])

    def spread_of(values) -> str:
        return f"{(max(values) - min(values)) / statistics.median(values):.1%}"

    threshold = ("" if args.malloc_mmap_threshold is None
                 else f", trials with MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}")
    print(f"{args.model} on cpu, {workload.height}x{workload.width}, {workload.steps} steps, {args.threads} threads"
          f"{threshold}, {args.trials} separate trials per configuration")
    print("| configuration | trial medians (s) | timed calls per trial | cores taken by other processes while timed "
          "| spread of medians | peak memory per trial (MiB) | spread of peaks |")
    print("|---|---|---|---|---|---|---|")
    for name, values in medians.items():
        print(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | "
              f"{', '.join(map(str, calls[name]))} | {', '.join(f'{v:.2f}' for v in busy[name])} | {spread_of(values)} | "
              f"{', '.join(f'{v / 2**20:.1f}' for v in peaks[name])} | {spread_of(peaks[name])} |")
    print(f"| (machine probe: fixed bf16 matmul loop before each trial) | "
          f"{', '.join(f'{v:.3f}' for v in probes)} | - | - | {spread_of(probes)} | - | - |")
    if control:
        print(f"| (control: {next(iter(configs))} in one long-lived process, 5 calls before each trial) | "
              f"{', '.join(f'{v:.3f}' for v in control)} | 5 each | - | {spread_of(control)} | - | - |")


if __name__ == "__main__":
    from _script import run  # beside this file: python puts the script's folder on the path

    run(main)
