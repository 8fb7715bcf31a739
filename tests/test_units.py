"""Fast unit tests of the pure pieces: value parsing, framing and spill, stack trimming."""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpuiso import frames
from pytest_gpuiso.results import trim_stack
from pytest_gpuiso.settings import MAX_SECONDS, SpecError, parse_count, parse_seconds


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


@pytest.mark.parametrize("size", [10, frames.SPILL_BYTES - 100, frames.SPILL_BYTES + 1, 5_000_000])
def test_frames_round_trip_and_spill_files_are_removed(tmp_path, size):
    reader, writer = multiprocessing.Pipe(duplex=False)
    payload = b"x" * size
    sender = multiprocessing.get_context("fork").Process(
        target=frames.send_frame, args=(writer, frames.RESULT, payload, str(tmp_path))
    )
    sender.start()
    writer.close()  # a sender that fails closes the pipe: EOFError here, not a hang
    kind, received = frames.recv_frame(reader)
    sender.join()
    assert (kind, received) == (frames.RESULT, payload)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("size", [10, 5_000_000])
def test_a_frame_of_an_unknown_kind_is_an_error_on_either_side(tmp_path, size):
    """The vocabulary is closed: send_frame refuses an unknown kind, and recv_frame
    raises for one that arrives anyway (in the pipe or in a spill file)."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    with pytest.raises(frames.FrameError, match="unknown frame kind 'blob'"):
        frames.send_frame(writer, "blob", b"x", str(tmp_path))
    data = pickle.dumps(("blob", b"x" * size))
    if size > frames.SPILL_BYTES:
        spill = tmp_path / "spill-1.pickle"
        spill.write_bytes(data)
        data = pickle.dumps((frames._SPILL, str(spill)))
    writer.send_bytes(data)
    with pytest.raises(frames.FrameError, match="unknown frame kind 'blob'"):
        frames.recv_frame(reader)
    assert os.listdir(tmp_path) == []


def test_spill_files_are_private(tmp_path, monkeypatch):
    seen = []
    real_unlink = os.unlink

    def spy(path):
        seen.append(os.stat(path).st_mode & 0o777)
        real_unlink(path)

    monkeypatch.setattr(frames.os, "unlink", spy)
    reader, writer = multiprocessing.Pipe(duplex=False)
    frames.send_frame(writer, frames.RESULT, b"y" * (frames.SPILL_BYTES + 1), str(tmp_path))
    frames.recv_frame(reader)
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
