"""Search efficiency on a tabular benchmark: measure every config of a small real space once, then
replay search strategies on the stored table over many seeds.

    # 1. measure: every config of the space, each once, through the real trial harness
    nice -n 19 python benchmarks/search_efficiency.py measure --model tiny-sdxl --device cpu
    # 2. replay: ours (study.tune with the table as its measuring function), Optuna's default TPE,
    #    random search, grid order; at memory budgets that bite; many seeds
    python benchmarks/search_efficiency.py replay benchmarks/tables/tiny-sdxl-cpu.json --seeds 30

A trial here is a distinct configuration measured: what costs the user time. A strategy that
proposes a configuration it measured already (or a forbidden one) pays nothing for it: every
strategy gets that de-duplication for free, so the comparison is of what each chooses to measure.

Strategies:
- ours: `autotune.study.tune(request, measure=<table lookup>)`, storage "memory": the real loop
  (baseline enqueued first, de-duplication, forbidden configs, the memory constraint reported with
  trial.set_constraint) and the real `make_sampler(seed)`.
- tpe-default: `optuna.samplers.TPESampler(seed=seed)` as a user would call it on this objective
  without reading the docs on constraints: latency when the config ran and fits the budget,
  otherwise a large value (10x the slowest latency in the table); no baseline enqueued.
- random: `optuna.samplers.RandomSampler(seed=seed)`, same objective; with de-duplication it is
  random search without replacement over the space's allowed configs.
- grid: `SearchSpace.configs()` in its order (baseline first, then itertools.product order).
- ours-no-repair: ours with the memory repair (autotune/repair.py) switched off.
- ours:NAME: the real tune loop with a sampler of VARIANTS in place of make_sampler, e.g.
  `--strategies ours,ours:tpe-mv-s5` (make_sampler before n_ei_candidates=100).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import optuna

from autotune import study as study_mod
from autotune.fingerprint import machine, software
from autotune.knobs import Target, changed, complete
from autotune.measure import SPREAD_LIMIT, TIMED_CALLS, WARMUP_CALLS
from autotune.models import ModelSpec, resolve_model
from autotune.space import SHIPPED_DIR, Dimension, SearchSpace, config_key
from autotune.worker import write_json
from autotune.workload import Workload

HERE = Path(__file__).resolve().parent
TABLES = HERE / "tables"
RESULTS = HERE / "results"
# The sub-space measured by default: the tiny-sdxl CPU space without vae_slicing (acts only for
# batch > 1: a no-op here that would double the table with copies) and vae_tiling (acts at 256 px
# on the tiny VAE, but costs ~15 s a call on this CPU: the table would take hours).
DEFAULT_KNOBS = ("dtype", "fuse_qkv", "quantize", "channels_last", "attention")
STRATEGIES = ("ours", "ours-no-repair", "ours+seeds", "tpe-default", "random", "grid")
WITHIN = 0.05  # "near the optimum": latency within 5% of the best feasible one


# ---- the space ----------------------------------------------------------------------------------
def sub_space(spec: ModelSpec, device: str, knobs: tuple[str, ...] | None) -> SearchSpace:
    space = SearchSpace.for_model(spec).restrict(Target(device=device, family=spec.family))
    if knobs:
        unknown = set(knobs) - {d.name for d in space.dimensions}
        if unknown:
            raise SystemExit(f"not searched in this space on {device}: {', '.join(sorted(unknown))}")
        space = SearchSpace([d for d in space.dimensions if d.name in knobs], space.forbid,
                            space.source, space.dropped)
    return space


def space_to_dict(space: SearchSpace) -> dict:
    return {
        "source": space.source,
        "dimensions": [{"name": d.name, "choices": list(d.choices), "when": d.when} for d in space.dimensions],
        "forbid": space.forbid,
    }


def space_from_dict(data: dict) -> SearchSpace:
    dims = [Dimension(d["name"], tuple(d["choices"]), d.get("when")) for d in data["dimensions"]]
    return SearchSpace(dims, data.get("forbid", []), data.get("source", "<table>"))


# ---- measuring the table ----------------------------------------------------------------------------
KEEP = ("status", "latency_s", "peak_memory_bytes", "p90_s", "spread", "calls", "latencies_s",
        "first_call_s", "load_s", "wall_s", "memory_source", "error")


def measure_table(args) -> None:
    from autotune import runner, worker

    spec = resolve_model(args.model)
    workload = spec.default_workload
    space = sub_space(spec, args.device, tuple(args.knobs.split(",")) if args.knobs else None)
    configs = space.configs()
    out = Path(args.out or TABLES / f"{spec.name}-{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    capability = None
    if args.device.startswith("cuda"):
        from autotune.fingerprint import capability as cap

        capability = cap(args.device)
    launcher = args.launcher or runner.default_launcher(args.device)
    table = {
        "what": "every configuration of the space measured once through autotune.runner.run_trial",
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "model": spec.to_dict(),
        "workload": workload.to_dict(),
        "device": args.device,
        "capability": capability,
        "space": space_to_dict(space),
        "request": {"repeats": args.repeats, "max_calls": args.max_calls, "spread_limit": args.spread,
                    "warmup": args.warmup, "max_warmup": args.max_warmup, "threads": args.threads,
                    "launcher": launcher},
        "machine": machine(args.device),
        "software": software(),
        "platform": platform.platform(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "configs": {},
    }
    if out.exists() and not args.resume:  # written after every trial: the first would replace it
        raise SystemExit(f"{out} exists: --resume adds to it, --out writes another table")
    if out.exists() and args.resume:
        old = json.loads(out.read_text())
        table["configs"] = old.get("configs", {})
        table["started"] = old.get("started", table["started"])
    order = list(configs)
    random.Random(args.order_seed).shuffle(order)  # machine noise spread over configs, not knobs
    todo = [c for c in order if config_key(c) not in table["configs"]]
    print(f"{spec.name} on {args.device}: {len(configs)} configs, {len(todo)} to measure -> {out}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(todo, 1):
            request = worker.trial_request(
                spec, config, workload, args.device, capability=capability, repeats=args.repeats,
                max_calls=args.max_calls, spread_limit=args.spread, warmup=args.warmup,
                max_warmup=args.max_warmup, threads=args.threads,
            )
            result = runner.run_trial(request, Path(tmp) / f"trial-{i:04d}", args.trial_timeout,
                                      launcher=launcher)
            entry = {k: result[k] for k in KEEP if k in result}
            entry["config"] = config
            entry["load_average_1m"] = os.getloadavg()[0]
            table["configs"][config_key(config)] = entry
            table["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            write_json(out, table, indent=1)  # after every trial: a killed run resumes with --resume
            lat = entry.get("latency_s")
            peak = entry.get("peak_memory_bytes")
            print(f"[{i}/{len(todo)} {time.monotonic() - started:5.0f}s] {entry['status']:>13} "
                  f"{lat if lat is None else round(lat, 3)!s:>7} s "
                  f"{'-' if not peak else round(peak / 2**20)!s:>6} MiB  {_short(config)}", flush=True)


def _short(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in changed(config).items()) or "baseline"


# ---- replaying -----------------------------------------------------------------------------------
class Table:
    def __init__(self, data: dict):
        self.data = data
        self.space = space_from_dict(data["space"])
        self.spec = ModelSpec.from_dict(data["model"])
        self.workload = Workload.from_dict(data["workload"])
        self.device = data["device"]
        # Keyed by the full config as the catalogue stands now: a knob added since the table was
        # measured takes its default, which is what every row ran with (it did not exist then).
        self.rows = {config_key(complete(row["config"])): row for row in data["configs"].values()}
        missing = [config_key(c) for c in self.space.configs() if config_key(c) not in self.rows]
        if missing:
            raise SystemExit(f"the table lacks {len(missing)} configs of its space (measure --resume)")

    @classmethod
    def load(cls, path: Path) -> "Table":
        if not Path(path).is_file():
            raise SystemExit(f"{path}: no such table (measure writes one)")
        return cls(json.loads(Path(path).read_text()))

    def result(self, config: dict) -> dict:
        row = self.rows[config_key(config)]
        return {k: row[k] for k in ("status", "latency_s", "peak_memory_bytes") if k in row}

    def feasible(self, budget: int) -> dict[str, float]:
        """config key -> latency of every config that ran and fits `budget`."""
        return {k: r["latency_s"] for k, r in self.rows.items()
                if r["status"] == "ok" and r.get("peak_memory_bytes") and r["peak_memory_bytes"] <= budget}

    def ok_rows(self) -> list[dict]:
        return [r for r in self.rows.values() if r["status"] == "ok"]


def auto_budgets(table: Table) -> list[int]:
    """Budgets that bite differently: none (the largest peak), the median peak and the lower
    quartile of the peaks of the configs that ran (half, then three quarters of them do not fit)."""
    peaks = sorted(r["peak_memory_bytes"] for r in table.ok_rows())
    budgets = [peaks[-1], peaks[len(peaks) // 2], peaks[len(peaks) // 4]]
    return list(dict.fromkeys(b for b in budgets if table.feasible(b)))


def run_ours(table: Table, budget: int, seed: int, max_trials: int, seeds: list | None = None,
             memory_repair: bool = True) -> list[str]:
    """The real tune loop on the table; returns the distinct configs measured, in order.
    `seeds`: expert starting points (partial configs) measured right after the baseline."""
    order: list[str] = []

    def lookup(request: dict, trial_dir: Path, tick: Callable[[], None]) -> dict:
        if request.get("purpose") == "reference":
            # the study's one-call float32 and bfloat16 runs that set the seeds' precision
            # (study.reference_calls): made once per study, not trials
            return table.result(request["config"])
        key = config_key(request["config"])
        assert key not in order, f"tune measured {key} twice"
        order.append(key)
        return table.result(request["config"])

    req = study_mod.TuneRequest(
        spec=table.spec, workload=table.workload, budget_bytes=budget,
        space=dataclasses.replace(table.space, seeds=seeds or []),
        target=Target(device=table.device, family=table.spec.family), storage="memory",
        study_name=f"replay-{seed}", trials=max_trials, workdir=Path(tempfile.gettempdir()) / "unused",
        seed=seed, min_psnr_db=None,  # the table holds latency and memory, no images
        memory_repair=memory_repair,
    )
    study_mod.tune(req, measure=lookup)
    return order


def run_optuna_naive(table: Table, budget: int, seed: int, max_trials: int, sampler) -> list[str]:
    """An Optuna sampler on the plain objective: latency if it ran and fits, else a large value.
    Proposals measured already, or forbidden, are answered from a cache and do not count."""
    space = table.space
    penalty = 10 * max(r["latency_s"] for r in table.ok_rows())
    n_configs = len(space.configs())
    study = optuna.create_study(sampler=sampler, direction="minimize")
    seen: dict[str, float] = {}
    order: list[str] = []
    asks = 0
    while len(order) < min(max_trials, n_configs) and asks < 50 * n_configs:
        asks += 1
        trial = study.ask()
        config = space.suggest(trial)
        key = config_key(config)
        if key not in seen:
            if space.forbidden(config):
                seen[key] = penalty
            else:
                r = table.result(config)
                fits = r["status"] == "ok" and r["peak_memory_bytes"] <= budget
                seen[key] = r["latency_s"] if fits else penalty
                order.append(key)
        study.tell(trial, seen[key])
    return order


def run_grid(table: Table, budget: int, seed: int, max_trials: int) -> list[str]:
    return [config_key(c) for c in table.space.configs()][:max_trials]


# Samplers tried in place of study.make_sampler ("ours:NAME"), to choose make_sampler from evidence.
def _tpe(**kw):
    return lambda seed: optuna.samplers.TPESampler(seed=seed, **kw)


VARIANTS = {
    "tpe-mv-s5": _tpe(multivariate=True, group=True, n_startup_trials=5),
    "tpe-mv-s10": _tpe(multivariate=True, group=True, n_startup_trials=10),
    "tpe-mv-s3": _tpe(multivariate=True, group=True, n_startup_trials=3),
    "tpe-uni-s5": _tpe(multivariate=False, n_startup_trials=5),
    "tpe-uni-s10": _tpe(multivariate=False),
    "tpe-default": _tpe(),  # optuna 5's defaults: multivariate, 10 random startup trials
    "tpe-mv-s5-ei100": _tpe(multivariate=True, group=True, n_startup_trials=5, n_ei_candidates=100),
    "tpe-mv-s5-prior0.5": _tpe(multivariate=True, group=True, n_startup_trials=5, prior_weight=0.5),
    "tpe-mv-s3-ei100": _tpe(multivariate=True, group=True, n_startup_trials=3, n_ei_candidates=100),
    "tpe-mv-s5-ei200": _tpe(multivariate=True, group=True, n_startup_trials=5, n_ei_candidates=200),
    "tpe-mv-s5-ei50": _tpe(multivariate=True, group=True, n_startup_trials=5, n_ei_candidates=50),
    "tpe-mv-s10-ei100": _tpe(multivariate=True, group=True, n_startup_trials=10, n_ei_candidates=100),
    "tpe-mv-s5-g25": _tpe(multivariate=True, group=True, n_startup_trials=5, gamma=lambda n: min(math.ceil(0.25 * n), 25)),
    "tpe-mv-s3-g25": _tpe(multivariate=True, group=True, n_startup_trials=3, gamma=lambda n: min(math.ceil(0.25 * n), 25)),
    "tpe-mv-s5-g25-ei100": _tpe(multivariate=True, group=True, n_startup_trials=5, n_ei_candidates=100,
                                gamma=lambda n: min(math.ceil(0.25 * n), 25)),
}


def run_ours_with(factory):
    def run(table, budget, seed, max_trials):
        real = study_mod.make_sampler
        study_mod.make_sampler = lambda s: _quiet(factory, s)
        try:
            return run_ours(table, budget, seed, max_trials)
        finally:
            study_mod.make_sampler = real

    return run


def run_ours_without_repair(table, budget, seed, max_trials):
    """ours, with the study's memory repair (autotune/repair.py) switched off: what it adds."""
    return run_ours(table, budget, seed, max_trials, memory_repair=False)


def _quiet(factory, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(seed)


def strategy(name: str):
    if name == "ours":
        return run_ours
    if name == "ours-no-repair":
        return run_ours_without_repair
    if name == "ours+seeds":  # with the shipped expert seeds (search_spaces/default.yaml)
        seeds = SearchSpace.from_file(SHIPPED_DIR / "default.yaml").seeds
        return lambda t, b, s, n: run_ours(t, b, s, n, seeds=seeds)
    if name.startswith("ours:"):
        return run_ours_with(VARIANTS[name.split(":", 1)[1]])
    if name == "tpe-default":
        return lambda t, b, s, n: run_optuna_naive(t, b, s, n, optuna.samplers.TPESampler(seed=s))
    if name == "random":
        return lambda t, b, s, n: run_optuna_naive(t, b, s, n, optuna.samplers.RandomSampler(seed=s))
    if name == "grid":
        return run_grid
    raise SystemExit(f"unknown strategy {name}")


def first_hit(order: list[str], good: set[str]) -> float:
    """1-based number of the first trial in `good`, or inf if none (within the trials run)."""
    return next((i for i, k in enumerate(order, 1) if k in good), math.inf)


def score(order: list[str], table: Table, budget: int, holds_at: tuple[int, ...]) -> dict:
    feasible = table.feasible(budget)
    best = min(feasible.values())
    near = {k for k, v in feasible.items() if v <= best * (1 + WITHIN)}
    optimum = {k for k, v in feasible.items() if v == best}
    out = {"to_near": first_hit(order, near), "to_opt": first_hit(order, optimum)}
    for n in holds_at:
        out[f"holds@{n}"] = bool(optimum & set(order[:n]))
    return out


def median_text(values: list[float]) -> str:
    m = statistics.median(values)  # inf when more than half the runs never got there
    return "never" if math.isinf(m) else f"{m:g}"


def replay(table: Table, budgets: list[int], seeds: int, strategies, max_trials: int,
           holds_at: tuple[int, ...], progress=None) -> list[dict]:
    rows = []
    for budget in budgets:
        for name in strategies:
            run = strategy(name)
            scores = []
            started = time.monotonic()
            for seed in range(seeds if name != "grid" else 1):  # grid order has no seed
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    order = run(table, budget, seed, max_trials)
                scores.append(score(order, table, budget, holds_at))
            row = {"budget": budget, "strategy": name, "runs": len(scores),
                   "to_near": [s["to_near"] for s in scores], "to_opt": [s["to_opt"] for s in scores],
                   "seconds": time.monotonic() - started}
            for n in holds_at:
                row[f"holds@{n}"] = sum(s[f"holds@{n}"] for s in scores) / len(scores)
            rows.append(row)
            if progress:
                progress(row)
    return rows


def markdown(table: Table, rows: list[dict], budgets: list[int], holds_at, max_trials: int, command: str) -> str:
    d = table.data
    n_configs = len(table.space.configs())
    ok = table.ok_rows()
    lines = [
        f"# Search efficiency: {table.spec.name} on {table.device} ({d['machine'].get('name')}, "
        f"{d['machine'].get('cpu_count')} cores)",
        "",
        f"Table: {n_configs} configurations of {', '.join(x.name for x in table.space.dimensions)}, "
        f"each measured once ({d['command']}); {len(ok)} ran, "
        f"latency {min(r['latency_s'] for r in ok):.3g}-{max(r['latency_s'] for r in ok):.3g} s, "
        f"peak {min(r['peak_memory_bytes'] for r in ok) / 2**20:.0f}-"
        f"{max(r['peak_memory_bytes'] for r in ok) / 2**20:.0f} MiB. The fastest config overall "
        f"peaks at {min(ok, key=lambda r: r['latency_s'])['peak_memory_bytes'] / 2**20:.1f} MiB: a budget "
        f"excludes it only below that. Replay: `{command}`.",
        "",
        "A trial is a distinct configuration measured. Trials to 5% / to optimum: median over seeds "
        f"(runs stop at {max_trials} trials; 'never' when most runs did not get there). "
        "Holds opt @N: fraction of runs whose first N trials include the best feasible configuration.",
        "",
    ]
    for budget in budgets:
        feasible = table.feasible(budget)
        best_key = min(feasible, key=feasible.get)
        near = sum(v <= feasible[best_key] * (1 + WITHIN) for v in feasible.values())
        lines += [
            f"## Budget {budget / 2**20:.1f} MiB: {len(feasible)} of {n_configs} configs fit; best "
            f"{feasible[best_key]:.3f} s ({_short(table.rows[best_key]['config'])}); {near} within 5%",
            "",
            "| strategy | runs | trials to 5% (median) | trials to optimum (median) | "
            + " | ".join(f"holds opt @{n}" for n in holds_at) + " |",
            "|---|---|---|---|" + "---|" * len(holds_at),
        ]
        for row in (r for r in rows if r["budget"] == budget):
            lines.append(
                f"| {row['strategy']} | {row['runs']} | {median_text(row['to_near'])} | "
                f"{median_text(row['to_opt'])} | "
                + " | ".join(f"{row[f'holds@{n}']:.0%}" for n in holds_at) + " |")
        ours = next((r for r in rows if r["budget"] == budget and r["strategy"] == "ours"), None)
        rand = next((r for r in rows if r["budget"] == budget and r["strategy"] == "random"), None)
        if ours and rand:
            mo, mr = statistics.median(ours["to_near"]), statistics.median(rand["to_near"])
            verdict = "meets" if mo <= mr / 2 else "misses"
            lines += ["", f"ours / random, median trials to 5%: {mo:g} / {mr:g} = {mo / mr:.2f} "
                          f"({verdict} the target of at most 0.5)"]
        lines.append("")
    return "\n".join(lines)


def replay_cmd(args) -> None:
    table = Table.load(args.table)
    budgets = [int(float(b) * 2**20) for b in args.budgets_mib.split(",")] if args.budgets_mib \
        else auto_budgets(table)
    holds_at = tuple(int(x) for x in args.holds_at.split(","))
    max_trials = args.max_trials or len(table.space.configs())
    strategies = args.strategies.split(",")
    unknown = [n for n in strategies if n not in STRATEGIES and n.removeprefix("ours:") not in VARIANTS]
    if unknown:
        raise SystemExit(f"--strategies {unknown[0]}: use {', '.join(STRATEGIES)} or ours:NAME "
                         f"with NAME one of {', '.join(VARIANTS)}")
    empty = [b for b in budgets if not table.feasible(b)]
    if empty:
        smallest = min(r["peak_memory_bytes"] for r in table.ok_rows() if r.get("peak_memory_bytes"))
        raise SystemExit(f"--budgets-mib: no config of the table fits {empty[0] / 2**20:g} MiB "
                         f"(the smallest peak is {smallest / 2**20:.1f} MiB)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])

    def progress(row):
        print(f"  {row['budget'] / 2**20:8.1f} MiB {row['strategy']:12} to5% {median_text(row['to_near']):>5} "
              f"toopt {median_text(row['to_opt']):>5} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)

    rows = replay(table, budgets, args.seeds, strategies, max_trials, holds_at, progress)
    text = markdown(table, rows, budgets, holds_at, max_trials, command)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph, whole
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure every config of a space once; store the table")
    m.add_argument("--model", default="tiny-sdxl")
    m.add_argument("--device", default="cpu")
    m.add_argument("--knobs", default=",".join(DEFAULT_KNOBS),
                   help="knobs searched (others at the baseline); '' for the whole space")
    m.add_argument("--out", help="table path (default benchmarks/tables/MODEL-DEVICE.json)")
    # A tuning run's defaults, but cheaper: no more timed calls than the window (the median of
    # its calls) and no second warm-up call, so that every config of the table is measured in
    # about half an hour on 2 cores.
    m.add_argument("--repeats", type=int, default=TIMED_CALLS)
    m.add_argument("--max-calls", type=int, default=TIMED_CALLS)
    m.add_argument("--spread", type=float, default=SPREAD_LIMIT)
    m.add_argument("--warmup", type=int, default=WARMUP_CALLS)
    m.add_argument("--max-warmup", type=int, default=WARMUP_CALLS)
    m.add_argument("--threads", type=int, default=1,
                   help="torch threads per trial: 1 by default, so that other jobs on a shared CPU "
                        "stall one thread instead of a parallel region (2 threads on 2 busy cores ran 13x slower)")
    m.add_argument("--launcher", choices=("fork", "spawn"))
    m.add_argument("--trial-timeout", type=float, default=600)
    m.add_argument("--order-seed", type=int, default=0, help="seed of the shuffled measuring order")
    m.add_argument("--resume", action="store_true", help="keep the configs a table holds already")
    r = sub.add_parser("replay", help="replay strategies on a stored table")
    r.add_argument("table", type=Path)
    r.add_argument("--seeds", type=int, default=30)
    r.add_argument("--budgets-mib", help="comma-separated budgets (default: three chosen from the table)")
    r.add_argument("--strategies", default=",".join(STRATEGIES))
    r.add_argument("--max-trials", type=int, default=0, help="distinct configs per run at most (0: the space's size)")
    r.add_argument("--holds-at", default="15,25")
    r.add_argument("--out", help="write the markdown here too (e.g. benchmarks/results/search_efficiency.md)")
    r.add_argument("--json", help="write per-run numbers here")
    args = parser.parse_args(argv)
    (measure_table if args.command == "measure" else replay_cmd)(args)


if __name__ == "__main__":
    from _script import run  # beside this file: python puts the script's folder on the path

    run(main)
