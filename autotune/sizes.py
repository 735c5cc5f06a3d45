"""Memory sizes as people write them: "8GB", "7.5GiB", "8000MiB", "512M", "1073741824".

GB, MB and KB mean GiB, MiB and KiB (powers of 1024), as memory is sold and as nvidia-smi and
torch report it: an "8GB" card holds 8 GiB.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
# The largest size a 64-bit count holds, and so numpy and torch: a bound that keeps arithmetic on
# sizes finite (10**400 bytes overflowed a float, with a traceback; helper-11) and still takes the
# "unlimited" a serving script may pass (sys.maxsize; cgroup v1's 2**63 - 4096; helper-14).
MAX_SIZE = 2**63 - 1
# Digits bounded, each part under the 640 that int() may be limited to (sys.set_int_max_str_digits;
# Fraction reads the whole and the decimal part apart): 5000 digits got int()'s own message about
# that limit. 401 still read, as too large a size; 40 decimals as before.
_NUMBER = r"\d{1,600}(?:\.\d{1,600})?"
_SIZE = re.compile(rf"^\s*(-?{_NUMBER})\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE)


def _said(text) -> str:
    """`text` quoted for a message, cut short where long (a line, not 5000 digits)."""
    return f"'{text}'" if len(str(text)) <= 24 else f"'{str(text)[:20]}...'"


def parse_size(text: str) -> int:
    """Bytes in `text`; ValueError with a readable message when it is not a positive size."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{_said(text)} is not a memory size (examples: 8GB, 7.5GiB, 8000MiB)")
    # exactly, as written: a float rounded 99999999999999999999999TB to another number of bytes
    number, unit = Fraction(match.group(1)), (match.group(2) or "").lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{_said(text)} is not a positive memory size")
    check_size(size, _said(text))
    return size


def check_size(size: int | float, said: str) -> None:
    """ValueError for a size above MAX_SIZE (`said`: how the message names it)."""
    if size > MAX_SIZE:
        raise ValueError(f"{said} is too large for a memory size (over 2**63 - 1 bytes)")


def require_unit(text: str, units: tuple[str, ...], examples: str) -> None:
    """ValueError for a bare number other than 0: it would be bytes ("8" is 8 B), which no one
    means for a budget or a margin, so the likely units are named."""
    bare = str(text).strip()
    # a number as a size is written ("1.2.3" was float()'s own error; 5000 digits are no size)
    if re.fullmatch(_NUMBER, bare) and float(bare) != 0:
        raise ValueError(f"'{text}' has no unit: did you mean {' or '.join(bare + u for u in units)}? "
                         f"(examples: {examples}; B for bytes)")


def parse_budget(text: str) -> int:
    """A memory budget: a size with its unit (a search for 8 bytes is a search for nothing)."""
    size = parse_size(text)
    # 2000 is no card's GiB: more likely MB; 949100000 is no card's MiB (905 TiB): likely bytes,
    # as a serving script passes a budget it read (the bare size parsed: a plain number)
    likely = "B" if size >= 2**20 else "MB" if size >= 256 else "GB"
    require_unit(text, (likely,), "8GB, 7.5GiB, 8000MiB")
    return size


def parse_margin(text: str, budget: int) -> int:
    """A safety margin in bytes: a share of the budget ("5%") or a size ("512MB", "0"). A bare
    number is bytes here: what a user types is checked by the CLI (require_unit), and a margin
    stored so by an earlier autotune is read as it was."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise ValueError(f"{_said(text)} is not a margin (examples: 5%, 512MB, 0)") from None
        if not 0 <= percent < 100:
            raise ValueError(f"margin {_said(text)} must be from 0% to under 100%")
        return int(budget * percent / 100)
    zero = _SIZE.match(text)
    if zero and float(zero.group(1)) == 0:  # 0, 0B, 0MB, 0.0: no margin, in any unit
        return 0
    try:
        return parse_size(text)
    except ValueError:
        raise ValueError(f"{_said(text)} is not a margin (examples: 5%, 512MB, 0)") from None


def fits(peak: int, margin: str, budget: int) -> bool:
    """The budget rule: a peak fits when it and the margin (parse_margin's text, taken of this
    budget) are within the budget. Profiles, the report and smallest_budget judge by it."""
    return peak + parse_margin(margin, budget) <= budget


def smallest_budget(peak: int, margin: str) -> int:
    """The smallest budget `peak` fits with `margin`: the peak plus the margin for a size; for
    a share of the budget, the budget whose share leaves the peak room (5%: peak / 0.95)."""
    text = str(margin).strip()
    if not text.endswith("%"):
        return peak + parse_margin(text, peak)
    budget = math.ceil(peak / (1 - float(text[:-1]) / 100))
    # parse_margin rounds the share down to whole bytes: the exact answer is a step or two away
    while not fits(peak, text, budget):
        budget += 1
    while budget > peak and fits(peak, text, budget - 1):
        budget -= 1
    return budget


def format_size(size: int | None) -> str:
    if size is None:
        return "-"
    if abs(size) > MAX_SIZE:  # no memory's size, and 10**400 / 2**30 overflowed a float
        return "over 2**63 - 1 B" if size > 0 else "below -(2**63 - 1) B"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= factor:
            return f"{size / factor:.2f} {unit}"
    return f"{size} B"


def short_size(size: int) -> str:
    """A file-name-friendly size that parses back to exactly `size` (profile and study names are
    made from it, so two budgets must never share one): 8GB, 7.5GB, 1280MB, 8000MB.

    GB with at most one decimal where that is exact, else whole MB; a size that is neither (typed
    as 1.24GB, or in bytes) gets a longer form that still parses back to it."""
    if size <= 0:
        return f"{size}B"
    # Preferred forms first, then longer ones; rounding once named 1.24GB and 1.25GB both 1.2GB.
    attempts = [("GB", 2**30, 0), ("GB", 2**30, 1), ("MB", 2**20, 0)]
    attempts += [(unit, factor, decimals) for decimals in (2, 3) for unit, factor in (("GB", 2**30), ("MB", 2**20))]
    attempts += [("KB", 2**10, 0)]
    for unit, factor, decimals in attempts:
        if size < factor:
            continue
        number = f"{size / factor:.{decimals}f}"
        if decimals:
            number = number.rstrip("0").rstrip(".")
        text = f"{number}{unit}"
        if parse_size(text) == size:
            return text
    return f"{size}B"
