"""The command line: `autotune --model sdxl --vram 8GB`, `autotune show|verify PROFILE`,
`autotune export --study-name NAME` (the profile of a shared study), and `autotune report ...
--out DIR` (report.py: charts comparing studies).

Every error a user can cause ends as one line on stderr and a non-zero exit code:
1 bad input or an unusable file, 2 bad usage, 3 nothing fits the budget (or can be picked within it), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shlex
import sys
import threading
from pathlib import Path

from .measure import (MAX_TIMED_CALLS, MAX_WARMUP_CALLS, SPREAD_LIMIT, STEADY, TIMED_CALLS, TRIAL_TIMEOUT_S, WARMUP_CALLS,
                      timed_calls_cap)
from .storages import (DEFAULT_WORKDIR, WORKDIR_HINT, check_file, check_opens, default_storage, display_url,
                       export_command, keeps_nothing, open_storage, storage_file)

EXIT_ERROR, EXIT_USAGE, EXIT_NO_FIT, EXIT_INTERRUPTED = 1, 2, 3, 130
# A study name is a folder's name (trials, compile cache): 255 bytes (NAME_MAX) on Linux and macOS,
# less headroom for what a name might get added later
MAX_STUDY_NAME_BYTES = 200
PROFILE_COMMANDS = ("show", "verify")


class UsageError(Exception):
    """Bad usage that only shows once the model or budget is known: exit 2, as argparse's."""


class Parser(argparse.ArgumentParser):
    """Every autotune command's parser (report's too): an error is one line and exit 2, and a
    negative size is a value to refuse, not an option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Let "--vram -1GB" reach the size parser (and its clear error) instead of argparse
        # taking "-1GB" for an option: argparse only treats plain numbers as negative values.
        # "%" too: "--margin -5%" gets the margin's error, not "expected one argument".
        self._negative_number_matcher = re.compile(r"^-\d+(\.\d+)?[A-Za-z]*%?$")

    def error(self, message):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _whole_number(text: str, least: int, most: int | None = None, most_text: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if most is not None and not least <= value <= most:
        raise argparse.ArgumentTypeError(f"must be from {least} to {most_text or most}, got {value}")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1)


def a_path(text: str) -> Path:
    """A path option's value: an empty one would be Path(""), the current folder, and be refused
    as "." is a folder, naming no option the user wrote."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a path")
    return Path(text)


def a_storage_url(text: str) -> str:
    """--storage's value: an empty one would fall back to the default storage unsaid."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a storage URL, or leave the option out for the default")
    return text


def _device(text: str) -> str:
    """--device's value as written: a name autotune does not know is bad usage (exit 2), before
    anything loads; whether the device is usable here is _resolve_device's to say."""
    from .fingerprint import is_device_name

    if text != "auto" and not is_device_name(text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a device: expected cuda, cuda:N or cpu")
    return text


def _rounds(text: str) -> int:
    return _whole_number(text, 0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):  # float() takes "nan" and "inf", and nan <= 0 is False
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _margin(text: str) -> str:
    from .sizes import parse_margin, require_unit

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"margin '{text}' is negative: it is memory kept free under "
                                         "the budget (examples: 5%, 512MB, 0)")
    try:
        require_unit(text, ("%", "GB"), "5%, 512MB, 0")  # "5" would be 5 bytes: no margin at all
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
    if not math.isfinite(value):  # nan < 0 is False: it would pass, and compare false with every PSNR
        raise argparse.ArgumentTypeError(f"must be a finite number of dB (or 'auto'), got {text}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more, got {text}")
    from .quality import PSNR_CAP_DB

    if value > PSNR_CAP_DB:  # no output could pass: every config would be "infeasible"
        raise argparse.ArgumentTypeError(f"{text} dB is above what any output scores ({PSNR_CAP_DB:g} dB: "
                                         "identical to the reference)")
    return value


def _sampler_seed(text: str) -> int:
    # numpy's generator, under Optuna's samplers, takes no other
    return _whole_number(text, 0, 2**32 - 1, f"2**32 - 1 ({2**32 - 1})")


def _size(text: str) -> int:
    from .sizes import parse_budget

    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def measurement_defaults() -> dict:
    """How `autotune` measures unless told otherwise, read from its parser: benchmarks hold their
    contestants to exactly these. Keys as TuneRequest names them, and the margin."""
    p = tune_parser()
    return {"margin": p.get_default("margin"), "repeats": p.get_default("repeats"),
            "max_calls": timed_calls_cap(p.get_default("max_calls"), p.get_default("repeats")), "spread_limit": p.get_default("spread"),
            "warmup": p.get_default("warmup"), "confirm_rounds": p.get_default("confirm")}


def tune_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="autotune",
        description="Find the fastest diffusers configuration that fits a memory budget, by "
        "measuring each candidate in its own process; write it as a profile production loads.",
        epilog="Other commands: autotune show PROFILE | autotune verify PROFILE | "
        "autotune export --study-name NAME [--storage URL] | autotune report ... --out DIR",
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"autotune {__version__}")
    m = p.add_argument_group("model and workload (defaults come from the model)")
    m.add_argument("--model", default="tiny-sdxl", help="an alias (sdxl, sd15, sd3, flux-dev, "
                   "flux-schnell, tiny-sdxl, ...), a hub id in the local cache, or a local "
                   "pipeline directory (default: tiny-sdxl, offline)")
    m.add_argument("--random-weights", action="store_true",
                   help="build the full-size architecture with random weights (no download; the "
                   "tiny models have random weights already)")
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
    b.add_argument("--device", type=_device, default="auto", help="cuda, cuda:N or cpu (default: cuda if usable)")
    b.add_argument("--gpus", type=_gpu_list, metavar="0,1,...",
                   help="one worker per GPU, each trial pinned to its worker's GPU, all in one study "
                   "(the GPUs must be of one model)")
    s = p.add_argument_group("search")
    s.add_argument("--space", type=a_path, help="a search-space YAML (default: the model family's)")
    s.add_argument("--list-knobs", action="store_true",
                   help="print the search space as it stands on this machine, and exit")
    s.add_argument("--trials", type=_positive_int, default=16,
                   help="measured trials the study should hold (default 16)")
    s.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                   help="start no new trial after this long")
    s.add_argument("--patience", type=_positive_int, metavar="N",
                   help="stop early when the best has not improved by 1%% in N measured trials (not while memory "
                   "repair has a step to measure, nor while a queued config waits)")
    s.add_argument("--confirm", type=_rounds, default=2, metavar="ROUNDS",
                   help="once the search stops, measure the fastest feasible configs (up to 3, the "
                   "baseline if it is close or was timed under load, any whose one figure beats them) "
                   "again this many times each, in alternation, and up to 3 timed only beside busy "
                   "neighbours (twice at least); the pick is the lowest median, or the config with "
                   "fewest changes whose median is no higher than the fastest's slowest trial; a "
                   "faster config never measured again is picked on its one figure (default 2; 0: "
                   "keep the lowest single measurement)")
    s.add_argument("--trial-timeout", type=_positive_float, default=TRIAL_TIMEOUT_S, metavar="SECONDS",
                   help=f"kill a trial after this long (default {TRIAL_TIMEOUT_S:g})")
    s.add_argument("--repeats", type=_positive_int, default=TIMED_CALLS,
                   help="timed calls per trial at least; more, up to --max-calls, until the last "
                   f"REPEATS agree within --spread (default {TIMED_CALLS})")
    s.add_argument("--max-calls", type=_positive_int,
                   help=f"timed calls per trial at most (default {MAX_TIMED_CALLS}, or REPEATS when more)")
    s.add_argument("--spread", type=_positive_float, default=SPREAD_LIMIT, metavar="FRACTION",
                   help=f"(max - min) / median the last REPEATS calls must be under (default {SPREAD_LIMIT:g})")
    s.add_argument("--warmup", type=_positive_int, default=WARMUP_CALLS,
                   help=f"untimed calls per trial at least; more (up to {MAX_WARMUP_CALLS}) until two agree "
                   f"within {STEADY * 100:g}%% (default {WARMUP_CALLS})")
    s.add_argument("--threads", type=_positive_int,
                   help="CPU threads of every trial, fixed and recorded (default: torch's default here)")
    s.add_argument("--min-psnr", type=_min_psnr, default="auto", metavar="DB",
                   help="quality guard: reject configurations whose fixed-seed output is further "
                   "than this PSNR (dB) from the float32 reference; 'auto' (default) calibrates it "
                   "on what bfloat16 alone does, less 6 dB; lower it to let lossy settings in; 0 "
                   "turns the guard off")
    s.add_argument("--warm-start", action="append", default=[], metavar="PROFILE_OR_STUDY",
                   help="measure first the front of an earlier study (another budget, a similar "
                   "GPU): a profile file, NAME@STORAGE_URL, or a study NAME in --storage; repeatable")
    s.add_argument("--sampler-seed", type=_sampler_seed, help="seed of the sampler, for repeatable runs")
    s.add_argument("--launcher", choices=("fork", "spawn"),
                   help="start trials forked from a preloaded server (fast) or as fresh "
                   "interpreters (default: fork on a CPU, spawn on a GPU)")
    o = p.add_argument_group("storage and output")
    o.add_argument("--storage", type=a_storage_url, help="Optuna storage URL (default: sqlite:///WORKDIR/studies.db); "
                   "journal:PATH for a journal file")
    o.add_argument("--workdir", type=a_path, default=DEFAULT_WORKDIR,
                   help="the studies' working files: trial folders, the compile cache, and the "
                   f"default storage (default: {DEFAULT_WORKDIR})")
    o.add_argument("--study-name", help="share or resume a study by name (default: derived "
                   "from model, workload, budget, margin, threads, quality threshold, device and space)")
    o.add_argument("--output", "-o", type=a_path,
                   help="profile path, its folders made as needed (default: MODEL-BUDGET.yaml in the "
                   "current folder)")
    o.add_argument("--no-profile", action="store_true",
                   help="measure only (a worker of a shared study); write the profile later with "
                   "autotune export")
    # Given by --gpus to its workers, after the user's own options: a worker measures and writes
    # nothing, whatever --gpus, --output or an abbreviation of them the command held.
    o.add_argument("--as-gpus-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of GPU indices such as 0,1") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"'{text}': expected distinct GPU indices such as 0,1")
    return gpus


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from .errors import AutotuneError, os_reason

    try:  # from the first line: a Ctrl-C while it imports is "interrupted" too, not a traceback
        terminate_as_interrupt()
        _quiet_libraries()  # imports optuna (0.1-0.2 s)
        if argv and argv[0] in PROFILE_COMMANDS:
            return _profile_command(argv)
        if argv and argv[0] == "export":
            return _export(argv[1:])
        if argv and argv[0] == "report":
            from .report import main as report_main

            return report_main(argv[1:])
        if argv and not argv[0].startswith("-"):  # the tuning run takes options only
            raise UsageError(f"unknown command {argv[0]!r} (commands: show, verify, export, report; or "
                             "tune with options such as --model)")
        _stop_when_gpus_parent_dies()
        return _tune(tune_parser().parse_args(argv), argv)
    except UsageError as exc:  # the help of the command given (export's -o is not the run's)
        command = f"autotune {argv[0]}" if argv and argv[0] in (*PROFILE_COMMANDS, "export", "report") else "autotune"
        print(f"autotune: error: {exc} (see {command} --help)", file=sys.stderr)
        return EXIT_USAGE
    except AutotuneError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        STOPPING.set()  # to the process's end: main's return, then stop_signals_exit_with
        print("autotune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if not _stdout_failed(exc):
            raise  # another file's: not to be hidden
        # Point stdout at /dev/null, as Python's docs advise after a broken pipe: its flush at
        # exit would fail again, with a message of its own.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if exc.errno != errno.EPIPE:  # closed early (`autotune export | head -1`): nothing to say
            print(f"autotune: error: cannot write the output: {os_reason(exc)}", file=sys.stderr)
        return EXIT_ERROR


def _stdout_failed(exc: OSError) -> bool:
    """Whether `exc` came from stdout: a pipe closed early, a full disk or a dead terminal
    (`autotune show p.yaml > /dev/full` ended in rich's traceback; helper-11), told by writing
    one byte to it: Python's buffer drops what it failed to write, so a flush says nothing. An
    error of another file's (helper-14: a forkserver's socket must not pass for stdout) then
    gets its traceback after a blank line."""
    if exc.errno not in (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EIO):
        return False
    try:
        os.write(sys.stdout.fileno(), b"\n")
    except (ValueError, AttributeError):  # closed, or an object without a file (io.UnsupportedOperation)
        return False
    except OSError:
        return True
    return False


INTERRUPTED = threading.Event()  # set once a stop signal has come: the run is stopping
# Set where autotune has caught the stop and cleans up outside an except block (a --gpus parent
# waiting for its workers, main's return): later signals are ignored from there on.
STOPPING = threading.Event()


def terminate_as_interrupt() -> None:
    """SIGTERM (kill, a container stopping, a job scheduler) and SIGHUP (the terminal closed) end
    a run as Ctrl-C does: the running trial's process group killed, the trial queued again,
    measured trials kept. Left at their default, they killed the parent alone and left the
    trial's process (or --gpus' workers) running, unsupervised.
    The benchmarks call it too: stopped by `timeout`, they stop their trial the same way."""
    import signal

    def interrupt(signum, frame):
        # A second signal (Ctrl-C pressed twice; `timeout` signals the process, then its group)
        # while the first is being handled is ignored: raised inside the clean-up (the trial's
        # group killed, the trial queued again) it would cut that short, or come after the exit
        # message as a traceback. Elsewhere it raises: the first may not have stopped anything.
        if INTERRUPTED.is_set() and (STOPPING.is_set() or _handling_an_interrupt()):
            return
        INTERRUPTED.set()
        raise KeyboardInterrupt

    def unraisable(info, previous=sys.unraisablehook):
        # Raised inside a __del__ or a weakref callback, a KeyboardInterrupt is only printed by
        # Python ("Exception ignored in ..."), and the run went on: delivered again, from another
        # thread, so that it reaches the main thread's code once the callback has ended (called
        # from here, it would be raised inside this hook, and dropped again).
        if isinstance(info.exc_value, KeyboardInterrupt):
            threading.Timer(0.01, redeliver).start()
        else:
            previous(info)

    def redeliver():
        # A real signal to the main thread, not _thread.interrupt_main: that one only flags the
        # interrupt, and a main thread blocked in a call (a sleep, a wait) slept on to its end.
        # Sent only while our handler holds it: at exit Python puts the default back, which kills.
        # (any call's handler: the hook is installed once per process, the handler by each call)
        if getattr(signal.getsignal(signal.SIGTERM), "autotune_interrupt", False):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    interrupt.autotune_interrupt = True
    unraisable.redelivers_interrupts = True
    if threading.current_thread() is threading.main_thread():
        if not getattr(sys.unraisablehook, "redelivers_interrupts", False):  # once per process
            sys.unraisablehook = unraisable
        signal.signal(signal.SIGTERM, interrupt)
        # a closed terminal or SSH session: --gpus workers run in sessions of their own and hear
        # of it only from here
        signal.signal(signal.SIGHUP, interrupt)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored
            signal.signal(signal.SIGINT, interrupt)  # Python's own, and the record that it came


def _handling_an_interrupt() -> bool:
    """Whether the main thread is in an except or finally block of a KeyboardInterrupt (or of an
    exception raised while handling one)."""
    exc = sys.exc_info()[1]
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def stop_signals_exit_with(code: int) -> None:
    """Once a command has ended (its trials kept, its profile written or not): a stop signal while
    the interpreter shuts down (threads, a storage's connections, atexit) exits at once with the
    command's code. terminate_as_interrupt's handler raised KeyboardInterrupt there, a traceback
    after the last line, or exit -2 where it came before sys.exit. (Past Python's own
    finalization, which puts these signals back to their default, a signal still ends the process
    as killed by it: left so, as ignoring them there would leave a hung teardown, CUDA's say, to
    SIGKILL alone.)"""
    import signal

    def exit_now(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: exit all the same
                stream.flush()
        os._exit(code)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # one a script's shell ignores stays so
                signal.signal(sig, exit_now)


# Set by _tune_on_gpus for its workers (and taken out of the environment before their trials start).
GPUS_PARENT_ENV = "AUTOTUNE_GPUS_PARENT"


def _stop_when_gpus_parent_dies() -> None:
    """A --gpus worker whose parent is gone (SIGKILL, OOM killer) stops as on SIGTERM: its trial's
    group killed, the trial queued again. Its own session keeps it out of the parent's signals, so
    left alone it would measure on, unsupervised, beside the workers of the rerun command.
    If the stop does not end it within a minute, its group is killed. No SIGTERM when a stop
    signal came already: a second KeyboardInterrupt could break the clean-up under way."""
    import os
    import signal
    import time

    from . import worker

    def stop():
        if not INTERRUPTED.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        worker.kill_own_group()

    worker.watch_parent(os.environ.pop(GPUS_PARENT_ENV, None), stop)


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
    # torchao 0.18 registers its enums with torch 2.13's pytree, which warns at import that this
    # is deprecated: a notice for torchao's developers, printed on every run that lists knobs
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # An xFormers built for another torch logs 7 lines at import; --list-knobs and the header say
    # in one line that it is dropped, and why (knobs.attention._xformers_unusable)
    logging.getLogger("xformers").setLevel(logging.ERROR)
    # A warning that does show (a profile from another machine, say) is one line for the user,
    # not Python's file:line and source line of the call that warned.
    import warnings

    warnings.showwarning = _one_line_warning
    # a library compiled on its first import (installed without bytecode, as pip --no-compile
    # does) warns of its own source's escapes: torchao's "invalid escape sequence '\.'" read as
    # autotune's
    warnings.filterwarnings("ignore", category=SyntaxWarning)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"autotune: warning: {message}", file=file or sys.stderr)


# ---- tune --------------------------------------------------------------------------------------
def _resolve_device(name: str) -> str:
    from .errors import AutotuneError
    from .fingerprint import cuda_available, device_problem

    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if problem := device_problem(name):
        raise AutotuneError(f"--device {name}: {problem}")
    return name


def _study_name(spec, workload, budget, device, space, margin: int, threads: int, min_psnr) -> str:
    from .sizes import short_size

    # What the stored results depend on: a change starts another study instead of mixing them. The
    # device's type only, as a study holds it (study.DEFINING): cuda and cuda:1 name one study, which
    # any GPU of its model may join.
    device_type = device.split(":")[0]
    ident = json.dumps(
        [spec.to_dict(), workload.to_dict(), budget, margin, threads, min_psnr, device_type,
         [[d.name, list(d.choices), d.when] for d in space.dimensions], space.forbid],
        sort_keys=True, default=str,
    )
    digest = hashlib.sha1(ident.encode()).hexdigest()[:8]
    w = workload
    kind = "-random" if spec.kind == "random" else ""
    return (f"{Path(spec.name).name}{kind}-{device_type}-{short_size(budget)}"
            f"-{w.height}x{w.width}-{w.steps}s-b{w.batch_size}-{digest}")


def _tune(args, argv: list[str]) -> int:
    from . import console, fingerprint
    from .knobs import Target
    from .models import check_weights_here, resolve_model
    from .runner import default_launcher
    from .study import TuneRequest, tune

    _check_contradictions(args)
    spec = resolve_model(args.model, random_weights=args.random_weights)
    if args.gpus:
        _check_gpus(args.gpus)
    device = _resolve_device("cuda" if args.gpus else args.device)
    # the GPU whose facts (capability, model, memory) the study records: the first of --gpus,
    # as its workers see it, not GPU 0, which --gpus may leave out (all of --gpus are one model)
    measured_on = f"cuda:{args.gpus[0]}" if args.gpus else device
    workload = _workload_from(args, spec)
    target = Target(device=device, family=spec.family, capability=fingerprint.capability(measured_on), workload=workload)
    space = _space_here(args, spec, target)
    if not args.list_knobs:  # a listing needs the family alone, not the weights
        check_weights_here(spec)

    # --list-knobs too: an option the run would refuse is refused before the listing
    machine = {**fingerprint.machine(measured_on), "device": device}
    budget, margin, threads = _budget_margin_threads(args, machine)
    if args.study_name is not None:
        _check_study_name(args.study_name)
    study_name = args.study_name or _study_name(spec, workload, budget, device, space,
                                                margin=margin, threads=threads, min_psnr=args.min_psnr)
    _check_study_name(study_name, given=False)  # a default one too: it names folders
    # read before anything is made: a source that does not read leaves no storage file behind
    warm_start = _warm_start_configs(args.warm_start, args.storage or default_storage(args.workdir), spec.name)
    if args.list_knobs:
        _check_listing_options(args, study_name)
        console.print_space(space, target)
        return 0
    with _undone_if_refused(args.workdir, args.output):
        storage, output = _storage_and_output(args, spec, budget)
        check_opens(storage)  # a server that does not answer, a driver not installed: said before the search
        request = TuneRequest(
            spec=spec, workload=workload, budget_bytes=budget, space=space, target=target,
            storage=storage, study_name=study_name, trials=args.trials, workdir=args.workdir / "trials" / study_name,
            timeout_s=args.timeout, patience=args.patience, trial_timeout_s=args.trial_timeout,
            margin=args.margin,
            repeats=args.repeats, max_calls=timed_calls_cap(args.max_calls, args.repeats), spread_limit=args.spread,
            warmup=args.warmup, threads=threads, seed=args.sampler_seed, min_psnr_db=args.min_psnr or None,
            launcher=args.launcher or default_launcher(device),
            compile_cache_dir=(args.workdir / "compile-cache" / study_name).resolve(),
            warm_start=warm_start,
            hardware=machine["name"], machine=machine, confirm_rounds=args.confirm,
        )
        earlier = {} if args.study_name else _earlier_studies(request)
        replaced = output and _check_output_replaceable(output, study_name, not args.output, earlier)
    out = console.terminal()
    console.print_header(out, request, space)
    _print_notes(out, request, machine, earlier)
    if replaced:
        out.print(f"note: {output} holds the profile of study {replaced}: this run's profile will replace it")
    if args.gpus:
        return _tune_on_gpus(out, request, args, argv, output)
    try:  # to the profile's rename: stopped while it is written, the same command writes it
        with console.TrialProgress(out, request.trials) as progress:
            outcome = tune(request, on_trial=progress.update, on_confirm=progress.confirmed, on_step=progress.step,
                           on_start=progress.start)
        console.print_summary(out, outcome, budget, request.margin_bytes)
        console.print_share(out, outcome)
        return _write_profile(out, request, outcome, output, default_named=not args.output)
    except KeyboardInterrupt:
        _print_interrupted(storage, study_name)
        return EXIT_INTERRUPTED


def _check_contradictions(args) -> None:
    """Options that contradict each other, refused before anything is loaded; a --gpus worker's
    own options (whatever its parent's command held) set."""
    if args.as_gpus_worker:
        args.gpus, args.output, args.no_profile = None, None, True
    if not args.model.strip():
        raise UsageError("--model is empty: name an alias (sdxl, tiny-sdxl, ...), a hub id or a folder")
    if args.no_profile and args.output:
        raise UsageError("--output names the profile, which --no-profile does not write: give one of them")
    if args.max_calls is not None and args.max_calls < args.repeats:
        # not given, --max-calls rises to --repeats; given, it is a contradiction
        raise UsageError(f"--max-calls {args.max_calls} is below --repeats {args.repeats}: a trial makes at "
                         "least --repeats timed calls")
    if args.gpus and args.device not in ("auto", "cuda"):
        raise UsageError(f"--gpus runs every worker on a GPU: --device {args.device} contradicts it")


def _workload_from(args, spec):
    """The model's default workload, with the size, steps, batch, prompt and seed given."""
    from dataclasses import replace

    from .models import FAMILIES

    overrides = {k: getattr(args, k) for k in ("height", "width", "steps", "batch_size", "prompt", "seed")}
    workload = replace(spec.default_workload, **{k: v for k, v in overrides.items() if v is not None})
    _check_image_size(spec, workload)
    try:  # what no pipeline call could run (a seed torch's generator refuses)
        workload.check(FAMILIES[spec.family].pixel_multiple)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    return workload


def _space_here(args, spec, target):
    """The search space (--space, or the model family's) restricted to this machine; an error
    where it leaves nothing to search (unless --list-knobs, which shows why)."""
    from .errors import AutotuneError
    from .space import SearchSpace

    space = SearchSpace.from_file(args.space) if args.space else SearchSpace.for_model(spec)
    if args.gpus:  # restricted as each worker sees the machine: its GPU alone (no balanced placement)
        from .runner import environment

        with environment(CUDA_VISIBLE_DEVICES=_gpu_names(args.gpus)[args.gpus[0]]):
            space = space.restrict(target)
    else:
        space = space.restrict(target)
    if args.list_knobs:
        return space
    if not space.allows_a_config(besides_the_baseline=True):  # the baseline alone: a study would call it the best
        if space.dimensions:
            raise AutotuneError(f"search space {space.source}: its 'forbid' rules and the known conflicts leave "
                                "no configuration beyond the baseline to measure" +
                                (f" on this machine ({'; '.join(map(str, space.dropped))})" if space.dropped else ""))
        if not space.dropped:
            raise AutotuneError(f"search space {space.source}: it lists no choice beyond the baseline's")
        raise AutotuneError(f"search space {space.source}: no choice to search on this machine "
                            f"({'; '.join(map(str, space.dropped))}); see --list-knobs")
    return space


def _budget_margin_threads(args, machine: dict) -> tuple[int, int, int]:
    """The budget in bytes (the device's memory without --vram), the margin in bytes, and the CPU
    threads of every trial; a usage error where nothing could fit or the cores are too few."""
    from .sizes import format_size, parse_margin

    # no --vram: the machine's memory, in whole MiB, so that the profile's name stays short
    budget = args.budget or machine["memory_bytes"] // 2**20 * 2**20
    margin = parse_margin(args.margin, budget)
    if margin >= budget:  # no peak could fit: every trial would be measured for nothing
        raise UsageError(f"--margin {args.margin} is not under the budget {format_size(budget)}: "
                         "nothing could fit")
    return budget, margin, _threads(args)


def _threads(args) -> int:
    """The CPU threads of every trial; a usage error where the cores are too few."""
    import torch

    from . import fingerprint

    threads = args.threads or torch.get_num_threads()
    cores = fingerprint.usable_cores()
    if threads > cores:  # every call would fight for the cores: trials time out, nothing is learnt
        raise UsageError(f"--threads {threads}: autotune may use {cores} CPU cores here")
    return threads


def _storage_and_output(args, spec, budget: int) -> tuple[str, Path | None]:
    """The storage URL and the profile's path (None with --no-profile), each checked before a
    trial: the work folder takes files, the storage keeps them, the profile's path takes one."""
    # The trials' files and compile cache live here even with --storage: check it before a trial.
    _check_folder(args.workdir)  # and makes it, for SQLite to create its file in
    storage = args.storage or default_storage(args.workdir)
    _check_storage_keeps(storage)
    output = None if args.no_profile else args.output or default_profile_path(spec, budget)
    if output is not None:
        # The profile is written after the search: a path that takes no file fails now, not then,
        # and before the storage is opened (a SQLite file made) for a run that cannot end well.
        from .profile import check_writable

        _check_not_the_storage(output, storage)
        check_writable(output)
    return storage, output


def _check_listing_options(args, study_name: str) -> None:
    """The options given to --list-knobs that the run would refuse: the storage, the work
    folder, the output path. Those given only: a listing writes nothing, and runs in a folder it
    cannot write to (where the run's defaults would be refused). Not check_opens: that makes the
    SQLite or journal file, and waits out a server that does not answer."""
    from .profile import check_writable

    storage = args.storage or default_storage(args.workdir)
    workdir = args.workdir if Path(args.workdir) != Path(DEFAULT_WORKDIR) else None
    with _undone_if_refused(workdir, args.output, always=True):  # what the checks make, removed
        if workdir is not None:
            _check_folder(workdir)
        if args.storage:
            _check_storage_keeps(storage)
            check_file(storage, must_exist=False)  # the URL, and no folder in its place
        if args.output:  # a file that is no profile (the default name's other run is no option given)
            _check_not_the_storage(args.output, storage)
            check_writable(args.output)
            _check_output_replaceable(args.output, study_name, default_named=False)


def _print_notes(out, request, machine: dict, earlier: dict) -> None:
    """What the header should add: a budget nothing binds on this machine, and earlier studies
    of the same model, size and budget measured under other settings."""
    from . import console
    from .sizes import format_size

    if request.budget_bytes - request.margin_bytes > machine["memory_bytes"]:  # allowed (a bigger machine's)
        whose = "this GPU's" if request.target.is_cuda else "this machine's"
        out.print(f"note: the budget {format_size(request.budget_bytes)}, less its margin, is more than {whose} "
                  f"memory ({format_size(machine['memory_bytes'])}): every configuration that runs fits it")
    for name, (trials, differences) in earlier.items():
        held = f"this storage holds study {name} ({console.count(trials, 'measured trial')})"
        if differences is None:
            out.print(f"note: {held} of these very settings, named with its GPU's index as autotune named studies "
                      f"before: this run starts a new study; --study-name {name} resumes that one")
            continue
        out.print(f"note: {held} of the same model, size and budget, measured under other settings "
                  f"({differences}): this run starts a new study; --warm-start {name} would measure that "
                  "study's best configurations first")


def _check_image_size(spec, workload) -> None:
    """Height and width the pipeline takes, checked before the study: else every trial, and the
    reference call first, fails inside diffusers' check_inputs."""
    from .models import FAMILIES

    multiple = FAMILIES[spec.family].pixel_multiple
    for name in ("height", "width"):
        value = getattr(workload, name)
        if value % multiple:
            lower = value - value % multiple
            near = f"{lower} or {lower + multiple}" if lower else str(multiple)
            raise UsageError(f"--{name} {value}: {spec.name} ({spec.family}) takes multiples of "
                             f"{multiple} pixels, such as {near}")


def default_profile_path(spec, budget: int) -> Path:
    """MODEL-BUDGET.yaml in the current folder, for tune and export alike."""
    from .sizes import short_size

    return Path(f"{Path(spec.name).name}-{short_size(budget)}.yaml")


def _check_output_replaceable(output: Path, study_name: str, default_named: bool,
                              earlier: dict[str, tuple[int, str]] | None = None, exporting: bool = False) -> str | None:
    """Whether this study's profile may replace what `output` holds; checked before the search and
    again as the profile is written. A file autotune does not read as a profile (a newer
    autotune's, or a file of the user's) is refused, unless it names this very study. The profile
    of another study is refused at the default name, which says model and budget only: a run of
    another workload, seed or threshold would silently replace the profile a server may be
    loading (what differs is said where that study is one of `earlier`, _earlier_studies). A name
    given with -o is the user's choice: the other study's name is returned, for a note.
    `exporting`: said of the study `autotune export` writes, not of a run."""
    from .errors import AutotuneError, first_line
    from .profile import load_profile

    if not output.is_file() or output.stat().st_size == 0:  # an empty file (mktemp's) holds nothing to lose
        return None
    this = "the exported study" if exporting else "this run"
    mine = "its profile" if exporting else "this run's profile"
    instead = f"name {mine} with -o" if default_named else "name another file with -o"
    try:
        held = load_profile(output, check_fingerprint=False).data["study"]["name"]
    except (AutotuneError, KeyError, TypeError) as exc:
        if _study_named_in(output) == study_name:
            return None  # this study's, by an autotune that wrote it otherwise: this run writes it anew
        raise AutotuneError(f"{output} holds a file this autotune does not read as a profile "
                            f"({first_line(exc)}); {instead}, or move the file away") from None
    if held == study_name:
        return None
    if not default_named:
        return held
    differences = (earlier or {}).get(held)
    why = f", measured under other settings ({differences[1]})" if differences and differences[1] else ""
    raise AutotuneError(f"{output} holds the profile of another run (study {held}{why}); {this} is "
                        f"study {study_name}: {instead}, or move the file away")


def _study_named_in(path: Path) -> str | None:
    """The study name a YAML file records where a profile does (study.name), read as plain YAML."""
    from .errors import AutotuneError, read_yaml

    try:
        return read_yaml(path, "profile", AutotuneError)["study"]["name"]
    except (AutotuneError, KeyError, TypeError):
        return None


def _earlier_studies(request) -> dict[str, tuple[int, str]]:
    """Studies in the request's storage whose default name says the same model, device, budget,
    size, steps and batch as this new, default-named one, but whose settings differ (another
    digest: after an autotune update that changed the shipped space, the same command starts a
    new study): name -> (measured trials, what differs; None for a study of these very settings
    named with its GPU's index, as default names were before). Empty when this study exists
    already, or the storage holds nothing yet."""
    import optuna

    from .errors import AutotuneError
    from .study import differences_from, summarize

    prefix = request.study_name.rsplit("-", 1)[0] + "-"
    # before 2026-11-25 a default name held the GPU's index too ("-cuda1-"): such a study is of
    # this model, size and budget as well
    before = re.compile(re.escape(prefix).replace(re.escape("-cuda-"), r"-cuda\d+-", 1) + "[0-9a-f]{8}")
    try:
        backend = open_storage(request.storage, existing=True)
        names = optuna.get_all_study_names(backend)
    except AutotuneError:
        return {}  # no storage file yet: nothing earlier
    if request.study_name in names:
        return {}  # a resume
    out = {}
    for name in names:
        same_prefix = name.startswith(prefix) and len(name) == len(request.study_name)
        if not same_prefix and not before.fullmatch(name):
            continue
        other = optuna.load_study(study_name=name, storage=backend)
        if not other.user_attrs.get("request"):
            continue  # not autotune's, or set up by no run yet
        differences = differences_from(other, request)
        if not differences and same_prefix:
            # the name's digest also holds the space's forbid rules, which a study does not record
            differences = "the search space's forbid rules"
        out[name] = (len(summarize(other).records), differences or None)  # None: this study, named before
    return out


def _check_study_name(name: str, given: bool = True) -> None:
    """The name is a folder under --workdir (trials, compile cache): it must stay one folder
    there. `given`: by --study-name; autotune's own (from a model's folder name) can only be too long."""
    if given:
        if not name.strip():
            raise UsageError("--study-name is empty: name the study, or leave the option out for the default")
        if not name.isprintable():  # a newline split the header, and the folder's name
            raise UsageError(f"--study-name {name!r}: a study name is one line of printable text")
        if "/" in name or os.sep in name or name in (".", ".."):
            raise UsageError(f"--study-name {name!r}: a study name is one folder name, without '/'")
    size = len(name.encode())  # in bytes, as a folder's name is held to
    if size > MAX_STUDY_NAME_BYTES:
        which = "--study-name" if given else f"the default study name {name[:60]}..."
        raise UsageError(f"{which} is {size} bytes long (UTF-8): a study name names a folder, of "
                         f"{MAX_STUDY_NAME_BYTES} bytes at most" + ("" if given else ": give --study-name"))


@contextlib.contextmanager
def _undone_if_refused(workdir: Path | None, output: Path | None, always: bool = False):
    """The folders the checks before a search make (the work folder, the profile's missing
    folders), removed again where a check then refuses the run (an error raised, or a non-zero
    exit code put in the list it yields), those left empty: a storage that does not answer left
    `-o a/b/p.yaml`'s folders and the work folder behind. (A storage file made meanwhile stays:
    another worker may be writing to it already.) `always`: removed however it ends (the checks
    of --list-knobs, which writes nothing)."""
    missing = []
    for path in filter(None, [workdir, output and Path(output).parent]):
        for folder in [path.absolute(), *path.absolute().parents]:
            if folder.exists() or folder.is_symlink():
                break
            missing.append(folder)

    def undo():
        for folder in sorted(set(missing), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # one that holds something stays
                folder.rmdir()

    returned = []
    try:
        yield returned
    except BaseException:
        undo()
        raise
    if always or returned and returned[0] != 0:
        undo()


def _check_storage_keeps(storage: str) -> None:
    """An in-memory storage keeps nothing: the trials would be lost when the run ends."""
    if keeps_nothing(storage):
        raise UsageError(f"--storage {storage} keeps nothing after the run: give a file "
                         "(sqlite:///PATH, journal:PATH) or a database server")


def _check_not_the_storage(output: Path, storage: str) -> None:
    kept = storage_file(storage)
    if kept is not None and output.resolve() == kept.resolve():
        raise UsageError(f"--output {output} is the study's storage {storage}: writing the profile "
                         "there would destroy the measured trials")


def _check_folder(folder: Path) -> None:
    """The folder exists, or can be made, and takes a new file: one line now, not a traceback when
    the storage or the first trial writes there (run from /proc, a read-only mount)."""
    from .errors import AutotuneError, why_unwritable

    reason = why_unwritable(folder)
    if reason:
        raise AutotuneError(
            f"cannot write {folder.absolute()} ({reason}): autotune keeps its trials' files there, "
            "and its default storage; give --workdir a writable folder")


def _write_profile(out, request, outcome, output: Path | None, default_named: bool = False) -> int:
    """Write the study's profile to `output` (None: --no-profile, which says how to export it),
    or say why there is none. `output` is checked (again) as it is written: another run may have
    written there while this one searched (_check_output_replaceable; `default_named`: not -o)."""
    from . import profile as profile_io
    from .errors import AutotuneError

    if outcome.best is None:
        nothing_picked, why = outcome.why_no_best(request.budget_bytes, request.margin_bytes, request.margin)
        print(f"autotune: error: {why}; no profile written", file=sys.stderr)
        return EXIT_NO_FIT if nothing_picked else EXIT_ERROR
    if output is None:
        out.print(f"no profile written (--no-profile): {export_command(request.study_name, request.storage)}")
        return 0
    document = profile_io.build(request, outcome, storage_label=display_url(request.storage))
    profile_io.validate(document, output)  # never a file load_profile refuses (a study's request edited)
    try:
        replaced = _check_output_replaceable(output, request.study_name, default_named)
        path = profile_io.save(document, output)
    except AutotuneError as exc:  # checked before the search, yet the file can change meanwhile
        raise AutotuneError(f"{exc}; the measured trials are kept: "
                            f"{export_command(request.study_name, request.storage)} -o OTHER.yaml") from None
    shown = shlex.quote(str(path))
    if replaced:
        out.print(f"replaced the profile of study {replaced} in {path}")
    out.print(f"profile written: {path}  (autotune show {shown} reads it, autotune verify {shown} replays it; "
              f"serve it with autotune.load_profile({str(path)!r}))")
    return 0


def _print_interrupted(storage: str, study_name: str) -> None:
    print(f"autotune: interrupted: the measured trials are kept in {display_url(storage)} (study {study_name}); "
          "run the same command to resume", file=sys.stderr)


def _warm_start_configs(sources: list[str], storage: str, model: str) -> list[dict]:
    """The configs of earlier fronts: from profile files, or from studies (NAME@URL or NAME). A
    warning when one was measured on another model than `model` (allowed: a fine-tune of it)."""
    import warnings

    from .errors import AutotuneError, os_reason
    from .profile import load_profile
    from .storages import study_and_storage
    from .study import summarize
    import optuna

    def check_model(source: str, measured: str | None) -> None:
        if measured and measured != model:
            warnings.warn(f"--warm-start {source}: measured on {measured}, not {model}: its configs are "
                          "measured here as any others", stacklevel=3)

    configs: list[dict] = []
    for source in sources:
        try:
            a_file = Path(source).exists() and not Path(source).is_dir()  # load_profile refuses a device or a FIFO
        except OSError as exc:  # a folder on the way this user may not search
            raise AutotuneError(f"--warm-start {source}: cannot read it ({os_reason(exc)})") from None
        if a_file:
            profile = load_profile(source)
            check_model(source, profile.model.name)
            configs += [point["config"] for point in profile.data.get("pareto") or [profile.data["best"]]]
            continue
        # NAME@STORAGE as report reads it (a name may hold '@'), or NAME in this run's storage
        name, url = study_and_storage(source) or (source, None)
        try:
            study = optuna.load_study(study_name=name, storage=open_storage(url or storage, existing=True))
        except AutotuneError as exc:  # no such storage file, or a server that does not answer
            raise AutotuneError(f"--warm-start {source}: no such profile file, and {exc}") from None
        except KeyError:
            raise AutotuneError(f"--warm-start {source}: no such profile file, nor a study {name!r} "
                                f"in {display_url(url or storage)}") from None
        request = study.user_attrs.get("request")
        if not isinstance(request, dict):  # another tool's study: no front of configs to take
            raise AutotuneError(f"--warm-start {source}: study {name!r} was not made by autotune (it records no request)")
        check_model(source, request.get("model", {}).get("name"))
        front = summarize(study).front
        if not front:
            warnings.warn(f"--warm-start {source}: the study has no config that fits its budget yet: "
                          "nothing to start from", stacklevel=2)
        configs += [record.config for record in front]
    return configs


def _check_gpus(gpus: list[int]) -> None:
    """Every GPU named exists, and all are of one model: a study holds one model's timings."""
    from . import fingerprint
    from .errors import AutotuneError

    count = fingerprint.cuda_device_count()
    if count == 0:
        raise AutotuneError("--gpus: no CUDA GPU is usable here")
    missing = [g for g in gpus if g >= count]
    if missing:
        raise AutotuneError(f"--gpus: no GPU {', '.join(map(str, missing))} (GPUs usable here: {count})")
    names = {g: fingerprint.machine(f"cuda:{g}")["name"] for g in gpus}
    if len(set(names.values())) > 1:
        listed = ", ".join(f"{g}: {n}" for g, n in names.items())
        raise AutotuneError(f"--gpus: the GPUs are of different models ({listed}); a study measures "
                            "one model: run one study per model")


def _gpu_names(gpus: list[int]) -> dict[int, str]:
    """What CUDA_VISIBLE_DEVICES names each GPU of --gpus in a worker's environment. --gpus
    numbers GPUs as torch does here: within CUDA_VISIBLE_DEVICES when it is set."""
    from .fingerprint import visible_gpus

    visible = visible_gpus()
    return {g: visible[g] if visible else str(g) for g in gpus}


def _tune_on_gpus(out, request, args, argv: list[str], output: Path) -> int:
    """One worker process per GPU, all in the request's study. Each worker is this command
    without --gpus, with CUDA_VISIBLE_DEVICES naming its GPU, so its trials see that GPU alone;
    the study is set up (quality reference) once here first, and the profile written here last."""
    import os
    import signal
    import subprocess

    import optuna

    from . import runner, worker
    from .study import prepare, summarize

    names = _gpu_names(args.gpus)
    with runner.environment(CUDA_VISIBLE_DEVICES=names[args.gpus[0]]):  # the set-up's reference runs here
        prepare(request, on_step=out.print)
    logs = request.workdir / "workers"
    logs.mkdir(parents=True, exist_ok=True)
    workers = []
    interrupted = False

    def interrupt_workers():
        # Ctrl-C or SIGTERM here (terminate_as_interrupt): each worker gets one SIGINT, stops
        # as a single run does (its trial's group killed, the trial queued again) and exits.
        for _, _, proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)

    try:
        for gpu in args.gpus:
            log = open(logs / f"gpu{gpu}.log", "wb")
            # NAME=VALUE: a study name or storage starting with '-' is not taken for an option
            command = [sys.executable, "-m", "autotune", *argv, "--as-gpus-worker", "--device", "cuda",
                       f"--study-name={request.study_name}", f"--storage={request.storage}"]
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=names[gpu], CUDA_DEVICE_ORDER="PCI_BUS_ID",
                       **{GPUS_PARENT_ENV: worker.this_process()})
            # Their own session: a terminal's Ctrl-C reaches them only through interrupt_workers,
            # once, as SIGTERM does; a second SIGINT could break a worker's own clean-up.
            workers.append((gpu, log, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                       start_new_session=True)))
            out.print(f"worker on GPU {gpu} started (log: {logs / f'gpu{gpu}.log'})")
    except KeyboardInterrupt:
        STOPPING.set()  # the workers are waited for below, outside this block
        interrupted = True
        interrupt_workers()
    for gpu, log, proc in workers:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # signalled already when repeated: keep waiting for them
                STOPPING.set()
                if not interrupted:
                    interrupted = True
                    interrupt_workers()
        log.close()
        out.print(f"worker on GPU {gpu} ended (exit {code})")
    if interrupted:
        _print_interrupted(request.storage, request.study_name)
        return EXIT_INTERRUPTED
    study = optuna.load_study(study_name=request.study_name, storage=open_storage(request.storage))
    outcome = summarize(study, f"{len(args.gpus)} workers done", guard_asked=bool(request.min_psnr_db))
    from . import console

    try:  # stopped while the profile is written: the same command writes it
        console.print_summary(out, outcome, request.budget_bytes, request.margin_bytes)
        return _write_profile(out, request, outcome, output, default_named=not args.output)
    except KeyboardInterrupt:
        _print_interrupted(request.storage, request.study_name)
        return EXIT_INTERRUPTED


def _export(argv: list[str]) -> int:
    """Write the profile of a stored study, from any machine that reaches its storage."""
    p = Parser(prog="autotune export", description="write the profile of a stored (shared) study")
    p.add_argument("--study-name", help="the study to export (without it: the studies the storage holds are listed)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--storage", type=a_storage_url, help="Optuna storage URL (default: sqlite:///WORKDIR/studies.db)")
    where.add_argument("--workdir", type=a_path,
                       help=f"the --workdir the study ran with, to find its default storage (default: {DEFAULT_WORKDIR})")
    p.add_argument("--output", "-o", type=a_path, help="profile path, its folders made as needed "
                   "(default: MODEL-BUDGET.yaml)")
    args = p.parse_args(argv)
    # `-o a/b/p.yaml`'s folders, made by the check that it can be written, go again where no
    # profile is written (no such study, nothing that fits; helper-16)
    with _undone_if_refused(None, args.output) as returned:
        returned.append(_export_study(args))
    return returned[0]


def _export_study(args) -> int:
    from . import console
    from .errors import AutotuneError
    from .profile import check_writable
    from .sizes import format_size
    from .study import STOP_REASON, request_of, summarize, unfinished
    import optuna

    storage = args.storage or default_storage(args.workdir)
    if args.output:  # before the summary is printed: a path that takes no file is the one line
        _check_not_the_storage(args.output, storage)
        check_writable(args.output)
        if args.study_name:
            _check_output_replaceable(args.output, args.study_name, default_named=False, exporting=True)
    check_file(storage, must_exist=False)  # not a URL, a folder: said as they are
    try:  # no storage file yet: "no study", with a hint where it is the default one
        check_file(storage, hint="" if args.storage or args.workdir else WORKDIR_HINT)
    except AutotuneError as exc:
        raise AutotuneError(f"no study {args.study_name!r}: {exc}" if args.study_name else str(exc)) from None
    backend = open_storage(storage, existing=True)
    if not args.study_name:  # which one? the names are long (a digest): a list to copy from
        if not optuna.get_all_study_names(backend):  # not "name the study" where there is none
            raise AutotuneError(f"no study in {display_url(storage)}: nothing to export")
        _list_studies(backend, storage)
        print("autotune export: name the study to export with --study-name", file=sys.stderr)
        return EXIT_USAGE
    try:
        study = optuna.load_study(study_name=args.study_name, storage=backend)
    except KeyError:
        names = optuna.get_all_study_names(backend)
        held = f"it holds {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}" if names else "it holds none"
        raise AutotuneError(f"no study {args.study_name!r} in {display_url(storage)} ({held})") from None
    request = request_of(study, storage)
    pending = unfinished(study)
    reason = "exported from the stored study" + (f" before it finished ({pending})" if pending else "")
    if study.user_attrs.get(STOP_REASON):  # a study written before 2026-11-29 does not say
        reason = f"{study.user_attrs[STOP_REASON]}; {reason}"
    outcome = summarize(study, reason, guard_asked=bool(request.min_psnr_db))
    output = args.output or default_profile_path(request.spec, request.budget_bytes)
    if not args.output:  # a named one was checked before reading the study; this, before the summary
        _check_not_the_storage(output, storage)
        check_writable(output)
        if outcome.best is not None:  # else no profile is written, and the summary says why
            _check_output_replaceable(output, args.study_name, default_named=True, exporting=True)
    out = console.terminal()
    out.print(f"study {args.study_name} in {display_url(storage)}: {request.spec.name}, "
              f"{request.target.device}, budget {format_size(request.budget_bytes)}")
    console.print_summary(out, outcome, request.budget_bytes, request.margin_bytes)
    if pending:
        out.print(f"warning: study {args.study_name} is not finished ({pending}): the profile holds the trials "
                  "measured so far; export again once its runs end")
    return _write_profile(out, request, outcome, output, default_named=not args.output)


def _list_studies(backend, storage: str) -> None:
    """A line per study of a storage: its name, and for autotune's own what it measured."""
    import optuna

    from .console import count
    from .errors import AutotuneError
    from .sizes import format_size
    from .study import request_of, settings_that_differ, summarize

    summaries = optuna.get_all_study_summaries(backend, include_best_trial=False)
    print(f"studies in {display_url(storage)}:" if summaries else f"no study in {display_url(storage)}")
    listed = {}  # default name less its digest -> (name, request) of the first study listed with it
    for summary in summaries:
        study = optuna.load_study(study_name=summary.study_name, storage=backend)
        try:  # as export reads it: a study listed as autotune's is one export writes a profile of
            request = request_of(study, storage)
        except AutotuneError:  # another tool's, an older autotune's, or a request edited out of shape
            what = f"{count(summary.n_trials, 'trial')}, not one autotune can export"
        else:
            outcome = summarize(study)
            what = (f"{request.spec.name}, {request.target.device}, budget {format_size(request.budget_bytes)}, "
                    f"{count(outcome.counts['trials'], 'trial')} measured")
            ended = [t.datetime_complete for t in outcome.trials if t.datetime_complete]
            if ended:
                what += f", last trial {max(ended):%Y-%m-%d %H:%M}"
            # default names that differ only by their digest say the same model, size and
            # budget: say what else differs (an update's new shipped space, a --space, a --margin)
            prefix, _, digest = summary.study_name.rpartition("-")
            if re.fullmatch("[0-9a-f]{8}", digest):
                first = listed.setdefault(prefix, (summary.study_name, study.user_attrs["request"]))
                if first[0] != summary.study_name:
                    # forbid rules: in the digest, not in a stored request
                    differs = settings_that_differ(first[1], study.user_attrs["request"]) or "its forbid rules"
                    what += f"; differs from {first[0]} in {differs}"
        print(f"  {summary.study_name}  ({what})")


# ---- profiles ------------------------------------------------------------------------------------
def _profile_command(argv: list[str]) -> int:
    from . import console
    from .profile import load_profile

    command = argv[0]
    descriptions = {
        "show": "print a profile: its model, workload, budget, machine, best configuration and front",
        "verify": "replay a profile in a fresh process, as production loads it, and compare its latency and "
                  "peak memory with the recorded ones",
    }
    p = Parser(prog=f"autotune {command}", description=descriptions[command])
    p.add_argument("profile", type=a_path)
    if command == "verify":
        p.add_argument("--device", type=_device, help="where to replay it (default: where it was measured)")
        p.add_argument("--repeats", type=_positive_int,
                       help="timed calls at least (default: as many as the profile was measured with)")
        p.add_argument("--trial-timeout", type=_positive_float, default=TRIAL_TIMEOUT_S, metavar="SECONDS",
                       help=f"kill the replay after this long (default {TRIAL_TIMEOUT_S:g})")
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

    from . import console, fingerprint, runner, worker
    from .errors import AutotuneError
    from .models import check_weights_here
    from .sizes import format_size

    # The device is checked here, as Profile._target does when serving: else the replay fails
    # inside torch (an unknown name, or CUDA absent) after a costly start.
    recorded = profile.data["machine"]["device"]
    if args.device:
        device = _resolve_device(args.device)
    elif recorded.startswith("cuda") and not fingerprint.cuda_available():
        raise AutotuneError(f"profile {args.profile} was measured on {recorded}, and no CUDA GPU is "
                            "usable here; replay it on the CPU with --device cpu")
    else:
        try:
            device = _resolve_device(recorded)
        except AutotuneError as exc:  # its words name --device, which was not given
            raise AutotuneError(f"profile {args.profile} was measured on {recorded}: "
                                f"{str(exc).split(': ', 1)[1]}; pick one with --device") from None
    profile.check_runs_on(device)  # a config that cannot run here: said before a costly start
    try:  # the weights, as a run checks them: a model folder gone was said after the replay's start
        check_weights_here(profile.model)
    except AutotuneError as exc:
        raise AutotuneError(f"profile {args.profile}: {exc}") from None
    # Replayed on another kind of device (a GPU profile on the CPU): the figures compare two
    # devices, and the budget, on the recorded device's memory, is not judged on this one's.
    same_kind = device.partition(":")[0] == recorded.partition(":")[0]
    measured_with = profile.measured_with()  # replay with the loop that measured it
    if args.repeats:
        measured_with["repeats"] = args.repeats
    threads, cores = profile.threads, fingerprint.usable_cores()
    if threads and threads > cores:  # more threads than cores fight for them: --threads' rule
        out.print(f"warning: measured with {console.count(threads, 'CPU thread')}; replayed with {cores}, the cores here")
        threads = cores
    request = worker.trial_request(
        profile.model, profile.config, profile.workload, device, profile=args.profile, **measured_with,
        threads=threads,  # the thread count it was measured with, where this machine has the cores
    )
    with tempfile.TemporaryDirectory(prefix="autotune-verify-") as tmp:
        # spawn: a fresh interpreter, as a serving process starts
        result = runner.run_trial(request, Path(tmp), timeout_s=args.trial_timeout, launcher="spawn")
    # No verdict (None) when the replay failed (it measured no peak) or ran on another kind of device.
    peak = result.get("peak_memory_bytes") or 0
    ran = result["status"] == worker.OK
    fits = profile.fits(peak) if ran and same_kind else None
    console.print_verification(out, profile, result, fits=fits, margin_bytes=profile.margin_bytes())
    if ran and not same_kind:
        out.print(f"note: measured on {recorded}, replayed on {device}: the ratios compare two devices, and the "
                  f"budget ({format_size(profile.budget_bytes)} of {recorded}'s memory) is not judged here")
        return 0
    if not ran:
        # "error" says nothing the message does not; other statuses (timeout, crashed) do
        said = result.get("error", "") if result["status"] == worker.ERROR else \
            f"{result['status']}: {result.get('error', '')}"
        print(f"autotune: error: the replay failed: {said}", file=sys.stderr)
        return EXIT_ERROR
    if not fits:
        print(f"autotune: error: the replayed peak memory ({format_size(peak)}) plus the profile's "
              f"margin ({profile.margin}, {format_size(profile.margin_bytes())}) is above the profile's budget "
              f"({format_size(profile.budget_bytes)})", file=sys.stderr)
        return EXIT_NO_FIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
