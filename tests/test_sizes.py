import re

import pytest

from autotune.sizes import format_size, parse_budget, parse_margin, parse_size, require_unit, short_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GB", 8 * 2**30),
        ("8gb", 8 * 2**30),
        ("7.5GiB", int(7.5 * 2**30)),
        ("8000MiB", 8000 * 2**20),
        ("512M", 512 * 2**20),
        ("1073741824", 2**30),
        ("64KB", 64 * 2**10),
    ],
)
def test_parses_sizes_as_people_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8XB", "-1GB", "0GB", "GB", "", "8iB", "1e9", "eight"])
def test_rejects_what_is_not_a_positive_size(text):
    with pytest.raises(ValueError) as exc:
        parse_size(text)
    assert "\n" not in str(exc.value) and text.strip() in str(exc.value)


def test_formats_round_trip_for_file_names():
    assert short_size(8 * 2**30) == "8GB"
    assert short_size(512 * 2**20) == "512MB"
    assert format_size(3 * 2**29) == "1.50 GiB"


@pytest.mark.parametrize(
    "text, expected",
    [("8GB", "8GB"), ("2GB", "2GB"), ("1.5GB", "1.5GB"), ("7.5GiB", "7.5GB"), ("512MB", "512MB"),
     ("1.25GB", "1280MB"), ("8000MiB", "8000MB"), ("2047MB", "2047MB"), ("1.2GB", "1.2GB"),
     ("1.24GB", "1.24GB"), ("1.05GB", "1.05GB"), ("64KB", "64KB"), ("1000", "1000B")],
)
def test_short_sizes_are_exact(text, expected):
    # Profile and study names are made from short_size: rounded, 1.24GB, 1.25GB and 1.2GB all
    # became 1.2GB (one file for three budgets), and the README's 8000MiB became 7.8GB.
    assert short_size(parse_size(text)) == expected


def test_short_sizes_parse_back_to_the_same_bytes():
    sizes = [2**30 + k for k in range(-3, 4)] + [n * 2**20 + k for n in (1, 999, 2047, 8000) for k in (0, 1, 1023)]
    sizes += [int(x * 2**30) for x in (0.1, 1.05, 1.2, 1.24, 1.25, 3.3, 7.8, 11.99)]
    names = [short_size(n) for n in sizes]
    assert [parse_size(name) for name in names] == sizes
    assert len(set(names)) == len(set(sizes))


@pytest.mark.parametrize(
    "text, expected",
    [("5%", 2**30 // 20), ("0", 0), ("0%", 0), ("512MB", 512 * 2**20), ("12.5%", 2**30 // 8),
     ("0MB", 0), ("0.0", 0), ("0b", 0)],  # no margin, in any unit
)
def test_margin_is_a_share_of_the_budget_or_a_size(text, expected):
    assert parse_margin(text, 2**30) == expected


@pytest.mark.parametrize("text", ["100%", "-5%", "five%", "lots", "-1GB"])
def test_rejects_bad_margins(text):
    with pytest.raises(ValueError, match="margin"):
        parse_margin(text, 2**30)


def test_a_typed_margin_other_than_zero_needs_its_unit():
    # "--margin 5" was 5 bytes: no margin at all, said as "a margin of 5 (5 B)"
    for text in ("512B", "0", "0.0", "5%"):
        require_unit(text, ("%", "GB"), "5%, 512MB, 0")
    for text in ("5", "5.5"):
        with pytest.raises(ValueError, match=f"'{text}' has no unit: did you mean {text}% or {text}GB"):
            require_unit(text, ("%", "GB"), "5%, 512MB, 0")
    # a margin stored so (a profile, a study of an earlier autotune) is still read as it was
    assert parse_margin("5", 2**30) == 5


def test_a_budget_needs_its_unit():
    assert parse_budget("8GB") == 8 * 2**30 and parse_budget("1024B") == 1024
    with pytest.raises(ValueError, match="'8' has no unit: did you mean 8GB"):
        parse_budget("8")
    with pytest.raises(ValueError, match="'2000' has no unit: did you mean 2000MB"):  # not 2000GB
        parse_budget("2000")
    # as MB it would be 905 TiB: a count of bytes, as a serving script passes one, is the likely meaning
    with pytest.raises(ValueError, match="'949100000' has no unit: did you mean 949100000B"):
        parse_budget("949100000")


@pytest.mark.parametrize("peak, margin", [(733 * 2**20, "5%"), (123456789, "12.5%"), (10**9, "512MB"), (10**9, "0"),
                                          (1, "5%")])
def test_the_smallest_budget_a_peak_fits_is_the_one_the_margin_rule_admits(peak, margin):
    # the report's best-vs-budget chart drew a config as fitting from its peak plus 5% of the
    # study's own budget; a profile judges 5% of the budget asked (Profile.fits)
    from autotune.sizes import parse_margin, smallest_budget

    budget = smallest_budget(peak, margin)
    assert peak + parse_margin(margin, budget) <= budget
    assert peak + parse_margin(margin, budget - 1) > budget - 1


def test_a_front_says_how_much_more_a_point_holds_where_its_size_reads_as_the_one_before():
    """A front of 859.52 MiB -> 0.567 s; 859.52 MiB -> 0.534 s read as a dominated point kept
    (helper-2): the second holds 4 KiB more, the fastest measured for a budget between them."""
    from autotune.console import front_sizes

    mib = 2**20
    peaks = [859 * mib, 859 * mib + 4096, 859 * mib + 8192, 861 * mib]
    assert front_sizes(peaks) == ["859.00 MiB", "859.00 MiB (+4.00 KiB)", "859.01 MiB", "861.00 MiB"]
    assert front_sizes([]) == []
    assert front_sizes([859 * mib, 859 * mib]) == ["859.00 MiB", "859.00 MiB"]  # a best off the front, at a peak on it


@pytest.mark.parametrize("text", ["1" * 5000, "1." + "1" * 5000 + "GB", "-" + "1" * 5000])
def test_a_size_of_thousands_of_digits_is_no_size(text):
    # int()'s own message, about sys.set_int_max_str_digits; the text cut short in the message
    with pytest.raises(ValueError, match=re.escape(f"'{text[:20]}...' is not a memory size (examples")):
        parse_budget(text)
    with pytest.raises(ValueError, match="too large for a memory size"):  # 401 digits: still read, and too large
        parse_size("1" + "0" * 400 + "TB")


@pytest.mark.parametrize("text", ["1.2.3", "1" * 5000])
def test_a_margin_that_is_no_number_is_no_margin(text):
    # require_unit read "1.2.3" with float(): Python's "could not convert string to float"
    require_unit(text, ("%", "GB"), "5%, 512MB, 0")  # no number, so not "has no unit"
    with pytest.raises(ValueError, match="is not a margin"):
        parse_margin(text, 2**30)


def test_a_size_past_any_memory_is_formatted():
    # 10**400 / 2**30 overflowed a float
    assert format_size(10**400) == "over 2**63 - 1 B"
    assert format_size(-(10**400)) == "below -(2**63 - 1) B"
    assert format_size(2**63 - 1) == "8589934592.00 GiB"
