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
import time
from pathlib import Path

import yaml

from autotune import fingerprint
from autotune.console import config_changes

# model, budget, from peaks measured on a 2-core Xeon on 2026-12-02 (float32 809-829 / 540 / 530 MiB;
# bfloat16 + fused QKV + channels_last 739 / 529 / 530 MiB; a fit needs the peak under 95% of the
# budget, the 5% margin; MB is MiB here, as in autotune): float32 does not fit tiny-sdxl's and
# tiny-sd15's budgets. tiny-sd3's configs all peak within about 4 MiB of each other (529-533 MiB
# in one study): no budget leaves some out, and its budget fits all. The tiny models' peaks are
# mostly the process's own (libraries, allocator) and move by a few MiB between machines and
# library versions (545MB fitted nothing of tiny-sd15's in that run): --cases chooses others.
CASES = [
    ("tiny-sdxl", "780MB"),
    ("tiny-sd15", "562MiB"),
    ("tiny-sd3", "570MiB"),
]


def autotune(*args: str, cwd: Path, ok=(0,)) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autotune", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=3600)
    if proc.returncode not in ok:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def replayed(stdout: str, label: str) -> float:
    """The replayed / recorded ratio of one row of verify's table: "| label | recorded | replayed |
    1.012x |" (tests/test_cli_runs.py reads a real verify's output with it)."""
    row = next(line for line in stdout.splitlines() if line.strip("│| ").startswith(label))
    return float(re.split(r"[│|]", row)[-2].strip().removesuffix("x"))


def with_run_added(text: str, run: str) -> str:
    """The results file `text` with `run` first under its title and opening prose; earlier runs stay
    (a run on a drifting machine is one sample). A run starts at a dated heading, the one main()
    writes, so a "## " line in the prose (or in a fence there) is not taken for one."""
    top, *runs = re.split(r"^(?=## \d{4}-\d\d-\d\d )", text, maxsplit=1, flags=re.MULTILINE)
    top = top.strip() or "# Replay fidelity"
    return f"{top}\n\n{run.strip()}\n" + (f"\n{runs[0].strip()}\n" if runs else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph, whole
    parser.add_argument("--trials", default="8")
    parser.add_argument("--cases", nargs="*", metavar="MODEL=BUDGET",
                        help="models and budgets to tune and replay (default: " +
                        " ".join(f"{m}={b}" for m, b in CASES) + ")")
    parser.add_argument("--out", type=Path, default=Path("benchmark-results") / "replay_fidelity.md",
                        help="markdown file the run is added to, newest first (default "
                             "./benchmark-results/replay_fidelity.md; the committed one is "
                             "benchmarks/results/replay_fidelity.md)")
    args = parser.parse_args()
    bad = [c for c in args.cases or [] if "=" not in c]
    if bad:
        parser.error(f"--cases {bad[0]}: expected MODEL=BUDGET, such as tiny-sd15=545MB")
    if args.out.is_dir():  # checked now, not after the minutes of tuning that precede the write
        parser.error(f"--out {args.out}: a folder; name the markdown file, such as {args.out / 'replay_fidelity.md'}")
    cases = [tuple(c.split("=", 1)) for c in args.cases] if args.cases else CASES
    rows = []  # the table's, one a case
    with tempfile.TemporaryDirectory(prefix="autotune-replay-") as tmp:
        cwd = Path(tmp)
        for model, budget in cases:
            tuned = autotune("--model", model, "--vram", budget, "--trials", args.trials, "--sampler-seed", "0",
                             "--output", f"{model}.yaml", cwd=cwd, ok=(0, 3))
            if tuned.returncode == 3:  # nothing fitted this machine's peaks: said in the table, the others go on
                print(tuned.stderr.strip(), file=sys.stderr)
                rows.append(f"| {model} | {budget} | no config fitted (exit 3): a budget for this machine's peaks "
                            "is `--cases MODEL=BUDGET` | | | | | |")
                continue
            profile = yaml.safe_load((cwd / f"{model}.yaml").read_text())
            best = profile["best"]
            verify = autotune("verify", f"{model}.yaml", cwd=cwd, ok=(0, 3))  # 3: over budget
            replay_peak = best["peak_memory_bytes"] * replayed(verify.stdout, "peak memory")
            fits = "yes" if replay_peak <= profile["budget"]["memory_bytes"] else "NO"
            rows.append(f"| {model} | {budget} | {config_changes(best['config'])} | {best['latency_s']:.3f} s | "
                        f"{replayed(verify.stdout, 'latency (median)'):.3f} | {best['peak_memory_bytes'] / 2**20:.0f} MiB | "
                        f"{replay_peak / 2**20:.0f} MiB | {fits} |")
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')}, {fingerprint.cpu_name()}",
        "",
        f"`python benchmarks/replay_fidelity.py --trials {args.trials}"
        + (f" --cases {' '.join(args.cases)}" if args.cases else "") + "`: each model tuned with "
        "`autotune --model M --vram B --trials N --sampler-seed 0`, then its profile replayed by "
        "`autotune verify` in a fresh interpreter (as a serving process loads it).",
        "",
        "| model | budget | best config | recorded latency | replayed / recorded latency | recorded peak | "
        "replayed peak | replayed peak within budget |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    run = "\n".join(lines) + "\n"
    print(run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(with_run_added(args.out.read_text() if args.out.exists() else "", run))
    print(f"added to {args.out}")


if __name__ == "__main__":
    from _script import run  # beside this file: python puts the script's folder on the path

    run(main)
