"""Parsing the values of options, ini keys and marker arguments: one shape of error,
naming where the value came from and every form accepted."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpuiso.options import OPTIONS
from pytest_gpuiso.values import (
    MAX_SECONDS,
    SHOWN,
    SpecError,
    bad_value,
    parse_allowed,
    parse_count,
    parse_devices,
    parse_memory,
    parse_path,
    parse_policy,
    parse_preload,
    parse_seconds,
    parse_size,
    parse_template_wait,
)


@given(st.floats(min_value=1e-6, max_value=MAX_SECONDS, allow_nan=False))
def test_positive_seconds_round_trip_through_text(value):
    assert parse_seconds(repr(value), "--x", allow_zero=False) == value
    assert parse_seconds(value, "--x", allow_zero=False) == value


@given(st.one_of(st.text(), st.floats(), st.integers(), st.booleans(), st.none()))
def test_any_bad_value_raises_spec_error_naming_source_and_value(value):
    try:
        seconds = parse_seconds(value, "--gpu-isolate-timeout", allow_zero=False)
    except SpecError as exc:
        message = str(exc)
        shown = repr(value) if len(repr(value)) <= SHOWN else f"{repr(value)[: SHOWN - 4]}..."
        assert message.startswith(f"invalid value {shown}")
        assert " for --gpu-isolate-timeout: expected a number of seconds > 0, at most " in message
        assert "\n" not in message
    else:
        assert math.isfinite(seconds) and seconds > 0
        assert not isinstance(value, bool)


def test_zero_is_allowed_only_when_asked():
    assert parse_seconds("0", "--g", allow_zero=True) == 0
    with pytest.raises(SpecError, match="> 0"):
        parse_seconds("0", "--t", allow_zero=False)


@pytest.mark.parametrize("value", [-1, 1.0, "2", True, None])
def test_counts_must_be_non_negative_integers(value):
    with pytest.raises(SpecError, match=f"invalid value {value!r} for gpus"):
        parse_count(value, "gpus")


_SHAPE = re.compile(r"^invalid value (.+) for (.+): expected (.+)$")


def _bad(parse, value, what: str) -> re.Match:
    """The one line ``parse`` says of a bad ``value`` from ``what``, matched to the shape."""
    with pytest.raises(SpecError) as raised:
        parse(value, what)
    message = str(raised.value)
    shape = _SHAPE.match(message)
    assert shape and "\n" not in message, message
    assert (shape.group(1), shape.group(2)) == (repr(value), what), message
    return shape


VALUED = [o for o in OPTIONS if o.metavar and o.parse is not parse_path]  # paths: files.py


@pytest.mark.parametrize("option", VALUED, ids=lambda o: o.name)
def test_every_options_bad_value_is_one_line_of_one_shape(option):
    """From the command line or the ini file: the value, where it came from, and what
    is expected there (a path's are checked where it is written: test_security_misc)."""
    for what in (option.cli, f"ini {option.name}"):
        _bad(option.parse, "bogus", what)


@pytest.mark.parametrize(
    ("parse", "value", "forms"),
    [
        # gpu_memory accepts 25%, which its error did not name
        (parse_memory, "lots", ["bytes", "12GiB", "512MiB", "1.5GB", "KiB", "TB", "25%"]),
        (parse_memory, "150%", ["bytes", "12GiB", "25%", "more than 0%, at most 100%"]),
        (parse_memory, "0", ["more than 0 bytes and less than 8 EiB", "25%"]),
        (parse_size, "huge", ["bytes", "12GiB", "less than 8 EiB"]),
        (parse_devices, "0,gpu", ["auto", "none", "indices or UUIDs", ":SIZE", "bad entry"]),
        (parse_devices, "0,0", ["auto", "none", "each once", "device 0 is listed twice"]),
        (parse_preload, "1bad", ["none", "names of installed modules", "'1bad' is not"]),
        (parse_policy, "shm=loud", ["warn|fail|off", "kind=level", "gpu_memory", "bad part"]),
        (parse_allowed, ["gpu"], ["a kind or a list of kinds", "gpu_memory", "all", "'gpu'"]),
        (parse_allowed, 3, ["a kind or a list of kinds", "shm, process, gpu_memory", "all"]),
        (parse_count, 1.5, ["an integer >= 0"]),
        (parse_template_wait, "soon", ["from 0 to 240"]),
        (parse_template_wait, "1e10", ["from 0 to 240"]),
    ],
)
def test_a_bad_value_names_every_form_accepted_where_it_came_from(parse, value, forms):
    for what in ("--gpu-isolate-x", "ini gpu_isolate_x", "gpu_isolated marker argument x"):
        expected = _bad(parse, value, what).group(3)
        assert [form for form in forms if form not in expected] == [], expected


def test_a_long_bad_value_is_shown_by_its_start():
    shape = _SHAPE.match(str(bad_value("9" * 400, "--x", "a size")))
    assert shape and shape.group(1) == "'" + "9" * 35 + "...'"


def test_a_groups_memory_slices_together_are_n_times_one_never_more_than_a_gpu():
    """A distributed test's ranks sharing a GPU lease their slices together: bytes or a
    share times the ranks; a share past the whole GPU is none."""
    size = parse_memory("20GiB", "m").times(3)
    assert (size.size, size.share, size.text) == (60 << 30, 0, "3 x 20GiB")
    share = parse_memory("25%", "m").times(4)
    assert (share.size, share.share, share.on(80 << 30)) == (0, 1_000_000, 80 << 30)
    assert parse_memory("40%", "m").times(3) is None
