"""Memory repair: a configuration that ran faster than every one that fits (while none fits, than
the baseline, which is never repaired itself), but over the budget, is measured again with
memory-saving choices added, one more per trial, the way a person tuning by hand answers an
out-of-memory error (the diffusers memory guide: tile the VAE, offload the model, then finer
offload).

Why the search needs it: the sampler learns feasibility from constraints over some twenty knobs,
and in a dozen trials it rarely lands on the one combination of a fast stack and the savers that
make it fit. In the #8 run at c88b1ad (benchmarks/results/versus_hand_tuning-epyc-head.md), at a
4.38 GiB budget the frozen compiled seed ran 0.70 s at 4.46 GiB, and the study kept a stack
taking 1.33 s; the frozen stack with int8 weights and glibc's threshold held fits there.

The chain is cumulative: each repair keeps the savers added before it, because savers interact
(on a CPU, int8 weights lower the peak only once glibc's mmap threshold is held). A repair that
breaks the quality guard, fails, or is no longer clearly faster than the fastest config that fits
(FASTER_BY; the baseline while none fits) is dropped, and the next saver is tried on its parent
instead. Everything is read from the measured configs (a repair is its parent's config plus one
saver), so a resumed or shared study picks up where another worker left off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal

from . import worker
from .knobs import CATALOGUE, Config, matches
from .space import SearchSpace, config_key

# The savers, cheapest in latency first, each (knob, choice, when): `when` a partial config the
# config must match (knobs.matches), or None. A later entry for the same knob replaces an earlier
# one (model offload, then leaf-level group offload, then sequential). On a GPU the budget is
# device memory: the VAE decode's activations and the text encoders go first, then the
# denoiser's weights, and half precision last (a float32 config rarely leads on a GPU). On a CPU
# everything lives in host memory: the text encoders' and denoiser's weights, then glibc's
# threshold (which lowers the peak only once quantization frees the weights as loaded:
# autotune/knobs/host.py), then lossy or slow savers the quality guard may refuse.
# Int8 weights: dynamic where compiled (the SDXL guide's stack; inductor fuses the activations'
# quantization: frozen on this project's CPU, int8 dynamic ran 0.78 s and weight-only 1.34 s),
# weight-only otherwise (the cheaper uncompiled: 1.37 against 1.56 s).
_COMPILED = {"compile": [c for c in CATALOGUE["compile"].choices if c != "none"]}
_INT8_WEIGHTS = (("quantize", "int8dq", _COMPILED), ("quantize", "int8wo", {"compile": "none"}))
SAVERS_CUDA = (
    ("vae_tiling", True, None),
    ("quantize_text_encoders", "int8wo", None),
    ("offload", "model", None),
    ("layerwise_casting", "fp8-e4m3", None),
    *_INT8_WEIGHTS,
    ("offload", "group-leaf-stream", None),
    # streams beside a tiled VAE are forbidden (knobs.CONFLICTS): leaf-level without them there
    ("offload", "group-leaf", {"vae_tiling": True}),
    ("offload", "sequential", None),
    ("dtype", "bfloat16", None),
)
SAVERS_CPU = (
    ("quantize_text_encoders", "int8wo", None),
    *_INT8_WEIGHTS,
    ("malloc_mmap_threshold", "1MiB", None),
    ("dtype", "bfloat16", None),
    ("attention", "sliced", None),
    ("vae_tiling", True, None),
    ("layerwise_casting", "fp8-e4m3", None),
)

# A config is repaired only while it runs this much faster than the fastest that fits (while none
# fits, than the baseline): each saver costs some speed, and one within a few percent of that
# config cannot beat it once it fits (in the #8 run a chain went on at 1.501 s against 1.505 s,
# spending two trials for nothing).
FASTER_BY = 0.05

# At most this share of a study's trials (--trials) are repairs; the rest are the baseline's, the
# seeds' and the sampler's.
SHARE = 0.5


@dataclass
class Repair:
    config: Config
    of: int  # the trial number of the config it adds to
    adds: str  # "knob=value"

    @property
    def marks(self) -> dict:
        """The user attributes of its queued trial (reports read them; the chain does not)."""
        return {"repair": {"of": self.of, "adds": self.adds}}


def savers(is_cuda: bool) -> tuple:
    return SAVERS_CUDA if is_cuda else SAVERS_CPU


def with_saver(config: Config, saver: tuple, order: tuple, space: SearchSpace) -> Config | None:
    """`config` with one saver of `order` added, or None where it does not apply: its `when` not
    met, the knob set already (other than by an earlier saver of the list that applies to it: an
    int8 dynamic chosen uncompiled is not swapped for weight-only, which saves the same), the
    choice not searched on this machine, undone by a `when` of the space, or a forbidden
    combination."""
    knob, value, when = saver
    if when is not None and not matches(when, config):
        return None
    current = config.get(knob, CATALOGUE[knob].default)
    earlier = [v for k, v, w in order[:order.index(saver)] if k == knob and (w is None or matches(w, config))]
    if current == value or (current != CATALOGUE[knob].default and current not in earlier):
        return None
    if value not in space.choices_of(knob):
        return None
    repaired = space.normalize({**config, knob: value})
    if repaired[knob] != value or space.forbidden(repaired):
        return None
    return repaired


def next_repair(records: list, pending: set[str], space: SearchSpace, is_cuda: bool,
                dominated_by: Callable[[Config], object | None] = lambda config: None) -> Repair | None:
    """The next config to measure as a repair, or None: from the fastest config over the budget
    that runs over FASTER_BY faster than the fastest that fits (while none fits, than the baseline;
    the baseline itself is never a root), or a seed that ran out of memory. `records`: the study's
    measured trials (study.TrialRecord); `pending`: the keys of configs queued or being measured (a chain waits for
    its last step); `dominated_by`: the measured trial that shows a config cannot fit, where the
    study skips it unmeasured (study.memory_dominated): never proposed (it would be proposed again
    after each skip), the chain goes on from that trial instead."""
    order = savers(is_cuda)
    by_key = {config_key(r.config): r for r in records}

    baseline = next((r for r in records if r.baseline and r.status == worker.OK), None)

    def fastest_before(number: int | None = None) -> float | None:
        """The fastest feasible latency among trials before `number` (all: None), or while none
        fits, the baseline's: a repair is for a config that is fast, and with nothing fitting yet,
        fast means faster than doing nothing. A step of a chain is judged against what fitted when
        it was measured, not against the fit its own chain reached later, or a chain that fitted
        would look as if it had lost its lead, and start another branch. None when neither is
        known (the baseline failed, ran out of memory, or is measured later, as after a Ctrl-C
        requeue): then any config that ran over the budget is fast enough, as doing nothing did
        not run or has no figure to beat."""
        def before(r) -> bool:
            return number is None or r.number < number

        to_beat = baseline.latency_s if baseline is not None and before(baseline) else None
        return min((r.latency_s for r in records if r.feasible and before(r)), default=to_beat)

    def fast_but_over(r, fastest: float | None) -> bool:
        # over the budget only: below the quality guard, failed when measured again, or now
        # forbidden (TrialRecord.ruled_out_otherwise), it would not be picked with a saver either
        return (r.over_budget and not r.ruled_out_otherwise
                and (fastest is None or r.latency_s < fastest * (1 - FASTER_BY)))

    seen: set[str] = set()

    def step(base, first: int = 0) -> Repair | Literal[False]:
        """The next repair from `base`, trying the savers from `order[first]` on (those before were
        added, did not apply, or were dropped on its way); False where its chain has ended or waits."""
        seen.add(config_key(base.config))
        for index in range(first, len(order)):
            saver = order[index]
            config = with_saver(base.config, saver, order, space)
            if config is None:
                continue
            key = config_key(config)
            if key in pending:
                return False  # measured now or queued: wait for it
            child = by_key.get(key) or dominated_by(config)
            if child is None:
                return Repair(config, base.number, _named(saver))
            if child.feasible:
                return False  # repaired
            # over the budget still (measured, or out of memory where its parent was fast): the next saver on it
            if fast_but_over(child, fastest_before(child.number)) or child.out_of_budgeted_memory:
                return False if config_key(child.config) in seen else step(child, index + 1)
            # broke the guard, failed, or lost its lead on what fitted: the next saver, on this base
        return False

    # Fastest first; then seeds that ran out of memory (the guides' fast stacks, of unknown speed
    # here). Never the baseline: with nothing set, its chain only walks the savers, which the
    # sampler proposes anyway (on the tiny-sdxl table, where only slow configs fitted early, its
    # chains delayed the optimum by 2-6 trials in median).
    fastest = fastest_before()
    roots = sorted((r for r in records if fast_but_over(r, fastest) and not r.baseline),
                   key=lambda r: r.latency_s) + [r for r in records if r.seeded and r.out_of_budgeted_memory]
    for root in roots:
        if config_key(root.config) in seen:
            continue
        found = step(root, _after_own_saver(root, order))
        if found:
            return found
    return None


def _named(saver: tuple) -> str:
    """A saver as a repair's `adds` records it: "knob=value"."""
    knob, value, _ = saver
    return f"{knob}={value}"


def _after_own_saver(root, order: tuple) -> int:
    """Where a root's walk through the savers starts: after the saver that made it, where it is a
    step of a chain (a step that ran faster than its parent is a root before its parent is), as
    its chain would walk on from it; the savers before were added, did not apply, or were dropped
    on its way. From the first for any other root, and for a step whose saver this list no longer
    holds (a study an autotune with other savers measured: its chain may then try again a saver
    it dropped)."""
    adds = (root.repair or {}).get("adds")
    made_by = [index for index, saver in enumerate(order) if _named(saver) == adds]
    return made_by[0] + 1 if made_by else 0


def count(trials: Iterable) -> int:
    """The repairs among a study's trials (frozen trials, any state), each config once: a trial
    queued again after Ctrl-C or a dead worker, and a twin stepping back for another worker's,
    repeat its config."""
    return len({tuple(sorted(t.params.items())) for t in trials if "repair" in t.user_attrs})
