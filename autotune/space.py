"""Search spaces: which choices of which knobs a study explores.

A space file (search_spaces/*.yaml) names knobs of the catalogue and the choices to try:

    extends: default.yaml                 # optional: relative to this file, else the shipped one
    knobs:
      dtype: [float32, bfloat16]
      compile: default                    # a single value: that choice beside the baseline's
      offload: [none]                     # only the baseline's value: the knob is not searched
      quantize: {choices: [none, int8wo], when: {dtype: bfloat16}}   # searched only when active
    forbid:
      - {quantize: int8dq, compile: none} # a partial config never to measure
    seeds:                                # measured first, right after the baseline
      - {dtype: bfloat16, fuse_qkv: true, channels_last: true}

Knobs a space leaves out stay at the baseline's value. Every dimension keeps the baseline's value
among its choices, so the default pipeline is a point of every space.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from .errors import SpaceError, read_yaml
from .knobs import CATALOGUE, CONFLICTS, Config, Target, baseline, conflict, matches
from .knobs.base import Outrun

SHIPPED_DIR = Path(str(resources.files("autotune") / "search_spaces"))


def shipped_names() -> list[str]:
    """The shipped spaces' file names, which a space file may extend by name."""
    return sorted(p.name for p in SHIPPED_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class Dimension:
    name: str
    choices: tuple
    when: dict | None = None  # partial config under which this knob is searched; else baseline


@dataclass(frozen=True)
class Dropped:
    knob: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.knob}={self.value}: {self.reason}"


@dataclass
class SearchSpace:
    dimensions: list[Dimension]
    forbid: list[dict] = field(default_factory=list)
    source: str = "<memory>"
    dropped: list[Dropped] = field(default_factory=list)
    # Expert starting points (partial configs, e.g. the guides' fast stack and a low-memory
    # fallback): a good feasible point early, before the sampler has learnt anything.
    seeds: list[dict] = field(default_factory=list)
    # The model family once restricted to a target: conflicts narrowed to families use it.
    family: str | None = None

    # ---- loading -----------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "SearchSpace":
        """A space file, or a shipped space by its name (`--space sdxl.yaml`, as `extends:` takes
        it) where no such file is found."""
        path = Path(path)
        named = f"{path.name}.yaml" if path.suffix not in (".yaml", ".yml") else path.name  # `--space sd15` too
        if not path.exists() and path.name == str(path) and named in shipped_names():
            path = SHIPPED_DIR / named
        elif not path.exists():
            raise SpaceError(f"search space {path}: no such file (a space file's path, or the name of a shipped "
                             f"space: {', '.join(shipped_names())})")
        knobs, forbid, seeds, own = _read_layers(path)
        if not knobs:  # an empty or mistyped file would otherwise tune the baseline alone
            raise SpaceError(f"search space {path}: it names no knobs (add 'knobs:' with knob: choices)")
        dims = _dimensions(knobs, path)
        for dim, unmet in _unmet_conditions(dims):
            if dim.name in own:  # its condition is written in this file: a contradiction to mend there
                other, wanted, takes = unmet
                raise SpaceError(
                    f"search space {path}: knob '{dim.name}' is searched only when '{other}' is "
                    f"{' or '.join(map(str, wanted))}, which this space never tries ('{other}': "
                    f"{', '.join(map(str, takes))}); add it to '{other}' or drop the condition")
        # A condition inherited through `extends` that this file's narrowing leaves unmet
        # (`dtype: [bfloat16]` over sdxl.yaml's vae_fp16_fix, searched when float16): that knob
        # goes, said, as the file cannot drop a condition written in another.
        dims, dropped = _without_unmet(dims, "which this space never tries")
        space = cls(dims, _forbid_rules(forbid, path), source=str(path), dropped=dropped,
                    seeds=_forbid_rules(seeds, path, section="seeds"))
        space.check_allows_a_config()
        return space

    @classmethod
    def for_model(cls, spec) -> "SearchSpace":
        """The shipped space of a model: its own file (tiny-sdxl.yaml) if there is one, else its
        family's (sdxl.yaml), else default.yaml."""
        shipped = shipped_names()
        for name in (spec.name, spec.family, "default"):
            # among the shipped names only: a local folder's name is its path, and `<folder>.yaml`
            # beside it, some file of the user's, was read as its space (helper-15)
            if f"{name}.yaml" in shipped:
                return cls.from_file(SHIPPED_DIR / f"{name}.yaml")
        raise SpaceError(f"no shipped search space for {spec.name}")


    # ---- this machine --------------------------------------------------------------------------
    def restrict(self, target: Target) -> "SearchSpace":
        """The space without the choices that cannot run on `target`, each drop with its reason."""
        reasons = {(dim.name, value): CATALOGUE[dim.name].unavailable(value, target)
                   for dim in self.dimensions for value in dim.choices}
        # what runs here at all (an outrun choice does: it is only slower), to judge an Outrun by:
        # bfloat16 allowed only beside a choice this machine cannot run runs no config here
        runnable = SearchSpace(searched(self.dimensions, lambda name, value: not reasons[name, value]
                                        or isinstance(reasons[name, value], Outrun)), self.forbid, family=target.family)
        for (name, value), reason in reasons.items():
            if isinstance(reason, Outrun) and not runnable._searches_a_config_with(name, reason.by):
                reasons[name, value] = None  # nothing searched here runs it faster: measured, as the space asks
        dropped = [*self.dropped, *(Dropped(name, value, reason) for (name, value), reason in reasons.items() if reason)]
        dims = searched(self.dimensions, lambda name, value: not reasons[name, value])
        # a knob searched under a condition on choices dropped here is never searched either: said
        # so, not listed as searched (`compile_fullgraph` where no compiler runs; helper-15)
        dims, unmet = _without_unmet(dims, "which is not searched here (dropped above)")
        dropped += unmet
        space = SearchSpace(dims, self.forbid, self.source, dropped, self.seeds, target.family)
        # with choices dropped, and the family's conflicts known, the rules may now leave nothing
        space.check_allows_a_config(f" on {target.device} ({target.family})")
        return space

    def _searches_a_config_with(self, name: str, value) -> bool:
        """Whether `value` is a choice of knob `name` that some config the forbid rules (and the
        known conflicts) allow holds: a space that lists bfloat16 but forbids it runs no bfloat16."""
        if value not in self.choices_of(name):
            return False
        narrowed = [Dimension(d.name, (value,), d.when) if d.name == name else d for d in self.dimensions]
        return SearchSpace(narrowed, self.forbid, family=self.family).allows_a_config()

    # ---- configs -------------------------------------------------------------------------------
    def normalize(self, partial: Config) -> Config:
        """A full config: knobs outside the space, or inactive under their `when`, at baseline."""
        config = baseline()
        for dim in self.dimensions:
            if dim.when is None or matches(dim.when, config):
                config[dim.name] = partial.get(dim.name, config[dim.name])
        return config

    def forbidden(self, config: Config) -> str | None:
        """Why a config must not be measured (a rule of this space or a known conflict), or None."""
        for rule in self.forbid:
            if matches(rule, config):
                return f"forbidden by {self.source}: {rule}"
        return conflict(config, self.family)

    def conflicts_here(self) -> list[tuple[dict, str]]:
        """The known conflicts (knobs.CONFLICTS) that can forbid a config of this space, each
        narrowed to the choices searched here, with its reason: a rule bites where it holds for
        this family and some config this space draws (`normalize`: a knob outside the space at
        its default, one whose `when` fails at its default) matches it. For `--list-knobs`:
        what is never measured together, and why."""
        dims = {d.name: d for d in self.dimensions}

        def choices(name: str) -> tuple:
            return dims[name].choices if name in dims else (CATALOGUE[name].default,)

        here = []
        for rule, reason in CONFLICTS:
            if not matches({k: v for k, v in rule.items() if k == "family"}, {}, self.family):
                continue
            narrowed = {name: [v for v in choices(name) if v in (wanted if isinstance(wanted, list) else [wanted])]
                        for name, wanted in rule.items() if name != "family"}
            if not all(narrowed.values()) or not any(name in dims for name in narrowed):
                continue
            # the rule's knobs, and those their `when` conditions read (and theirs), drawn every way
            names = list(narrowed)
            for name in names:  # grows as it goes: a `when` parent's own parents are read too
                when = dims[name].when if name in dims else None
                names += [k for k in when or {} if k not in names]
            axes = [narrowed.get(name) or choices(name) for name in names]
            if any(matches(narrowed, self.normalize(dict(zip(names, drawn)))) for drawn in itertools.product(*axes)):
                here.append(({k: v[0] if len(v) == 1 else v for k, v in narrowed.items()}, reason))
        return here

    def suggest(self, trial) -> Config:
        """Draw a config through an Optuna trial (conditional knobs only when active)."""
        config = baseline()
        for dim in self.dimensions:
            if dim.when is None or matches(dim.when, config):
                config[dim.name] = trial.suggest_categorical(dim.name, list(dim.choices))
        return config

    def params(self, config: Config) -> dict:
        """The Optuna params that describe a config in this space (for enqueue_trial)."""
        return {
            d.name: config[d.name] for d in self.dimensions if d.when is None or matches(d.when, config)
        }

    def choices_of(self, knob: str) -> tuple:
        """What the space searches for `knob` (empty when it does not search it)."""
        return next((d.choices for d in self.dimensions if d.name == knob), ())

    def seed_configs(self) -> list[Config]:
        """The space's seeds as full configs of this space (see `fit`)."""
        return self.fit(self.seeds)

    def fit(self, partials: list[Config]) -> list[Config]:
        """Partial configs (seeds, an earlier study's front) as full configs of this space:
        a choice left out here as outrun becomes the one that outruns it (float16 bfloat16 on a
        CPU that computes only bfloat16 natively: as little memory, not float32's double);
        other choices it does not hold (dropped on this machine, or not searched) fall back to
        the baseline's; the baseline itself, forbidden and repeated ones go."""
        seen, out = {config_key(baseline())}, []
        allowed = {d.name: d.choices for d in self.dimensions}
        outrun = {(d.knob, d.value): d.reason.by for d in self.dropped if isinstance(d.reason, Outrun)}
        for partial in partials:
            partial = {k: outrun.get((k, v), v) for k, v in partial.items()}
            config = self.normalize({k: v for k, v in partial.items() if v in allowed.get(k, ())})
            key = config_key(config)
            if key not in seen and not self.forbidden(config):
                seen.add(key)
                out.append(config)
        return out

    def grid_size(self) -> int:
        """The number of raw grid points (before `when`, de-duplication and forbid rules)."""
        return math.prod(len(d.choices) for d in self.dimensions)

    def allows_a_config(self, besides_the_baseline: bool = False) -> bool:
        """Whether any config (other than the baseline, where asked) survives the forbid rules and
        known conflicts. A depth-first search
        over the dimensions in order, as `normalize` fills them, that leaves a branch as soon as a
        rule matches the knobs decided so far: `configs()` of a full space, whose baseline a rule
        forbids, could walk millions of grid points to find the first allowed one, or none."""
        position = {d.name: i for i, d in enumerate(self.dimensions)}
        by_depth: dict[int, list[dict]] = {}  # rules whose knobs are all decided at that depth
        for rule in [*self.forbid, *(rule for rule, _ in CONFLICTS)]:
            depth = max((position[k] + 1 for k in rule if k in position), default=0)
            by_depth.setdefault(depth, []).append(rule)
        config = baseline()

        def search(depth: int) -> bool:
            if any(matches(rule, config, self.family) for rule in by_depth.get(depth, ())):
                return False
            if depth == len(self.dimensions):
                return not besides_the_baseline or config != baseline()
            dim = self.dimensions[depth]
            active = dim.when is None or matches(dim.when, config)
            for value in dim.choices if active else (CATALOGUE[dim.name].default,):
                config[dim.name] = value
                if search(depth + 1):
                    return True
            config[dim.name] = CATALOGUE[dim.name].default
            return False

        return search(0)

    def check_allows_a_config(self, where: str = "") -> None:
        """SpaceError when the forbid rules (with the known conflicts) leave no config to measure:
        a study would otherwise stop at once, with nothing measured."""
        if not self.allows_a_config():
            raise SpaceError(f"search space {self.source}: its 'forbid' rules and the known conflicts "
                             f"leave no configuration to measure{where}, not even the baseline")

    def configs(self) -> "list[Config] | LargeGrid":
        """Every distinct config this space allows, baseline first (never empty for a space from
        `from_file` or `restrict`: they check `allows_a_config`). A full GPU space holds
        millions of grid points: above LARGE_GRID of them this is a LargeGrid, whose len() is
        the grid size (an upper bound) and whose configs are generated as they are read."""
        if self.grid_size() > LARGE_GRID:
            return LargeGrid(self)
        return list(self._iter_configs())

    def _iter_configs(self):
        seen = set()
        grid = itertools.product(*(d.choices for d in self.dimensions))
        for values in itertools.chain([()], grid):
            config = self.normalize(dict(zip((d.name for d in self.dimensions), values)))
            key = config_key(config)
            if key not in seen and not self.forbidden(config):
                seen.add(key)
                yield config


# Above this many grid points, SearchSpace.configs() stops enumerating eagerly (at about 20 µs a
# point, 50,000 take a second).
LARGE_GRID = 50_000


class LargeGrid(Sequence):
    """The configs of a space too large to list: iterated lazily; len() is an upper bound."""

    def __init__(self, space: SearchSpace):
        self.space = space

    def __len__(self) -> int:
        return self.space.grid_size()

    def __iter__(self):
        return self.space._iter_configs()

    def __getitem__(self, index):
        if isinstance(index, slice) or index < 0:
            raise IndexError("a LargeGrid is read from the start: iterate it")
        config = next(itertools.islice(self.space._iter_configs(), index, None), None)
        if config is None:
            raise IndexError(index)
        return config


def config_key(config: Config) -> str:
    """A stable text key for a full config (to find configs measured already)."""
    return json.dumps(config, sort_keys=True)


def when_text(when: dict) -> str:
    """A `when` condition, short: "compile is not none" where it lists every other choice."""
    parts = []
    for name, wanted in when.items():
        values = wanted if isinstance(wanted, list) else [wanted]
        knob = CATALOGUE[name]
        others = [c for c in knob.choices if c != knob.default]
        if sorted(map(str, values)) == sorted(map(str, others)):
            parts.append(f"{name} is not {knob.default}")
        else:
            parts.append(f"{name} in {', '.join(map(str, values))}")
    return " and ".join(parts)


def _unmet_conditions(dims: list[Dimension]):
    """(dimension, (knob, wanted values, values tried)) for each dimension whose `when` asks for
    values the space never gives that knob: it would silently never be searched."""
    tried = {d.name: d.choices for d in dims}
    for dim in dims:
        for other, value in (dim.when or {}).items():
            wanted = value if isinstance(value, list) else [value]
            takes = tried.get(other, (CATALOGUE[other].default,))
            if not any(w in takes for w in wanted):
                yield dim, (other, wanted, takes)
                break


def searched(dimensions: list[Dimension], keeps: Callable[[str, Any], bool]) -> list[Dimension]:
    """`dimensions` with the choices `keeps(knob, value)` keeps. A knob left one choice is not
    searched: it stays at its baseline, which every dimension holds (`_dimensions`)."""
    kept = [(d, tuple(value for value in d.choices if keeps(d.name, value))) for d in dimensions]
    return [Dimension(d.name, choices, d.when) for d, choices in kept if len(choices) > 1]


def stored_form(dimensions: list[Dimension]) -> dict:
    """A space as a study stores it: knob -> choices and condition, through JSON, as storages keep
    it (a tuple comes back a list), so that a resumed run compares like with like."""
    return json.loads(json.dumps({d.name: {"choices": list(d.choices), "when": d.when} for d in dimensions}))


def _without_unmet(dims: list[Dimension], why: str) -> tuple[list[Dimension], list[Dropped]]:
    """The dimensions whose conditions can be met, and a Dropped for each choice of the others
    (again until none is left: a dropped knob may be another's condition)."""
    dropped = []
    while unmet := list(_unmet_conditions(dims)):
        for dim, _ in unmet:
            dropped += [Dropped(dim.name, value, f"searched only when {when_text(dim.when)}, {why}")
                        for value in dim.choices if value != CATALOGUE[dim.name].default]
        gone = {dim.name for dim, _ in unmet}
        dims = [d for d in dims if d.name not in gone]
    return dims, dropped


# ---- file parsing ---------------------------------------------------------------------------------
def _read_layers(path: Path) -> tuple[dict, list, list, set]:
    """A space file with the files it extends: its knobs, forbid rules and seeds, and the names
    of the knobs this file itself sets (the others come from the files it extends). Walked in a
    loop: read recursively, a chain of 1500 generated files met Python's recursion limit, which
    the YAML reader blamed on a sound file as "nested too deeply"."""
    chain: list[tuple[Path, dict]] = []  # the file, then each it extends, read and checked in turn
    seen: set[Path] = set()
    while True:
        if path.resolve() in seen:  # resolved: `extends: ../spaces/me.yaml` names the same file
            raise SpaceError(f"search space {path}: 'extends' loops back to itself")
        seen.add(path.resolve())
        data = read_yaml(path, "search space", SpaceError)
        if not isinstance(data, dict):
            raise SpaceError(f"search space {path}: expected a mapping with 'knobs:' at the top")
        unknown = set(data) - {"extends", "knobs", "forbid", "seeds"}
        if unknown:
            # as text: YAML reads `1:` as a number, and numbers and names do not sort together
            raise SpaceError(f"search space {path}: unknown section(s) {', '.join(sorted(map(str, unknown)))}")
        chain.append((path, data))
        if not data.get("extends"):
            break
        parent = data["extends"]
        if not isinstance(parent, str):
            raise SpaceError(f"search space {path}: 'extends' takes one file name (a space extends one "
                             f"other, which may extend another), not {parent!r:.60}")
        named = parent
        parent = path.parent / named
        if not parent.exists() and (SHIPPED_DIR / named).is_file():
            # a shipped space by its name (a copy of one, edited, extends what the original did)
            parent = SHIPPED_DIR / named
        if not parent.exists():
            raise SpaceError(f"search space {path}: it extends {parent}: no such file (named relative to the "
                             f"file that extends it, or one of the shipped spaces: {', '.join(shipped_names())})")
        path = parent
    knobs, forbid, seeds = {}, [], []
    for path, data in reversed(chain):  # the farthest first: each file overrides what it extends
        # `is None`, not falsiness: an empty list or string is the wrong type, not an empty section
        own = {} if data.get("knobs") is None else data["knobs"]
        if not isinstance(own, dict):
            if not own:  # `knobs: []`, `knobs: ""`
                raise SpaceError(f"search space {path}: it names no knobs ('knobs' must be a mapping of "
                                 "knob: choices, such as {dtype: [float32, bfloat16]})")
            raise SpaceError(f"search space {path}: 'knobs' must be a mapping of knob: choices")
        knobs.update(own)
        more = [] if data.get("forbid") is None else data["forbid"]
        if not isinstance(more, list):
            raise SpaceError(f"search space {path}: 'forbid' must be a list of partial configs")
        forbid += more
        if "seeds" in data:  # a file's own seeds replace the ones it extends
            seeds = [] if data["seeds"] is None else data["seeds"]
            if not isinstance(seeds, list):
                raise SpaceError(f"search space {path}: 'seeds' must be a list of partial configs")
    return knobs, forbid, seeds, set(own)  # `own`: the space's file, the last walked


def _check_value(name: str, value, path) -> None:
    if name not in CATALOGUE:
        known = ", ".join(CATALOGUE)
        raise SpaceError(f"search space {path}: unknown knob '{name}' (known: {known})")
    try:
        CATALOGUE[name].check(value)
    except ValueError as exc:
        raise SpaceError(f"search space {path}: {exc}") from None


def _dimensions(knobs: dict, path) -> list[Dimension]:
    dims, order = [], list(CATALOGUE)
    for name in order:  # catalogue order, so `when` can only look at knobs decided earlier
        if name not in knobs:
            continue
        spec, when = knobs[name], None
        if isinstance(spec, dict):
            unknown = sorted(map(str, set(spec) - {"choices", "when"}))
            if unknown:
                raise SpaceError(f"search space {path}: knob '{name}' takes 'choices' and 'when', "
                                 f"not {', '.join(unknown)}")
            if "choices" not in spec:
                raise SpaceError(f"search space {path}: knob '{name}': the mapping form needs "
                                 "'choices' (the values to try) beside 'when'")
            if "when" not in spec:  # the mapping form is for conditional knobs only
                listed = spec["choices"] if isinstance(spec["choices"], list) else [spec["choices"]]
                raise SpaceError(
                    f"search space {path}: knob '{name}': a mapping with 'choices' needs 'when' (the "
                    f"condition to search it under); to search it always, write the list alone: "
                    f"{name}: [{', '.join(map(str, listed))}]"
                )
            spec, when = spec["choices"], spec["when"]
            if not isinstance(when, dict) or not when:
                raise SpaceError(f"search space {path}: knob '{name}': 'when' must be a non-empty mapping "
                                 f"of knob: value(s), such as {{dtype: bfloat16}}, not {when!r:.40}")
            for other, value in when.items():
                if value == []:
                    raise SpaceError(f"search space {path}: knob '{name}': 'when' gives '{other}' no value "
                                     "(name the value or values it is searched under)")
                for v in value if isinstance(value, list) else [value]:
                    _check_value(other, v, path)
                # configs are filled in catalogue order: a later knob is still at its baseline
                # value when this one's condition is read, and the knob would silently never move
                if order.index(other) >= order.index(name):
                    on = "itself" if other == name else f"'{other}', which is decided after it"
                    earlier = ", ".join(order[: order.index(name)]) or "none, it is decided first"
                    raise SpaceError(f"search space {path}: knob '{name}' has a 'when' on {on} (knobs are "
                                     f"decided in catalogue order; those before '{name}': {earlier})")
        choices = spec if isinstance(spec, list) else [spec]
        if not choices:  # `dtype: []` would leave the knob unsearched, in silence
            raise SpaceError(f"search space {path}: knob '{name}' has no choices (list the values to try, "
                             "or leave the knob out to keep it at the baseline's)")
        for value in choices:
            _check_value(name, value, path)
        default = CATALOGUE[name].default
        if default not in choices:  # the baseline must stay a point of the space
            choices = [default, *choices]
        choices = tuple(dict.fromkeys(choices))
        if len(choices) > 1:  # a knob with only the baseline's value is not searched
            dims.append(Dimension(name, choices, when))
    for name in knobs:
        if name not in CATALOGUE:
            _check_value(name, None, path)
    return dims


def _forbid_rules(rules: list, path, section: str = "forbid") -> list[dict]:
    """Partial configs (forbid rules, seeds), each knob and value checked against the catalogue."""
    for rule in rules:
        if not isinstance(rule, dict) or not rule:
            raise SpaceError(f"search space {path}: each '{section}' entry must be a mapping of knob: value")
        for name, value in rule.items():
            if section == "seeds" and isinstance(value, list):
                raise SpaceError(f"search space {path}: a seed names one value per knob ({name}: {value})")
            if value == []:  # a rule that could never match
                raise SpaceError(f"search space {path}: a '{section}' entry gives '{name}' no value")
            for v in value if isinstance(value, list) else [value]:
                _check_value(name, v, path)
    return rules
