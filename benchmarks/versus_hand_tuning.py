"""autotune against hand tuning: the guides' stacks and the VRAM-tier presets, side by side, in one
run on the machine it runs on (issue #8).

    # CPU (the default): sd15's full architecture with random weights at a small size
    python benchmarks/versus_hand_tuning.py
    # GPU: full SDXL architecture, random weights, 1024x1024, 30 steps, batch 1
    python benchmarks/versus_hand_tuning.py --device cuda
    # a few minutes, to check that it works: tiny-sd15, 2 budgets, 4 trials, no compile
    python benchmarks/versus_hand_tuning.py --quick

Contestants, each a configuration (a knob dict of autotune.knobs.CATALOGUE) measured by autotune's
own harness: one child process per measurement (autotune.runner.run_trial, autotune.worker) with
the request autotune.study.tune() builds for its trials (same warm-up, timed calls, spread limit,
threads, launcher, trial timeout and inductor cache):
- the default pipeline (float32, nothing enabled);
- the guides' hand-tuned stacks (SD1.5, SDXL, Flux; on a CPU also the CPU hand stack of the issue:
  bfloat16 + channels_last + compile);
- the VRAM-tier presets of A1111, ComfyUI and SD.Next;
- autotune: `autotune.study.tune()` on the family's search space (compile included), restricted to
  this machine, one study per budget, the same trial count and patience for every budget; its
  entry is the profile's point for that budget (`Profile.choose`).
A knob choice a contestant asks for that is not in the catalogue, or cannot run on this machine
(the knob's `unavailable(value, target)`), is left out (or replaced by the nearest catalogue choice)
and the output says so, with the reason.

A configuration is measured once per run: a config that two contestants share, or that a later
budget's study proposes again, reuses the first measurement (peak memory and latency do not depend
on the budget). So every contestant's figures, autotune's included, come from one pool of
measurements, and identical configs compare at exactly 1.00. `--no-reuse` measures every study
trial afresh instead. One inductor cache directory serves the whole run (TuneRequest
.compile_cache_dir), so a graph compiled once compiles from cache later.

A contestant fits a budget when its measured peak plus autotune's default margin (5% of the
budget) is within the budget: on a GPU the driver-level peak of the process (NVML), on a CPU the
process's peak resident memory. For each budget: the ratio of autotune's latency to the fastest
non-autotune contestant that fits (the default pipeline included: leaving it alone is a choice a
user has too); where it is above 1, the contestant that beat autotune, its config and the cause.

Outputs: OUT/versus_hand_tuning[-NAME].md (tables), .json (every measurement), .png (chart).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import platform
import shlex
import shutil
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from autotune.cli import measurement_defaults
from autotune.console import RULED_OUT_SAID, config_changes  # the CLI's words for a config's changes, and why one is out
from autotune.measure import TRIAL_TIMEOUT_S, busy_cores
from autotune.worker import write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
AUTOTUNE = measurement_defaults()  # autotune's own, from its CLI
MARGIN = AUTOTUNE["margin"]
GiB = 2**30

# Defaults per device. CPU: chosen from measurements on a 2-core AMD EPYC (no AVX512): sd15 random
# at this size costs a few seconds per call in float32, compile's first call a few minutes.
# No patience on a CPU: the shipped seeds are all bfloat16 (right on GPUs), and on a CPU without
# bf16 instructions they all lose to float32, so patience would stop the search right after them.
# Trial timeout: a CPU compile in max-autotune mode can run for many minutes; one that does is a
# result (timeout), not a stop.
# CPU size: sd15's full architecture at 128x128, 2 steps (its float32 call at 256x256, 4 steps took
# 17 s on a 2-core Xeon: the run would take hours); the layer widths are the real ones.
# 16 trials per budget, as the CLI: the product as a user runs it (the runs before 2026-11-24 used
# 12; resumed to 16, the lowest budget found a faster pick, 0.52 -> 0.49: results/versus_hand_tuning-xeon-16-all.md).
CPU_DEFAULTS = dict(model="sd15", height=128, width=128, steps=2, budgets="auto", trials=16, patience=None,
                    trial_timeout=900.0, paired_rounds=3)
GPU_DEFAULTS = dict(model="sdxl", height=1024, width=1024, steps=30, budgets="6GB,8GB,12GB,24GB,card",
                    trials=16, patience=8, trial_timeout=TRIAL_TIMEOUT_S, paired_rounds=3)
QUICK = dict(model="tiny-sd15", budgets="auto2", trials=4, patience=None, paired_rounds=1)


# ---- contestants ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Want:
    """One setting a recipe asks for: a catalogue knob and the choices to try in order (the first
    that runs here is used; a later one is a stand-in, and the output says so)."""

    knob: str
    values: tuple
    what: str


@dataclasses.dataclass
class Contestant:
    name: str
    kind: str  # "default", "guide", "preset"
    source: str
    wants: list[Want]
    # Settings of the recipe that autotune's catalogue does not hold, each with the reason
    # (reported as left out).
    missing: list[str] = dataclasses.field(default_factory=list)
    config: dict | None = None  # resolved for this machine
    notes: list[str] = dataclasses.field(default_factory=list)  # what was left out or replaced, why


def W(knob, values, what) -> Want:
    return Want(knob, tuple(values) if isinstance(values, (list, tuple)) else (values,), what)


TRACED_UNET = ("the traced UNet (torch.jit.trace): not in the catalogue, superseded by torch.compile "
               "(autotune/knobs/compile.py says why)")


def contestants(device: str, family: str) -> list[Contestant]:
    """The hand-made contestants for a model family on `device`: the default pipeline, the guides'
    stacks written for that family, on a CPU the CPU hand stack, and the VRAM-tier presets."""
    cuda = device.startswith("cuda")
    unet = family in ("sd15", "sdxl")
    # The UIs run half precision on a GPU by default (A1111: fp16 unless --no-half; ComfyUI: fp16 or
    # bf16 by card; SD.Next: "auto" = bf16 where supported); on a CPU all three run float32
    # (A1111 --use-cpu all --precision full --no-half; ComfyUI --cpu; SD.Next --use-cpu).
    ui_half = ("float16",) if cuda else ("float32",)
    sdnext_half = ("bfloat16", "float16") if cuda else ("float32",)
    out = [Contestant("default", "default", "diffusers as loaded: float32, nothing enabled", [])]
    if unet:
        # diffusers "Speed up inference" / fp16 docs; the SD1.5 record of ../shared/notes/anchors.md:
        # fp16 -> channels_last -> traced UNet -> memory-efficient attention (SDPA today).
        out.append(Contestant("guide-sd15", "guide", "SD1.5 guide: fp16 + channels_last + SDPA (+ traced UNet)", [
            W("dtype", "float16", "fp16"), W("channels_last", True, "channels_last"),
            W("attention", "sdpa", "SDPA"),
        ], missing=[TRACED_UNET]))
    if family == "sdxl":
        # "Accelerate inference of text-to-image diffusion models" (diffusers docs, diffusion-fast):
        # bf16 -> SDPA -> compile max-autotune + channels_last + inductor flags -> fused QKV ->
        # torchao int8 dynamic quantization with its layer filter.
        out.append(Contestant("guide-sdxl", "guide", "SDXL guide (diffusion-fast): bf16 + SDPA + channels_last + "
                              "compile max-autotune + inductor flags + fused QKV + int8 dynamic", [
            W("dtype", "bfloat16", "bf16"), W("attention", "sdpa", "SDPA"),
            W("channels_last", True, "channels_last"),
            W("compile", ("max-autotune", "max-autotune-no-cudagraphs"), "torch.compile mode=max-autotune"),
            W("compile_fullgraph", True, "fullgraph=True"),
            W("inductor_flags", True, "the guide's inductor flags (conv_1x1_as_mm, coordinate_descent_tuning, "
              "epilogue_fusion=False, coordinate_descent_check_all_directions)"),
            W("fuse_qkv", True, "fused QKV"), W("quantize", ("int8dq-filtered", "int8dq"), "torchao int8 dynamic"),
        ]))
    if family == "flux":
        # flux-fast / the diffusers + torchao Flux post: bf16 + compile + fused QKV + float8 dynamic
        # (int8 dynamic without compile was 130 s there: quantization is tuned together with compile).
        out.append(Contestant("guide-flux", "guide", "Flux guide (flux-fast): bf16 + compile max-autotune + fused QKV "
                              "+ float8 dynamic", [
            W("dtype", "bfloat16", "bf16"),
            W("compile", ("max-autotune", "max-autotune-no-cudagraphs"), "torch.compile max-autotune"),
            W("fuse_qkv", True, "fused QKV"),
            W("quantize", "float8dq", "torchao float8 dynamic activations + weights"),
        ]))
    if not cuda:
        # Issue #8: "on this CPU machine ... the hand stack there: bf16 + channels_last + compile".
        out.append(Contestant("hand-cpu", "guide", "the CPU hand stack (issue #8): bf16 + channels_last + compile", [
            W("dtype", "bfloat16", "bf16"), W("channels_last", True, "channels_last"),
            W("compile", "default", "torch.compile"),
        ]))
    out += [
        # AUTOMATIC1111 --medvram (modules/lowvram.py, setup_for_low_vram(use_medvram=True)): the
        # text encoder, UNet and VAE take turns on the GPU, one whole model at a time ~ diffusers'
        # model CPU offload; with VAE slicing (decode one image of a batch at a time).
        Contestant("a1111-medvram", "preset", "A1111 --medvram: one model on the GPU at a time "
                   "(~ model offload) + VAE slicing", [
            W("dtype", ui_half, "the UI's default precision"),
            W("offload", "model", "model CPU offload"), W("vae_slicing", True, "VAE slicing"),
        ]),
        # AUTOMATIC1111 --lowvram: the UNet itself split into its modules, each moved to the GPU
        # when it runs ("devastating" for speed) ~ sequential CPU offload; with sliced (split)
        # attention, A1111's own low-memory attention (UNet models only).
        Contestant("a1111-lowvram", "preset", "A1111 --lowvram: UNet moved module by module "
                   "(~ sequential offload) + attention slicing", [
            W("dtype", ui_half, "the UI's default precision"),
            W("offload", "sequential", "sequential CPU offload"),
            *([W("attention", "sliced", "attention slicing")] if unet else []),
        ]),
        # ComfyUI --lowvram (comfy/model_management.py, VRAMState.LOW_VRAM): weights loaded to the
        # GPU in part, the rest kept on the host ~ model offload; a VAE decode that runs out of
        # memory is retried tiled (comfy/sd.py VAE.decode -> decode_tiled): as a fixed
        # configuration, VAE tiling on.
        Contestant("comfyui-lowvram", "preset", "ComfyUI --lowvram: partial loading (~ model offload) "
                   "+ VAE tiling (its out-of-memory fallback)", [
            W("dtype", ui_half, "the UI's default precision"),
            W("offload", "model", "model CPU offload"), W("vae_tiling", True, "VAE tiling"),
        ]),
        # SD.Next picks an offload style by detected VRAM (modules/devices, shared "diffusers_offload_mode"):
        # <= 4 GB: sequential-like offload (+ VAE slicing/tiling);
        Contestant("sdnext-4gb", "preset", "SD.Next tier <= 4 GB: sequential offload + VAE slicing and tiling", [
            W("dtype", sdnext_half, "SD.Next's auto precision"),
            W("offload", "sequential", "sequential CPU offload"),
            W("vae_slicing", True, "VAE slicing"), W("vae_tiling", True, "VAE tiling"),
        ]),
        # <= 12 GB: "balanced" offload (modules moved by memory watermarks; nearest in the
        # catalogue: group offload at block level, else model offload) with VAE tiling;
        Contestant("sdnext-12gb", "preset", "SD.Next tier <= 12 GB: balanced offload (~ group/model offload) "
                   "+ VAE tiling", [
            W("dtype", sdnext_half, "SD.Next's auto precision"),
            W("offload", ("group-block-1", "model"), "balanced offload"), W("vae_tiling", True, "VAE tiling"),
        ]),
        # >= 24 GB: nothing offloaded: half precision + SDPA.
        Contestant("sdnext-24gb", "preset", "SD.Next tier >= 24 GB: nothing offloaded, half precision + SDPA", [
            W("dtype", sdnext_half, "SD.Next's auto precision"), W("attention", "sdpa", "SDPA"),
        ]),
    ]
    return out


def resolve(contestant: Contestant, target, skip: dict | None = None) -> Contestant:
    """The contestant's config on `target`: each wanted setting as asked, a stand-in, or left
    out, with the reason in `notes`. `skip`: knobs left out on purpose, with the reason."""
    from autotune.knobs import CATALOGUE, complete, conflict
    from autotune.knobs.base import Outrun

    contestant.notes = [f"run without {what}" for what in contestant.missing]
    config = {}
    for want in contestant.wants:
        if want.knob in (skip or {}):
            contestant.notes.append(f"run without {want.what}: {skip[want.knob]}")
            continue
        knob = CATALOGUE[want.knob]
        chosen, reasons = None, []
        for value in want.values:
            reason = knob.unavailable(value, target)
            if reason and not isinstance(reason, Outrun):  # a choice the search leaves out as slow runs as asked
                reasons.append(f"{want.knob}={value}: {reason}")
                continue
            chosen = value
            break
        if chosen is None:
            contestant.notes.append(f"run without {want.what}: {'; '.join(reasons)}")
        else:
            if reasons:
                contestant.notes.append(f"{want.what} run as {want.knob}={chosen}: {'; '.join(reasons)}")
            config[want.knob] = chosen
    # A sub-knob whose parent was left out goes too (compile_fullgraph without compile).
    if config.get("compile", "none") == "none":
        for name in ("compile_fullgraph", "inductor_flags", "compile_regional", "compile_vae"):
            config.pop(name, None)
    contestant.config = complete(config)
    clash = conflict(contestant.config, target.family)
    if clash:
        contestant.notes.append(f"note: {clash}")
    return contestant


# ---- measuring -------------------------------------------------------------------------------------
def key_of(request: dict) -> str:
    """What makes two measurements the same: everything but where the output goes."""
    # cut_above_s depends on the study's progress: a stored result serves any bound it would
    # have met (Measurements.__call__)
    return json.dumps({k: v for k, v in request.items() if k not in ("output_path", "cut_above_s")}, sort_keys=True)


class Measurements:
    """autotune's measuring function (runner.run_trial in a child process, as study.measure_in_child
    does), with one pool of results for the whole run: a request measured already is answered
    from the pool (its saved output copied to where the new request wants it), unless it was timed
    beside other processes' work: then the study asks again to measure it afresh (study.tune's
    second trial of a disturbed config), and the pool keeps the less disturbed of the two. Kept on
    disk, so a rerun with the same --workdir resumes."""

    def __init__(self, workdir: Path, trial_timeout_s: float, launcher: str, reuse: bool = True):
        self.dir = workdir / "pool"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = self.dir / "index.json"
        self.trial_timeout_s, self.launcher, self.reuse = trial_timeout_s, launcher, reuse
        self.results: dict[str, dict] = json.loads(self.index.read_text()) if self.index.exists() else {}
        self.fresh = self.reused = 0
        self.measuring_s = 0.0

    def __call__(self, request: dict, trial_dir: Path, tick) -> dict:
        key = key_of(request)
        stored = self.results.get(key) if self.reuse else None
        bound = request.get("cut_above_s")
        if stored and stored.get("cut_short") and not (bound is not None and stored["latency_s"] > bound):
            stored = None  # measured roughly, as far slower than a best this request does not have
        if stored and busy_cores(stored) is not None and not stored.get("measured_again"):
            stored = None  # timed beside a busy neighbour: this request is the study's second trial of it
        if stored is None:
            return self._measure(request, trial_dir, tick, key)
        self.reused += 1
        result = copy.deepcopy(self.results[key])
        result["reused"] = True
        kept = result.get("kept_output")  # kept in the result: contestants' quality reads it
        if kept and request.get("output_path"):
            out = Path(request["output_path"])
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kept, out)
            result["output"] = str(out)
            if Path(kept).with_suffix(".png").exists():
                shutil.copyfile(Path(kept).with_suffix(".png"), out.with_suffix(".png"))
                result["image"] = str(out.with_suffix(".png"))
        return result

    def _measure(self, request, trial_dir, tick, key) -> dict:
        from autotune import runner

        started = time.monotonic()
        result = runner.run_trial(request, trial_dir, timeout_s=self.trial_timeout_s, tick=tick,
                                  tick_every_s=1.0, launcher=self.launcher)
        self.measuring_s += time.monotonic() - started
        self.fresh += 1
        stored = copy.deepcopy(result)
        if result.get("output") and Path(result["output"]).exists():
            # a name of its own: a key measured again (cut short, disturbed) does not add to the index
            kept = self.dir / f"{uuid.uuid4().hex[:12]}.npy"
            shutil.copyfile(result["output"], kept)
            if Path(result["output"]).with_suffix(".png").exists():
                shutil.copyfile(Path(result["output"]).with_suffix(".png"), kept.with_suffix(".png"))
            stored["kept_output"] = result["kept_output"] = str(kept)
        stored.pop("traceback", None)
        if key in self.results and not self.reuse:
            key = f"{key}#{time.time()}"  # --no-reuse: keep every measurement
        earlier = self.results.get(key)
        if earlier and busy_cores(earlier) is not None:  # a disturbed figure measured again: once, not per study
            if (earlier.get("cores_taken_by_others") or 0) < (stored.get("cores_taken_by_others") or 0):
                stored = earlier  # more disturbed than before: the pool keeps the earlier
            # The other's output copy stays on disk: a contestant's row may still name it for its
            # quality, read after the studies.
            stored["measured_again"] = True
            if stored is earlier:
                write_json(self.index, self.results)
                return result
        self.results[key] = stored
        write_json(self.index, self.results)  # atomically: a stopped run leaves a readable index
        return result


# ---- budgets ---------------------------------------------------------------------------------------
def fits(result: dict, budget: int) -> bool:
    """Whether a measurement fits `budget` as autotune judges its own trials (study.violation)."""
    from autotune.sizes import parse_margin
    from autotune.study import violation

    return violation(result, budget, parse_margin(MARGIN, budget)) <= 0


def _round_up(size: float, step: int) -> int:
    return int(math.ceil(size / step) * step)


def auto_budgets(peaks: dict[str, int], machine_bytes: int, count: int = 3) -> list[int]:
    """Budgets that bite, from the contestants' measured peaks: just enough for the smallest
    contestant (so the float32 default does not fit where it needs more), midway between it and
    the default's need, and the whole machine (`count` 2: the first and the last). Rounded up to
    16 MiB for small models, 128 MiB for large ones."""
    from autotune.sizes import parse_margin

    smallest = min(peaks.values())
    step = 16 * 2**20 if smallest < 2 * GiB else GiB // 8
    share = parse_margin(MARGIN, GiB) / GiB  # the margin as a share of the budget ("5%": 0.05)
    need = lambda peak: peak / (1 - share)  # noqa: E731  peak + share of the budget <= budget
    low = _round_up(need(smallest) * 1.01, step)
    default_need = need(peaks["default"])
    budgets = [low]
    if count >= 3 and default_need > low + 2 * step:
        budgets.append(_round_up((low + default_need) / 2, step))
    budgets.append(machine_bytes)
    return sorted(set(budgets))


def parse_budgets(text: str, device: str, peaks: dict[str, int] | None, machine_bytes: int) -> list[int]:
    from autotune.sizes import parse_size

    if text.startswith("auto"):
        return auto_budgets(peaks, machine_bytes, count=2 if text == "auto2" else 3)
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(machine_bytes if part in ("card", "all", "machine") else parse_size(part))
        except ValueError as exc:  # one line, as autotune --vram says it
            raise SystemExit(f"--budgets {part}: {exc}") from None
    return sorted(set(out))


# ---- the run -----------------------------------------------------------------------------------------
def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph, whole
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    p.add_argument("--model", help="default: sd15 on a CPU, sdxl on a GPU, tiny-sd15 with --quick")
    p.add_argument("--random-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="full architecture with random weights (default; tiny models ignore it)")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--budgets", help="comma-separated sizes (8GB, 3.5GB; 'card' = all the device "
                   "has); 'auto' (CPU default): from the contestants' measured peaks")
    p.add_argument("--trials", type=int, help="autotune's trials per budget (16, as the CLI; quick 4)")
    p.add_argument("--patience", type=int, help="autotune stops when the best has not improved by 1%% "
                   "in this many trials (CPU off, GPU 8; 0: off)")
    p.add_argument("--space", type=Path, help="autotune's search space (default: the family's, "
                   "autotune/search_spaces/FAMILY.yaml, compile included; --quick: tiny-sd15.yaml)")
    p.add_argument("--sampler-seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    p.add_argument("--trial-timeout", type=float, help=f"seconds before a measurement is killed (CPU 900, GPU {TRIAL_TIMEOUT_S:g})")
    p.add_argument("--no-reuse", action="store_true", help="measure every study trial afresh")
    p.add_argument("--paired-rounds", type=int, help="rounds of the final paired measurement per budget "
                   "(autotune's pick and the best hand stack, alternately, in fresh trials; 0: off; default 3)")
    p.add_argument("--quick", action="store_true", help="tiny-sd15, 2 budgets, 4 trials, no compile")
    p.add_argument("--out", type=Path, default=Path("benchmark-results"),
                   help="folder for the results (default ./benchmark-results; the committed ones, in "
                        "benchmarks/results, hold notes a run would replace: give it only to refresh them)")
    p.add_argument("--name", default="", help="suffix of the output files (versus_hand_tuning-NAME.*)")
    p.add_argument("--workdir", type=Path, help="trials, studies, pool, paired rounds and inductor cache "
                   "(default: /tmp/versus-hand-tuning-<timestamp>; the same one resumes, measuring only "
                   "what was not measured yet; keep the workload flags the same)")
    p.add_argument("--shared-machine", action="store_true",
                   help="say in the results that other work shared the machine during the run")
    args = p.parse_args(argv)

    import optuna
    import torch

    from autotune import fingerprint, profile as profile_io, runner

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # this script prints each trial itself
    from autotune.knobs import Target
    from autotune.models import resolve_model
    from autotune.sizes import format_size, short_size
    from autotune.space import SHIPPED_DIR, SearchSpace
    from autotune.study import TuneRequest, tune

    device = args.device
    if device.startswith("cuda") and not fingerprint.cuda_available():
        raise SystemExit("versus_hand_tuning: --device cuda: no CUDA GPU is usable here")
    defaults = dict(GPU_DEFAULTS if device.startswith("cuda") else CPU_DEFAULTS)
    if args.quick:
        defaults.update(QUICK)
    model = args.model or defaults["model"]
    spec = resolve_model(model, random_weights=args.random_weights and not model.startswith("tiny-"))
    workload = spec.default_workload
    if not args.quick or args.height or args.width or args.steps:
        workload = dataclasses.replace(
            workload,
            height=args.height or (workload.height if model.startswith("tiny-") else defaults["height"]),
            width=args.width or (workload.width if model.startswith("tiny-") else defaults["width"]),
            steps=args.steps or (workload.steps if model.startswith("tiny-") else defaults["steps"]))
    workload = dataclasses.replace(workload, batch_size=args.batch_size)
    trials = args.trials or defaults["trials"]
    patience = defaults["patience"] if args.patience is None else (args.patience or None)
    trial_timeout = args.trial_timeout or defaults["trial_timeout"]
    budgets_text = args.budgets or defaults["budgets"]
    target = Target(device=device, family=spec.family, capability=fingerprint.capability(device), workload=workload)
    machine = fingerprint.machine(device)
    threads = args.threads or torch.get_num_threads()
    launcher = runner.default_launcher(device)

    # The family's space (compile included); --quick: the model's own (tiny-sd15.yaml: no compile).
    space_path = args.space or (SHIPPED_DIR / (f"{spec.name}.yaml" if args.quick and
                                               (SHIPPED_DIR / f"{spec.name}.yaml").exists() else f"{spec.family}.yaml"))
    space = SearchSpace.from_file(space_path).restrict(target)

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = (args.workdir or Path(f"/tmp/versus-hand-tuning-{stamp}")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"working folder: {workdir} (run again with --workdir {workdir} to resume)", flush=True)
    cache = workdir / "inductor-cache"  # one inductor cache for every trial of the run
    pool = Measurements(workdir, trial_timeout, launcher, reuse=not args.no_reuse)
    run_started = time.monotonic()

    def request_for(budget: int, name: str) -> TuneRequest:
        return TuneRequest(
            spec=spec, workload=workload, budget_bytes=budget, space=space, target=target,
            storage=f"sqlite:///{workdir / 'studies.db'}", study_name=name, trials=trials,
            workdir=workdir / name, patience=patience, trial_timeout_s=trial_timeout, margin=MARGIN,
            repeats=AUTOTUNE["repeats"], max_calls=AUTOTUNE["max_calls"], spread_limit=AUTOTUNE["spread_limit"],
            warmup=AUTOTUNE["warmup"], threads=threads,
            compile_cache_dir=cache, min_psnr_db="auto", seed=args.sampler_seed, launcher=launcher,
            hardware=machine["name"], machine=machine, confirm_rounds=AUTOTUNE["confirm_rounds"],
        )

    log(f"{spec.name} ({spec.kind}) {workload.height}x{workload.width}, {workload.steps} steps, "
        f"batch {workload.batch_size} on {device} ({machine['name']}), {threads} threads, launcher "
        f"{launcher}; workdir {workdir}")
    log(f"autotune's space ({space_path.name}, restricted here): " +
        "; ".join(f"{d.name}: {list(d.choices)}" for d in space.dimensions))
    for drop in space.dropped:
        log(f"  dropped on this machine: {drop}")

    # 1. the hand-made contestants, each config measured once
    skip = {"compile": "--quick runs no torch.compile (minutes per first call on a CPU)"} if args.quick else None
    entries = [resolve(c, target, skip) for c in contestants(device, spec.family)]
    probe = request_for(machine["memory_bytes"], "contestants")
    by_config: dict[str, dict] = {}
    for c in entries:
        ckey = json.dumps(c.config, sort_keys=True)
        for note in c.notes:
            log(f"  {c.name}: {note}")
        if ckey in by_config:
            log(f"{c.name}: same configuration as {by_config[ckey]['first']}: measured once")
            continue
        log(f"{c.name}: measuring {config_changes(c.config)}")
        out = workdir / "contestants" / c.name / "output.npy"
        result = pool(probe.trial_request(c.config, out), workdir / "contestants" / c.name, None)
        by_config[ckey] = {"first": c.name, "result": result}
        log(f"  -> {result['status']}: latency {_s(result.get('latency_s'))}, first call "
            f"{_s(result.get('first_call_s'))}, peak {format_size(result.get('peak_memory_bytes'))}"
            + (f" ({result.get('error', '')[:200]})" if result["status"] != "ok" else ""))
    rows = []
    for c in entries:
        shared = by_config[json.dumps(c.config, sort_keys=True)]
        rows.append({"name": c.name, "kind": c.kind, "source": c.source, "config": c.config,
                     "changed": config_changes(c.config), "notes": c.notes,
                     "same_as": None if shared["first"] == c.name else shared["first"],
                     "result": _slim(shared["result"])})
    peaks = {r["name"]: r["result"].get("peak_memory_bytes") for r in rows if r["result"]["status"] == "ok"}
    if "default" not in peaks:
        raise SystemExit("versus_hand_tuning: the default pipeline did not run: nothing to compare against")
    budgets = parse_budgets(budgets_text, device, peaks, machine["memory_bytes"])
    log("budgets: " + ", ".join(format_size(b) for b in budgets))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("versus_hand_tuning" + (f"-{args.name}" if args.name else ""))
    partial = stem.with_name(stem.name + ".partial.json")

    def checkpoint(tuned: list[dict]) -> None:
        """What is measured so far, for a run stopped at a time limit (the tables come at the end;
        the same --workdir resumes it)."""
        partial.write_text(json.dumps({"workdir": str(workdir), "budgets": budgets, "contestants": rows,
                                       "autotune": tuned}, indent=1, default=str))

    checkpoint([])

    # 2. autotune, one study per budget
    tuned = []
    for budget in budgets:
        name = f"vht-{spec.name.split('/')[-1]}-{short_size(budget)}"
        req = request_for(budget, name)
        log(f"autotune at {format_size(budget)}: study {name}, {trials} trials, patience {patience}")
        t0 = time.monotonic()
        fresh0, reused0 = pool.fresh, pool.reused

        def progress(record):
            r = record.result
            log(f"  trial {record.number}: {config_changes(record.config)} -> {record.status} "
                f"{_s(r.get('latency_s'))}, peak {format_size(r.get('peak_memory_bytes'))}, "
                f"{'feasible' if record.feasible else 'infeasible'}{_why_out(record)}{' (reused)' if r.get('reused') else ''}")

        outcome = tune(req, on_trial=progress, measure=pool)
        entry = {"budget_bytes": budget, "study": name, "stop_reason": outcome.stop_reason,
                 "trials": len(outcome.records), "wall_s": time.monotonic() - t0,
                 "fresh_measurements": pool.fresh - fresh0, "reused_measurements": pool.reused - reused0,
                 "quality_guard": outcome.quality_guard, "point": None,
                 "measured": [{"number": r.number, "repair": r.repair, "config": r.config, "status": r.status,
                               "latency_s": r.latency_s,
                               "peak_memory_bytes": r.peak_memory_bytes, "feasible": r.feasible,
                               "violations": r.violations, "quality": r.result.get("quality")}
                              for r in outcome.records]}
        if outcome.best is not None:
            document = profile_io.build(req, outcome, storage_label=req.storage)
            profile_io.save(document, workdir / f"{name}.yaml")
            point = profile_io.Profile(document).choose(budget)
            entry["point"] = {k: point.get(k) for k in ("trial", "config", "latency_s", "peak_memory_bytes",
                                                         "cold_start_s", "quality", "p90_s", "spread")}
            entry["profile"] = str(workdir / f"{name}.yaml")
        log(f"  done: {outcome.stop_reason}; " + (
            f"best {config_changes(entry['point']['config'])}: {_s(entry['point']['latency_s'])}, peak "
            f"{format_size(entry['point']['peak_memory_bytes'])}" if entry["point"] else "nothing fits"))
        tuned.append(entry)
        checkpoint(tuned)

    # 3. quality of the hand-made contestants against the run's float32 reference
    reference = next((workdir / t["study"] / "reference.npy" for t in tuned
                      if (workdir / t["study"] / "reference.npy").exists()), None)
    guard_db = next((t["quality_guard"]["min_psnr_db"] for t in tuned if t.get("quality_guard")), None)
    if reference is not None:
        from autotune import quality

        for row in rows:
            kept = row["result"].get("kept_output")
            if kept and Path(kept).exists():
                row["quality"] = quality.compare(__import__("numpy").load(kept), __import__("numpy").load(reference))

    summary = compare(rows, tuned, space, guard_db)
    rounds = defaults["paired_rounds"] if args.paired_rounds is None else args.paired_rounds
    if rounds:
        log(f"paired rounds: autotune's pick and the best hand stack per budget, alternately, {rounds} each")
        paired_rounds(summary, tuned, rows, probe, workdir, rounds, trial_timeout, launcher)
    settle(summary)
    wall = time.monotonic() - run_started
    doc = {
        "what": "autotune against the guides' hand-tuned stacks and the VRAM-tier presets (issue #8)",
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "started": stamp, "wall_s": wall,
        "shared_machine": args.shared_machine,
        "model": spec.to_dict(), "workload": workload.to_dict(), "device": device,
        "machine": machine, "software": fingerprint.software(), "platform": platform.platform(),
        "threads": threads, "launcher": launcher, "margin": MARGIN,
        "space": {"source": str(space_path), "dimensions": {d.name: list(d.choices) for d in space.dimensions},
                  "dropped": [str(d) for d in space.dropped]},
        "autotune_settings": {"trials": trials, "patience": patience, "sampler_seed": args.sampler_seed,
                              "trial_timeout_s": trial_timeout,
                              **{k: v for k, v in AUTOTUNE.items() if k != "margin"},
                              "min_psnr_db": "auto", "compile_cache_dir": "one for the whole run",
                              "reuse_measurements": not args.no_reuse},
        "measurements": {"fresh": pool.fresh, "reused": pool.reused, "measuring_s": pool.measuring_s},
        "quality_guard_db": guard_db,
        "budgets": budgets, "contestants": rows, "autotune": tuned, "summary": summary,
    }
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    partial.unlink(missing_ok=True)
    stem.with_suffix(".md").write_text(markdown(doc))
    try:
        chart(doc, stem.with_suffix(".png"))
    except Exception as exc:  # the tables matter more than the picture
        log(f"chart not drawn: {type(exc).__name__}: {exc}")
    print(markdown_summary(doc))
    for s in summary:
        if s.get("loss"):
            print(f"AUTOTUNE LOST at {format_size(s['budget_bytes'])}: {s['loss']}")
        elif s.get("tie"):
            print(f"AUTOTUNE TIED at {format_size(s['budget_bytes'])}: {s['tie']}")
    log(f"wrote {stem}.md, .json, .png; run wall time {wall / 60:.1f} min")
    return 0


def _plain(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _paired(paired) -> str:
    if not paired:
        return "-"
    if paired.get("same_config"):
        return "1.00 (the same configuration)"
    return f"**{paired['ratio']:.2f}** ({paired['rounds']})"


def _below(entry) -> str:
    if not entry:
        return "-"
    psnr = "?" if entry["psnr_db"] is None else f"{entry['psnr_db']:.1f}"
    return f"{entry['name']} {entry['latency_s']:.3f} s (PSNR {psnr} dB)"


def _s(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def _why_out(record) -> str:
    """Why a trial that ran cannot be picked, as the CLI's trial line says it: " (over budget)",
    " (below the quality guard)"; "" for one that can be or did not run."""
    reason = record.ruled_out_by
    return f" ({RULED_OUT_SAID[reason].trial_line})" if reason else ""


KEEP = ("status", "latency_s", "p90_s", "spread", "calls", "latencies_s", "first_call_s", "load_s",
        "cold_start_s", "peak_memory_bytes", "memory_source", "host_peak_rss_bytes",
        "torch_peak_allocated_bytes", "torch_peak_reserved_bytes", "nvml_sampled_peak_bytes",
        "outside_torch_bytes", "wall_s", "error", "kept_output", "reused", "threads")


def _slim(result: dict) -> dict:
    return {k: result[k] for k in KEEP if k in result}


# ---- comparison -------------------------------------------------------------------------------------
def passes_guard(row: dict, guard_db: float | None) -> bool:
    """Whether a contestant's output passes the quality guard autotune's trials were held to."""
    psnr = (row.get("quality") or {}).get("psnr_db")
    return guard_db is None or (psnr is not None and psnr >= guard_db)


def compare(rows: list[dict], tuned: list[dict], space, guard_db: float | None) -> list[dict]:
    """Per budget: who fits, the fastest non-autotune contestant that fits and passes the quality
    guard autotune was held to, autotune's ratio to it, and where autotune loses, who beat it and
    why. A faster contestant that fits but fails the guard is named beside it."""
    out = []
    for t in tuned:
        budget = t["budget_bytes"]
        fitting = [r for r in rows if fits(r["result"], budget)]
        fastest = lambda rs: min(rs, key=lambda r: r["result"]["latency_s"], default=None)  # noqa: E731
        best_hand = fastest([r for r in fitting if passes_guard(r, guard_db)])
        best_any = fastest(fitting)
        point = t["point"]
        s = {"budget_bytes": budget, "fits": [r["name"] for r in fitting],
             "best_hand": best_hand["name"] if best_hand else None,
             "best_hand_latency_s": best_hand["result"]["latency_s"] if best_hand else None,
             "faster_below_guard": None,
             "autotune_latency_s": point["latency_s"] if point else None, "ratio": None, "loss": None}
        if best_any is not None and best_any is not best_hand:
            s["faster_below_guard"] = {"name": best_any["name"], "latency_s": best_any["result"]["latency_s"],
                                       "psnr_db": (best_any.get("quality") or {}).get("psnr_db")}
        if point and best_hand:
            s["ratio"] = point["latency_s"] / best_hand["result"]["latency_s"]
            if s["ratio"] > 1.0:
                s["loss"] = f"{best_hand['name']} ({best_hand['changed']}) ran {best_hand['result']['latency_s']:.3f} s " \
                            f"against autotune's {point['latency_s']:.3f} s ({config_changes(point['config'])}): " + \
                            why_lost(best_hand, t, space)
        elif best_hand and not point:
            s["loss"] = f"autotune found nothing that fits; {best_hand['name']} fits: " + why_lost(best_hand, t, space)
        out.append(s)
    return out


def paired_rounds(summary, tuned, rows, probe, workdir: Path, rounds: int, timeout_s: float, launcher: str) -> None:
    """Per budget, autotune's pick and the best hand-made contestant measured again, alternately,
    `rounds` fresh trials each; the ratio of their medians goes into the summary as "paired".
    Single measurements taken minutes apart drift on these shared machines (the medians of one
    config in separate trials spread 10-36% on a 2-core VM); in alternation the drift hits both."""
    import statistics

    from autotune import runner
    from autotune.knobs import complete
    from autotune.space import config_key

    by_name = {r["name"]: r for r in rows}
    measured: dict[tuple, dict] = {}
    # every paired trial's result, kept as it ends: a run stopped here resumes with the same --workdir
    done_file = workdir / "paired" / "done.json"
    done_file.parent.mkdir(parents=True, exist_ok=True)
    done = json.loads(done_file.read_text()) if done_file.exists() else {}
    for t, s in zip(tuned, summary):
        if not (t["point"] and s["best_hand"]):
            continue
        ours, theirs = complete(t["point"]["config"]), complete(by_name[s["best_hand"]]["config"])
        if config_key(ours) == config_key(theirs):
            s["paired"] = {"same_config": True, "ratio": 1.0}
            continue
        key = (config_key(ours), config_key(theirs))
        if key not in measured:
            times = {"autotune": [], "hand": []}
            for i in range(rounds):
                for who, config in (("autotune", ours), ("hand", theirs)):
                    folder = workdir / "paired" / f"{len(measured)}-{i}-{who}"
                    done_key = f"{key[0]}|{key[1]}|{i}|{who}"
                    if done_key not in done:
                        result = runner.run_trial(probe.trial_request(config, folder / "output.npy"), folder,
                                                  timeout_s=timeout_s, launcher=launcher)
                        done[done_key] = {k: result.get(k) for k in ("status", "latency_s")}
                        write_json(done_file, done)
                    result = done[done_key]
                    if result["status"] == "ok":
                        times[who].append(result["latency_s"])
                    log(f"  {_size(t['budget_bytes'])} round {i + 1} {who}: {result['status']} "
                        f"{_s(result.get('latency_s'))}")
            measured[key] = times
        times = measured[key]
        if times["autotune"] and times["hand"]:
            s["paired"] = {"rounds": rounds, "autotune_s": times["autotune"], "hand_s": times["hand"],
                           "ratio": statistics.median(times["autotune"]) / statistics.median(times["hand"])}


def _range(seconds: list[float]) -> str:
    return f"{min(seconds):.3f}-{max(seconds):.3f} s"


def settle(summary: list[dict]) -> None:
    """The ratio each budget reports: the paired one where there is one, else the single-measurement
    one; a loss the paired round overturns is kept as a note, as a measurement effect."""
    for s in summary:
        paired = s.get("paired")
        s["final_ratio"] = paired["ratio"] if paired else s["ratio"]
        if paired and not paired.get("same_config"):
            if paired["ratio"] <= 1.0 and s["loss"]:
                s["note"] = (f"single measurements said: {s['loss']}; measured alternately, autotune's pick ran at "
                             f"{paired['ratio']:.2f}x {s['best_hand']}'s latency: the loss was a measurement effect")
                s["loss"] = None
            elif paired["ratio"] > 1.0 and not s["loss"]:
                ours, theirs = paired["autotune_s"], paired["hand_s"]
                said = (f"measured alternately, autotune's pick ran at {paired['ratio']:.2f}x {s['best_hand']}'s "
                        f"latency (single measurements: {s['ratio']:.2f}x)")
                if min(ours) <= max(theirs):  # a round of ours as fast as one of theirs: no order between them
                    s["tie"] = (f"{said}, and their alternate rounds overlap (autotune {_range(ours)}, "
                                f"{s['best_hand']} {_range(theirs)}): the search found nothing faster that fits")
                else:
                    s["loss"] = f"{said}: a search that kept a slower config on a drifting measurement"


def why_lost(winner: dict, tuned: dict, space) -> str:
    from autotune.knobs import changed
    from autotune.space import config_key

    config = winner["config"]
    outside = [f"{k}={v}" for k, v in changed(config).items() if v not in space.choices_of(k)]
    if outside:
        return f"a knob missing from the space: {', '.join(outside)} is not searched here"
    forbidden = space.forbidden(space.normalize(config))
    if forbidden:
        return f"the space forbids that configuration ({forbidden})"
    same = [m for m in tuned["measured"] if config_key(m["config"]) == config_key(space.normalize(config))]
    if same:
        m = same[0]
        if m["status"] != "ok":
            return f"the study measured it and it failed there ({m['status']}): a measurement effect"
        if m["violations"].get("quality", 0) > 0:
            return (f"the study measured it and its quality guard rejected it (PSNR "
                    f"{(m.get('quality') or {}).get('psnr_db')} dB under the threshold)")
        if m["violations"].get("failed_again", 0) > 0:
            return "the study measured it, and one of its confirmations crashed or timed out: a measurement effect"
        if m["violations"].get("memory", 0) > 0:
            return "the study measured it over the budget (peak differs between measurements): a measurement effect"
        return (f"the study measured it at {m['latency_s']:.3f} s (this run: {winner['result']['latency_s']:.3f} s): "
                "a measurement effect (noise between two measurements of one config)")
    return (f"the search stopped before measuring it ({tuned['stop_reason']}; {tuned['trials']} trials): "
            "a search that stopped too early")


# ---- output -----------------------------------------------------------------------------------------
def _size(b) -> str:
    from autotune.sizes import format_size

    return format_size(b)


def markdown(doc: dict) -> str:
    w = doc["workload"]
    budgets = doc["budgets"]
    lines = [
        "# autotune against hand tuning (issue #8)",
        "",
        f"Model {doc['model']['name']} ({doc['model']['kind']}), {w['height']}x{w['width']}, {w['steps']} steps, "
        f"batch {w['batch_size']}, on {doc['device']} ({doc['machine'].get('name')}), {doc['threads']} threads; "
        f"torch {doc['software'].get('torch')}, diffusers {doc['software'].get('diffusers')}. "
        f"Run {doc['started']}, wall time {doc['wall_s'] / 60:.1f} min.",
        "",
        "Command:",
        "",
        f"    {doc['command']}",
        "",
    ]
    if doc.get("shared_machine"):
        lines += ["**The run shared the machine with other work** (2 cores): absolute timings are noisy; "
                  "compare the ratios within this run, not the seconds across runs.", ""]
    a = doc["autotune_settings"]
    lines += [
        f"Every figure comes from autotune's own harness: one child process per measurement "
        f"(runner.run_trial, launcher {doc['launcher']}), at least {a['warmup']} warm-up call(s), "
        f"{a['repeats']} to {a['max_calls']} timed calls until their spread is under {a['spread_limit']:.0%}; "
        f"latency is the median call. Peak memory: {('the NVML process peak' if doc['device'].startswith('cuda') else 'the process peak RSS')}. "
        f"A contestant fits a budget when peak + {doc['margin']} of the budget <= budget (autotune's default margin). "
        f"A configuration is measured once per run and shared by every contestant and study that runs it"
        f"{'' if a['reuse_measurements'] else ' (off: --no-reuse)'} "
        f"({doc['measurements']['fresh']} measurements, {doc['measurements']['reused']} reused); "
        f"one inductor cache for the whole run.",
        "",
        f"autotune: `study.tune()` per budget on {Path(doc['space']['source']).name} restricted to this machine "
        f"({'; '.join(f'{k}: {v}' for k, v in doc['space']['dimensions'].items())}), "
        f"--trials {a['trials']}, patience {a['patience']}, sampler seed {a['sampler_seed']}, quality guard "
        f"{a['min_psnr_db']} (here {doc['quality_guard_db']} dB PSNR against the float32 output).",
        "",
    ]
    if doc["space"]["dropped"]:
        lines += ["Not searchable on this machine: " + "; ".join(doc["space"]["dropped"]) + ".", ""]
    lines += ["## Contestants (measured once; fits per budget)", "",
              "| contestant | configuration run | status | latency | first call | peak | PSNR dB | " +
              " | ".join(_size(b) for b in budgets) + " |",
              "|---|---|---|---|---|---|---|" + "---|" * len(budgets)]
    for r in doc["contestants"]:
        res = r["result"]
        ok = res["status"] == "ok"
        q = (r.get("quality") or {}).get("psnr_db")
        marks = " | ".join(("fits" if fits(res, b) else "no") if ok else "-" for b in budgets)
        same = f" (= {r['same_as']})" if r["same_as"] else ""
        lines.append(f"| {r['name']}{same} | {r['changed']} | {res['status']} | {_s(res.get('latency_s'))} | "
                     f"{_s(res.get('first_call_s'))} | {_size(res.get('peak_memory_bytes'))} | "
                     f"{'-' if q is None else q} | {marks} |")
    lines += ["", "## autotune per budget", "",
              "| budget | autotune's configuration | latency | peak | trials (stop) | fastest other that fits "
              "and passes the quality guard | its latency | ratio autotune / it, as first measured (autotune's: the "
              "median of its confirmed trials) | "
              "ratio, measured alternately (rounds) | faster, but below the guard |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for t, s in zip(doc["autotune"], doc["summary"]):
        p = t["point"]
        lines.append(
            f"| {_size(t['budget_bytes'])} | {config_changes(p['config']) if p else 'nothing fits'} | "
            f"{_s(p and p['latency_s'])} | {_size(p and p['peak_memory_bytes'])} | {t['trials']} ({t['stop_reason']}) | "
            f"{s['best_hand'] or 'none fits'} | {_s(s['best_hand_latency_s'])} | "
            f"{_plain(s['ratio'])} | "
            f"{_paired(s.get('paired'))} | {_below(s['faster_below_guard'])} |")
    repairs = [(t, m) for t in doc["autotune"] for m in t["measured"] if m.get("repair")]
    if repairs:  # study.py's memory repair (autotune/repair.py): what each added, and what came of it
        lines += ["", "Memory repairs (a config faster than all that fit, but over the budget, measured with a saver added):", ""]
        for t, m in repairs:
            outcome = "fits" if m["feasible"] else (
                "over the budget" if m["status"] == "ok" and m["violations"].get("memory", 0) > 0
                else "below the quality guard" if m["status"] == "ok" else m["status"])
            lines.append(f"- {_size(t['budget_bytes'])}: trial {m['number']} = trial {m['repair']['of']} + "
                         f"{m['repair']['adds']}: {_s(m['latency_s'])}, {_size(m['peak_memory_bytes'])}, {outcome}")
    losses = [s for s in doc["summary"] if s.get("loss")]
    lines += ["", "## Where autotune lost", ""]
    lines += [f"- {_size(s['budget_bytes'])}: {s['loss']}" for s in losses] or ["- nowhere in this run."]
    ties = [s for s in doc["summary"] if s.get("tie")]
    if ties:
        lines += ["", "Ties (autotune's pick no faster than the hand stack, nor slower beyond their rounds' spread):", ""]
        lines += [f"- {_size(s['budget_bytes'])}: {s['tie']}" for s in ties]
    notes = [s for s in doc["summary"] if s.get("note")]
    if notes:
        lines += ["", "Losses of single measurements that the paired round overturned:", ""]
        lines += [f"- {_size(s['budget_bytes'])}: {s['note']}" for s in notes]
    lines += ["", "## What each contestant could not run here", ""]
    for r in doc["contestants"]:
        lines.append(f"- **{r['name']}** ({r['source']}): " + ("; ".join(r["notes"]) if r["notes"] else "ran as asked."))
    lines += ["", "Sources of the presets and stacks: comments in benchmarks/versus_hand_tuning.py "
              "(contestants()). Every measurement: versus_hand_tuning.json.", ""]
    return "\n".join(lines)


def markdown_summary(doc: dict) -> str:
    """One line per budget. Where a paired round ran, its medians stand beside its ratio (the
    study's single measurements would not divide to it)."""
    import statistics

    lines = ["", "| budget | autotune | fastest other that fits and passes the quality guard | ratio |", "|---|---|---|---|"]
    for t, s in zip(doc["autotune"], doc["summary"]):
        ours, theirs, how = s["autotune_latency_s"], s["best_hand_latency_s"], "single measurements"
        paired = s.get("paired")
        if paired and not paired.get("same_config"):
            ours, theirs = statistics.median(paired["autotune_s"]), statistics.median(paired["hand_s"])
            how = f"medians of {paired['rounds']} alternating round(s)"
        ratio = "-" if s["final_ratio"] is None else f"{s['final_ratio']:.2f} ({how})"
        lines.append(f"| {_size(t['budget_bytes'])} | {_s(ours)} | "
                     f"{s['best_hand'] or 'none'} {_s(theirs)} | {ratio} |")
    return "\n".join(lines)


def chart(doc: dict, path: Path) -> None:
    import matplotlib

    from autotune.sizes import parse_margin

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = doc["budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 5), squeeze=False, sharey=True)
    ok = [r for r in doc["contestants"] if r["result"]["status"] == "ok" and not r["same_as"]]
    markers = {"default": "s", "guide": "o", "preset": "^"}
    for ax, t, s in zip(axes[0], doc["autotune"], doc["summary"]):
        budget = t["budget_bytes"]
        for r in ok:
            res = r["result"]
            fit = fits(res, budget)
            ax.scatter(res["peak_memory_bytes"] / GiB, res["latency_s"], marker=markers[r["kind"]], s=60,
                       facecolors="C0" if fit else "none", edgecolors="C0")
            ax.annotate(r["name"], (res["peak_memory_bytes"] / GiB, res["latency_s"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        if t["point"]:
            p = t["point"]
            ax.scatter(p["peak_memory_bytes"] / GiB, p["latency_s"], marker="*", s=220, color="C3", zorder=3)
            ax.annotate("autotune", (p["peak_memory_bytes"] / GiB, p["latency_s"]), color="C3", fontsize=8,
                        xytext=(4, -10), textcoords="offset points")
        limit = (budget - parse_margin(doc["margin"], budget)) / GiB
        if limit < ax.get_xlim()[1] * 1.5:
            ax.axvline(limit, color="grey", ls="--", lw=1)
        ratio = "-" if s["final_ratio"] is None else f"{s['final_ratio']:.2f}"
        ax.set_title(f"budget {_size(budget)}: autotune / best fitting = {ratio}", fontsize=9)
        ax.set_xlabel(f"peak memory (GiB); dashed: budget less the {doc['margin']} margin")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("latency per call (s)")
    w = doc["workload"]
    fig.suptitle(f"{doc['model']['name']} {w['height']}x{w['width']} {w['steps']} steps on {doc['machine'].get('name')}: "
                 "filled = fits the budget, hollow = does not; star = autotune's profile", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from _script import run  # beside this file: python puts the script's folder on the path

    run(main, kept="the measurements so far are kept in the working folder printed at the start")
