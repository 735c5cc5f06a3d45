"""The command line: `autotune --model sdxl --vram 8GB`, `autotune show|verify PROFILE`, and
`autotune report ... --out DIR` (report.py: charts comparing studies).

Every error a user can cause ends as one line on stderr and a non-zero exit code:
1 bad input or an unusable file, 2 bad usage, 3 nothing fits the budget, 130 interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

EXIT_ERROR, EXIT_USAGE, EXIT_NO_FIT, EXIT_INTERRUPTED = 1, 2, 3, 130
PROFILE_COMMANDS = ("show", "verify")
DEFAULT_STORAGE_DIR = Path("autotune-studies")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Let "--vram -1GB" reach the size parser (and its clear error) instead of argparse
        # taking "-1GB" for an option: argparse only treats plain numbers as negative values.
        self._negative_number_matcher = re.compile(r"^-\d+(\.\d+)?[A-Za-z]*$")

    def error(self, message):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _margin(text: str) -> str:
    from .sizes import parse_margin

    try:
        parse_margin(text, 2**30)  # checked here, turned into bytes once the budget is known
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _min_psnr(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a PSNR in dB (or 'auto')") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more, got {text}")
    return value


def _size(text: str) -> int:
    from .sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tune_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="autotune",
        description="Find the fastest diffusers configuration that fits a memory budget, by "
        "measuring each candidate in its own process; write it as a profile production loads.",
        epilog="Other commands: autotune show PROFILE | autotune verify PROFILE",
    )
    m = p.add_argument_group("model and workload (defaults come from the model)")
    m.add_argument("--model", default="tiny-sdxl", help="an alias (sdxl, sd15, sd3, flux-dev, "
                   "flux-schnell, tiny-sdxl, ...), a hub id in the local cache, or a local "
                   "pipeline directory (default: tiny-sdxl, offline)")
    m.add_argument("--random-weights", action="store_true",
                   help="build the full-size architecture with random weights (no download)")
    m.add_argument("--height", type=_positive_int)
    m.add_argument("--width", type=_positive_int)
    m.add_argument("--steps", type=_positive_int)
    m.add_argument("--batch-size", type=_positive_int, default=1)
    m.add_argument("--prompt")
    m.add_argument("--seed", type=int, default=0, help="generator seed of every call")
    b = p.add_argument_group("budget and device")
    b.add_argument("--vram", "--memory", dest="budget", type=_size, metavar="SIZE",
                   help="peak memory budget, e.g. 8GB, 7.5GiB, 8000MiB (GB means GiB); on a GPU "
                   "the driver-level peak of the trial process, on a CPU its peak resident "
                   "memory (default: all the device has)")
    b.add_argument("--margin", type=_margin, default="5%", metavar="SIZE_OR_PERCENT",
                   help="safety margin kept free under the budget: a config fits when its peak "
                   "plus the margin is within the budget, e.g. 5%%, 512MB, 0 (default 5%%)")
    b.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if usable)")
    s = p.add_argument_group("search")
    s.add_argument("--space", type=Path, help="a search-space YAML (default: the model family's)")
    s.add_argument("--list-knobs", action="store_true",
                   help="print the search space as it stands on this machine, and exit")
    s.add_argument("--trials", type=_positive_int, default=16,
                   help="measured trials the study should hold (default 16)")
    s.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                   help="start no new trial after this long")
    s.add_argument("--patience", type=_positive_int, metavar="N",
                   help="stop early when the best has not improved by 1%% in N measured trials")
    s.add_argument("--trial-timeout", type=_positive_float, default=1200.0, metavar="SECONDS",
                   help="kill a trial after this long (default 1200)")
    s.add_argument("--repeats", type=_positive_int, default=3,
                   help="timed calls per trial at least; more, up to --max-calls, until the last "
                   "REPEATS agree within --spread (default 3)")
    s.add_argument("--max-calls", type=_positive_int, default=10, help="timed calls per trial at most")
    s.add_argument("--spread", type=_positive_float, default=0.05, metavar="FRACTION",
                   help="(max - min) / median the last REPEATS calls must be under (default 0.05)")
    s.add_argument("--warmup", type=_positive_int, default=1,
                   help="untimed calls per trial at least; more (up to 5) until two agree within 10%%")
    s.add_argument("--threads", type=_positive_int,
                   help="CPU threads of every trial, fixed and recorded (default: torch's default here)")
    s.add_argument("--min-psnr", type=_min_psnr, default="auto", metavar="DB",
                   help="quality guard: reject configurations whose fixed-seed output is further "
                   "than this PSNR (dB) from the float32 reference; 'auto' (default) calibrates it "
                   "on what bfloat16 alone does, less 6 dB; lower it to let lossy settings in; 0 "
                   "turns the guard off")
    s.add_argument("--sampler-seed", type=int, help="seed of the sampler, for repeatable runs")
    s.add_argument("--launcher", choices=("fork", "spawn"),
                   help="start trials forked from a preloaded server (fast) or as fresh "
                   "interpreters (default: fork on a CPU, spawn on a GPU)")
    o = p.add_argument_group("storage and output")
    o.add_argument("--storage", help="Optuna storage URL (default: sqlite:///"
                   f"{DEFAULT_STORAGE_DIR}/studies.db); journal:PATH for a journal file")
    o.add_argument("--study-name", help="share or resume a study by name (default: derived "
                   "from model, workload, budget, device and space)")
    o.add_argument("--output", "-o", type=Path,
                   help="profile path (default: MODEL-BUDGET.yaml in the current folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from .errors import AutotuneError

    _quiet_libraries()
    try:
        if argv and argv[0] in PROFILE_COMMANDS:
            return _profile_command(argv)
        if argv and argv[0] == "report":
            from .report import main as report_main

            return report_main(argv[1:])
        return _tune(tune_parser().parse_args(argv))
    except AutotuneError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _quiet_libraries() -> None:
    """Keep the terminal for autotune's own lines: libraries' info logs and import-time notices
    (optuna's per-trial INFO, transformers' optional-backend notices) go quiet."""
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("torchao").setLevel(logging.ERROR)


# ---- tune --------------------------------------------------------------------------------------
def _resolve_device(name: str) -> str:
    from .errors import AutotuneError
    from .fingerprint import cuda_available

    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not cuda_available():
            raise AutotuneError(f"--device {name}: no CUDA GPU is usable here")
        return name
    raise AutotuneError(f"--device {name}: expected cuda, cuda:N or cpu")


def _study_name(spec, workload, budget, device, space, margin: int, threads: int, min_psnr) -> str:
    from .sizes import short_size

    # What the stored results depend on: a change starts another study instead of mixing them.
    ident = json.dumps(
        [spec.to_dict(), workload.to_dict(), budget, margin, threads, min_psnr, device,
         [[d.name, list(d.choices), d.when] for d in space.dimensions], space.forbid],
        sort_keys=True, default=str,
    )
    digest = hashlib.sha1(ident.encode()).hexdigest()[:8]
    w = workload
    kind = "-random" if spec.kind == "random" else ""
    return (f"{Path(spec.name).name}{kind}-{device.replace(':', '')}-{short_size(budget)}"
            f"-{w.height}x{w.width}-{w.steps}s-b{w.batch_size}-{digest}")


def _tune(args) -> int:
    from dataclasses import replace

    from . import console, fingerprint
    from . import profile as profile_io
    from .errors import SpaceError
    from .knobs import Target
    from .models import resolve_model
    from .runner import default_launcher
    import torch

    from .sizes import format_size, parse_margin, short_size
    from .space import SearchSpace
    from .study import TuneRequest, tune

    spec = resolve_model(args.model, random_weights=args.random_weights)
    device = _resolve_device(args.device)
    workload = spec.default_workload
    overrides = {k: getattr(args, k) for k in ("height", "width", "steps", "batch_size", "prompt", "seed")}
    workload = replace(workload, **{k: v for k, v in overrides.items() if v is not None})
    target = Target(device=device, family=spec.family, capability=fingerprint.capability(device))

    if args.space is not None and not args.space.exists():
        raise SpaceError(f"search space {args.space}: no such file")
    space = SearchSpace.from_file(args.space) if args.space else SearchSpace.for_model(spec)
    space = space.restrict(target)
    if args.list_knobs:
        console.print_space(space, target)
        return 0

    budget = args.budget or fingerprint.device_memory_bytes(device)
    margin = parse_margin(args.margin, budget)
    threads = args.threads or torch.get_num_threads()
    storage = args.storage or _default_storage()
    min_psnr = args.min_psnr
    study_name = args.study_name or _study_name(spec, workload, budget, device, space,
                                                margin=margin, threads=threads, min_psnr=min_psnr)
    output = args.output or Path(f"{Path(spec.name).name}-{short_size(budget)}.yaml")
    workdir = DEFAULT_STORAGE_DIR / "trials" / study_name

    request = TuneRequest(
        spec=spec, workload=workload, budget_bytes=budget, space=space, target=target,
        storage=storage, study_name=study_name, trials=args.trials, workdir=workdir,
        timeout_s=args.timeout, patience=args.patience, trial_timeout_s=args.trial_timeout,
        margin=args.margin,
        repeats=args.repeats, max_calls=max(args.max_calls, args.repeats), spread_limit=args.spread,
        warmup=args.warmup, threads=threads, seed=args.sampler_seed, min_psnr_db=min_psnr or None,
        launcher=args.launcher or default_launcher(device),
        compile_cache_dir=(DEFAULT_STORAGE_DIR / "compile-cache" / study_name).resolve(),
    )
    out = console.terminal()
    console.print_header(out, request, space)
    try:
        with console.TrialProgress(out, request.trials) as progress:
            outcome = tune(request, on_trial=progress.update)
    except KeyboardInterrupt:
        out.print(f"interrupted: the measured trials are kept in {storage} (study "
                  f"{study_name}); run the same command to resume")
        return EXIT_INTERRUPTED
    console.print_summary(out, outcome, budget, request.margin_bytes)
    if outcome.best is None:
        smallest = outcome.smallest_peak_bytes
        seen = f"the smallest peak memory measured was {format_size(smallest)}" if smallest else \
            "no trial completed a measurement"
        print(f"autotune: error: no configuration fits {format_size(budget)}: {seen}; "
              "no profile written", file=sys.stderr)
        return EXIT_NO_FIT
    document = profile_io.build(request, outcome, storage_label=storage)
    path = profile_io.save(document, output)
    out.print(f"profile written: {path}  (load it with autotune.load_profile({str(path)!r}))")
    return 0


def _default_storage() -> str:
    DEFAULT_STORAGE_DIR.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{DEFAULT_STORAGE_DIR / 'studies.db'}"


# ---- profiles ------------------------------------------------------------------------------------
def _profile_command(argv: list[str]) -> int:
    from . import console
    from .profile import load_profile

    command = argv[0]
    p = _Parser(prog=f"autotune {command}")
    p.add_argument("profile", type=Path)
    if command == "verify":
        p.add_argument("--device", help="where to replay it (default: where it was measured)")
        p.add_argument("--repeats", type=_positive_int, default=3, help="timed calls")
        p.add_argument("--trial-timeout", type=_positive_float, default=1200.0, metavar="SECONDS")
    args = p.parse_args(argv[1:])
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = load_profile(args.profile)
    out = console.terminal()
    for w in caught:
        out.print(f"warning: {w.message}")
    if command == "show":
        console.print_profile(out, profile)
        return 0
    return _verify(out, profile, args)


def _verify(out, profile, args) -> int:
    """Replay a profile in a fresh process, as production loads it, and compare with the record."""
    import tempfile

    from . import console, runner

    device = args.device or profile.data["machine"]["device"]
    measured = profile.data.get("measurement") or {}  # replay with the loop that measured it
    request = {
        "profile": str(args.profile.resolve()),
        "model": profile.data["model"],
        "config": profile.config,
        "workload": profile.data["workload"],
        "device": device,
        "repeats": args.repeats,
        "warmup": 1,
        "threads": profile.threads,  # the thread count it was measured with
        "max_calls": max(args.repeats, measured.get("timed_calls_max", 10)),
        "spread_limit": measured.get("spread_limit", 0.05),
    }
    with tempfile.TemporaryDirectory(prefix="autotune-verify-") as tmp:
        # spawn: a fresh interpreter, as a serving process starts
        result = runner.run_trial(request, Path(tmp), timeout_s=args.trial_timeout, launcher="spawn")
    fits = console.print_verification(out, profile, result)
    if result["status"] != "ok":
        print(f"autotune: error: the replay failed: {result['status']}: {result.get('error', '')}",
              file=sys.stderr)
        return EXIT_ERROR
    if not fits:
        print("autotune: error: the replayed peak memory is above the profile's budget",
              file=sys.stderr)
        return EXIT_NO_FIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
