"""The tabular benchmark's replay, through the real study.tune on a synthetic table (no pipelines)."""

from __future__ import annotations

import json
import statistics

import pytest

from autotune.models import resolve_model
from autotune.space import Dimension, SearchSpace, config_key

from helpers import ROOT, load_benchmark

se = load_benchmark("search_efficiency")

MiB = 2**20
DTYPE = {"float32": 1.0, "bfloat16": 0.55, "float16": 2.5}  # float16 slow on a CPU, as measured
QUANT = {"none": 1.0, "int8wo": 1.3, "int8dq": 1.1}
ATTN = {"sdpa": 1.0, "sliced": 1.2, "sliced-max": 1.5}
MEM = {"float32": 600, "bfloat16": 450, "float16": 450}


def synthetic_table() -> dict:
    """36 configs: latency multiplicative in the knobs; bfloat16 + fuse is fastest overall but
    needs the most memory of the bfloat16 configs; sliced attention saves memory and costs time;
    float16 + int8dq fails to run."""
    space = SearchSpace([
        Dimension("dtype", ("float32", "bfloat16", "float16")),
        Dimension("fuse_qkv", (False, True)),
        Dimension("quantize", ("none", "int8wo", "int8dq")),
        Dimension("attention", ("sdpa", "sliced", "sliced-max")),
    ])
    rows = {}
    for c in space.configs():
        lat = DTYPE[c["dtype"]] * QUANT[c["quantize"]] * ATTN[c["attention"]] * (0.9 if c["fuse_qkv"] else 1.0)
        mem = MEM[c["dtype"]] + (60 if c["fuse_qkv"] else 0) - {"none": 0, "int8wo": 80, "int8dq": 70}[c["quantize"]] \
            - {"sdpa": 0, "sliced": 40, "sliced-max": 50}[c["attention"]]
        status = "unsupported" if (c["dtype"], c["quantize"]) == ("float16", "int8dq") else "ok"
        rows[config_key(c)] = {"config": c, "status": status, "latency_s": lat if status == "ok" else None,
                               "peak_memory_bytes": mem * MiB}
    spec = resolve_model("tiny-sdxl")
    return {"command": "synthetic", "model": spec.to_dict(), "workload": spec.default_workload.to_dict(),
            "device": "cpu", "space": se.space_to_dict(space), "machine": {"name": "synthetic", "cpu_count": 1},
            "configs": rows}


@pytest.fixture(scope="module")
def table() -> "se.Table":
    return se.Table(synthetic_table())


def test_ours_measures_each_config_once_baseline_first_and_can_exhaust_the_space(table):
    n = len(table.space.configs())
    order = se.run_ours(table, budget=10_000 * MiB, seed=0, max_trials=n)
    assert len(order) == len(set(order)) == n  # every allowed config, none twice
    assert set(order) == {config_key(c) for c in table.space.configs()}
    assert json.loads(order[0]) == table.space.configs()[0]  # the baseline is measured first


def test_ours_finds_the_budgeted_optimum_sooner_than_random(table):
    budget = 470 * MiB  # bfloat16 + fuse (the fastest overall, 510 MiB) does not fit
    feasible = table.feasible(budget)
    best = min(feasible, key=feasible.get)
    fastest = min(table.feasible(10_000 * MiB).items(), key=lambda kv: kv[1])[0]
    assert best != fastest and fastest not in feasible  # the budget bites
    rows = se.replay(table, [budget], seeds=10, strategies=["ours", "random"], max_trials=25, holds_at=(15,))
    ours, rand = (next(r for r in rows if r["strategy"] == s) for s in ("ours", "random"))
    assert statistics.median(ours["to_opt"]) <= 15  # of 36 configs, 10 seeds
    assert ours["holds@15"] >= 0.5
    assert statistics.median(ours["to_opt"]) < statistics.median(rand["to_opt"])
    assert statistics.median(ours["to_near"]) < statistics.median(rand["to_near"])


def test_score_counts_trials_to_near_and_optimum(table):
    budget = 10_000 * MiB
    feasible = table.feasible(budget)
    best = min(feasible, key=feasible.get)
    slow = max(feasible, key=feasible.get)
    s = se.score([slow, best], table, budget, holds_at=(1, 2))
    assert s["to_opt"] == 2 and s["to_near"] == 2 and s["holds@1"] is False and s["holds@2"] is True
    assert se.score([slow], table, budget, holds_at=(1,))["to_opt"] == float("inf")


def test_the_script_replays_a_stored_table(tmp_path, capsys):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(synthetic_table()))
    out = tmp_path / "result.md"
    se.main(["replay", str(path), "--seeds", "2", "--max-trials", "10", "--holds-at", "5",
             "--budgets-mib", "470", "--out", str(out)])
    text = out.read_text()
    assert text in capsys.readouterr().out
    for name in se.STRATEGIES:
        assert f"| {name} |" in text
    assert "Budget 470.0 MiB: " in text and "ours / random" in text


def test_the_stored_table_still_covers_its_space_after_knobs_were_added():
    # The table was measured before knobs such as quantize_text_encoders existed: its rows must
    # still be found under today's full configs (new knobs at their defaults), or the README's
    # replay command stops at "the table lacks 72 configs".
    table = se.Table.load(ROOT / "benchmarks" / "tables" / "tiny-sdxl-cpu.json")
    assert len(table.rows) == len(table.space.configs()) == 72
