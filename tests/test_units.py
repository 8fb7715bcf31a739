"""Fast unit tests of the pure pieces: value parsing, framing and spill, stack trimming."""

from __future__ import annotations

import math
import multiprocessing
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpuiso import ipc
from pytest_gpuiso.results import trim_stack
from pytest_gpuiso.spec import SpecError, parse_count, parse_seconds


@given(st.floats(min_value=1e-6, max_value=1e9, allow_nan=False))
def test_positive_seconds_round_trip_through_text(value):
    assert parse_seconds(repr(value), "--x", allow_zero=False) == value
    assert parse_seconds(value, "--x", allow_zero=False) == value


@given(st.one_of(st.text(), st.floats(), st.integers(), st.booleans(), st.none()))
def test_any_bad_value_raises_spec_error_naming_source_and_value(value):
    try:
        seconds = parse_seconds(value, "--gpu-isolate-timeout", allow_zero=False)
    except SpecError as exc:
        message = str(exc)
        assert message.startswith(f"invalid value {value!r} for --gpu-isolate-timeout")
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


@pytest.mark.parametrize("size", [10, ipc.SPILL_BYTES - 100, ipc.SPILL_BYTES + 1, 5_000_000])
def test_frames_round_trip_and_spill_files_are_removed(tmp_path, size):
    reader, writer = multiprocessing.Pipe(duplex=False)
    payload = b"x" * size
    sender = multiprocessing.get_context("fork").Process(
        target=ipc.send_frame, args=(writer, "blob", payload, str(tmp_path))
    )
    sender.start()
    kind, received = ipc.recv_frame(reader)
    sender.join()
    assert (kind, received) == ("blob", payload)
    assert os.listdir(tmp_path) == []


def test_spill_files_are_private(tmp_path, monkeypatch):
    seen = []
    real_unlink = os.unlink

    def spy(path):
        seen.append(os.stat(path).st_mode & 0o777)
        real_unlink(path)

    monkeypatch.setattr(ipc.os, "unlink", spy)
    reader, writer = multiprocessing.Pipe(duplex=False)
    ipc.send_frame(writer, "blob", b"y" * (ipc.SPILL_BYTES + 1), str(tmp_path))
    ipc.recv_frame(reader)
    assert seen == [0o600]


def test_trim_stack_keeps_test_frames_and_folds_internals():
    dump = "\n".join(
        [
            "Thread 0x1 (most recent call first):",
            '  File "/usr/lib/python3/threading.py", line 320 in wait',
            '  File "/x/site-packages/_pytest/runner.py", line 1 in a',
            "",
            "Current thread 0x2 (most recent call first):",
            '  File "/src/test_x.py", line 5 in helper',
            '  File "/src/test_x.py", line 9 in test_x',
            '  File "/x/site-packages/_pytest/python.py", line 187 in pytest_pyfunc_call',
            '  File "/x/site-packages/pluggy/_callers.py", line 1 in _multicall',
            '  File "/x/site-packages/_pytest/runner.py", line 2 in b',
        ]
    )
    trimmed = trim_stack(dump).splitlines()
    assert trimmed == [
        "Thread 0x1 (most recent call first):",
        '  File "/usr/lib/python3/threading.py", line 320 in wait',
        "  ... 1 frames of pytest and pytest-gpuiso internals",
        "",
        "Current thread 0x2 (most recent call first):",
        '  File "/src/test_x.py", line 5 in helper',
        '  File "/src/test_x.py", line 9 in test_x',
        "  ... 3 frames of pytest and pytest-gpuiso internals",
    ]
