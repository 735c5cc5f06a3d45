"""Errors a user can act on, and the file checks that give them in one line (reading the YAML files
a user hands in, a folder that takes no file).

Anything raised as an `AutotuneError` reaches the user as one line (no traceback) and a non-zero
exit from the CLI; from the Python API it is an ordinary exception with a readable message.
"""

import functools
import os
import sys
import warnings


class AutotuneError(Exception):
    """A problem the user can fix: bad input, a missing file, an impossible budget."""


class ModelError(AutotuneError):
    """The model named cannot be resolved or built."""


class SpaceError(AutotuneError):
    """A search-space file is malformed or names something unknown."""


class ProfileError(AutotuneError):
    """A profile file is missing, corrupt, truncated or of another format version."""


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn, attributed to the first frame outside autotune: the serving code's line that
    called load_pipeline or apply, however deep inside autotune the check ran (a fixed stacklevel
    named that line from one entry point and a line of autotune from another). Python 3.12's
    skip_file_prefixes does this; 3.10 and 3.11 are supported too."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def first_line(exc: BaseException) -> str:
    """The first line of what an exception says, for a one-line error: a database error's own
    (`orig`, under SQLAlchemy's wrapper, which adds lines of its own), or the exception's type
    where it says nothing."""
    said = str(getattr(exc, "orig", None) or exc).strip()
    return said.splitlines()[0] if said else type(exc).__name__


def os_reason(exc: OSError) -> str:
    """What an OSError says, readable at the end of a one-line error."""
    if isinstance(exc, FileExistsError):  # mkdir where a file has the folder's name
        return "a file is in the way"
    return exc.strerror or str(exc)


def why_unwritable(folder) -> str | None:
    """Why no file can be created in `folder` (a Path, made first where missing), or None.
    Run before a search, so that a path that takes no file fails then, not after it."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return os_reason(exc)
    return None


# What aliases may repeat of a file, in values and characters: a profile's best repeats one of its
# front points (a few hundred); a billion laughs is refused before it has composed much.
ALIASES_REPEAT_AT_MOST = 1_000_000


@functools.cache
def _unique_key_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one
    without a word, so a knob listed twice in a space file (or a field in a hand-edited profile)
    would quietly lose the first. The YAML spec requires keys to be unique.

    Aliases (*name) are read only where they repeat little and make no cycle: autotune writes
    none (profile._Dumper), but yaml.safe_dump does for an object a document holds twice (a
    profile written by a script, its best one of its front points). Nine nested ones in 1.3 KB
    (a "billion laughs") repeated a billion values when `show` printed them, and one inside its
    own anchor is a cycle. And a scalar its tag's constructor cannot convert (2026-02-30,
    !!int abc, 5000 digits) is a YAML error with its line, not the constructor's ValueError."""
    import sys

    import yaml

    class DuplicateKey(yaml.constructor.ConstructorError):
        pass

    class Alias(yaml.composer.ComposerError):
        pass

    class BadValue(yaml.constructor.ConstructorError):
        pass

    class Loader(yaml.SafeLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self.sizes, self.composed, self.repeated = {}, 0, 0  # sizes: each anchor's, once composed

        def compose_node(self, parent, index):
            # values and characters composed, an alias's anchor counted again for each alias
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                name, line = event.anchor, event.start_mark.line + 1
                if name in self.anchors and name not in self.sizes:  # the composer holds it from its start
                    raise Alias(None, None, f"the alias *{name} at line {line} is inside the value it names: "
                                "a cycle, which no reader can follow", event.start_mark)
                size = self.sizes.get(name, 0)  # 0: an undefined alias, said by the composer
                self.composed += size
                self.repeated += size
                if self.repeated > ALIASES_REPEAT_AT_MOST:
                    raise Alias(None, None, f"with the alias *{name} at line {line}, aliases repeat over "
                                f"{ALIASES_REPEAT_AT_MOST:,} values and characters (a \"billion laughs\"?): "
                                "write the values out", event.start_mark)
                return super().compose_node(parent, index)
            name, start = event.anchor, self.composed
            self.composed += 1 + (len(event.value) if isinstance(event, yaml.ScalarEvent) else 0)
            node = super().compose_node(parent, index)
            if name is not None:
                self.sizes[name] = self.composed - start
            return node

        def construct_object(self, node, deep=False):
            if not isinstance(node, yaml.ScalarNode):
                return super().construct_object(node, deep)
            try:
                return super().construct_object(node, deep)
            # what the safe constructors raise on text their tag's pattern let through: int('abc'),
            # a date out of range, a bool_values KeyError, a timestamp regex that did not match
            except (ValueError, ArithmeticError, LookupError, AttributeError) as exc:
                tag = node.tag.replace("tag:yaml.org,2002:", "!!")
                shown = node.value if len(node.value) <= 40 else node.value[:36] + "..."
                digits, limit = sum(c.isdigit() for c in node.value), getattr(sys, "get_int_max_str_digits", int)()
                if tag == "!!int" and limit and digits > limit:  # not int()'s advice to raise the limit
                    reason = f": {digits} digits, over the {limit} Python reads"
                elif tag == "!!timestamp" and isinstance(exc, ValueError):  # datetime's words are a person's
                    reason = f": {first_line(exc)}"  # "day is out of range for month"
                else:
                    reason = ""
                raise BadValue(None, None, f"{shown!r} cannot be read as {tag}{reason}", node.start_mark) from None

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the safe loader's own "unhashable key" error says it below
                if key in seen:
                    raise DuplicateKey(None, None, f"the key {key!r} appears twice in one mapping", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    Loader.DuplicateKey, Loader.Alias, Loader.BadValue = DuplicateKey, Alias, BadValue
    return Loader


def read_yaml(path, what: str, error: type[AutotuneError], hint: str = ""):
    """The data of the YAML file `path` (a `what`: "profile", "search space"), read with the safe
    loader; each way the file can fail is `error` with one line that names it (invalid YAML
    followed by `hint`)."""
    import re
    import stat

    import yaml

    try:
        mode = path.stat().st_mode
        # a device (/dev/zero) is read until memory runs out, a FIFO waits for a writer: refused
        # unread (a folder is said below, as it fails to read)
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise error(f"{what} {path}: not a regular file (a device or a pipe?)")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise error(f"{what} {path}: cannot read it ({os_reason(exc)})") from None
    except UnicodeDecodeError:
        raise error(f"{what} {path}: not UTF-8 text (a binary or foreign file?)") from None
    except ValueError:  # os.stat's "embedded null byte"
        raise error(f"{what} {str(path)!r}: a path cannot hold a NUL byte") from None
    loader = _unique_key_loader()
    try:
        return yaml.load(text, Loader=loader)
    except loader.DuplicateKey as exc:
        at = f" at line {exc.problem_mark.line + 1}" if exc.problem_mark else ""
        raise error(f"{what} {path}: {exc.problem}{at}: keep one") from None
    except loader.Alias as exc:
        raise error(f"{what} {path}: {exc.problem}") from None
    except loader.BadValue as exc:
        raise error(f"{what} {path}: not valid YAML at line {exc.problem_mark.line + 1} ({exc.problem}){hint}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        tag = re.search(r"constructor for the tag '([^']*)'", str(getattr(exc, "problem", "")))
        if tag:  # valid YAML, with a tag that makes a Python object (!!python/...) or a custom type
            name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
            raise error(f"{what} {path}: it uses the tag {name}{at}, which safe loading refuses "
                        "(it builds no Python objects or custom types): write plain values") from None
        raise error(f"{what} {path}: not valid YAML{at}{hint}") from None
    except RecursionError:  # PyYAML composes nested collections recursively: 1000 '[' end it so
        raise error(f"{what} {path}: not valid YAML (nested too deeply){hint}") from None
    except (TypeError, ValueError) as exc:  # a collection its tag cannot take: `!!map [1]` unpacked a sequence as pairs
        raise error(f"{what} {path}: not valid YAML ({first_line(exc)}){hint}") from None
