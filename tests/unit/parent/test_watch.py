"""Watching a test's process: when its test began, frames read past the deadline."""

from __future__ import annotations

import math
import multiprocessing
import time

import pytest

from pytest_gpuiso.parent import watch
from pytest_gpuiso.wire import frames


def _pipe(tmp_path) -> tuple[frames.Reader, object]:
    """A frame reader on one end of a pipe, and the pipe's other end to write to."""
    conn, writer = multiprocessing.Pipe(duplex=False)
    return frames.Reader(conn, tmp_path, "spill-t-"), writer


def test_a_frame_sent_in_time_is_read_by_a_reader_that_comes_past_the_deadline(tmp_path):
    """pump reads what is in the pipe once more after the deadline: a BEGIN sent in time
    but read late (the reader was prewarming) is not a start-up timeout; anything else
    past the deadline is EXPIRED, however much more the sender writes."""
    reader, writer = _pipe(tmp_path)
    exited, _alive = multiprocessing.Pipe(duplex=False)  # a sentinel that never fires
    prefix = str(tmp_path / "spill-t-")
    past = time.monotonic() - 1
    frames.send_frame(writer, frames.BEGIN, ("t", past), prefix)
    received = watch.Received()
    assert watch.pump(reader, exited, received, past, frames.BEGIN) == frames.BEGIN
    frames.send_frame(writer, frames.PHASE, "still going", prefix)
    assert watch.pump(reader, exited, received, past, frames.END) == watch.EXPIRED
    assert [kind for kind, _ in received] == [frames.BEGIN, frames.PHASE]


@pytest.mark.parametrize("offset", [0.0, 1000.0, -1000.0, math.nan, math.inf])
def test_the_test_began_when_the_child_says_within_the_go_and_now(tmp_path, offset):
    """Watch takes the child's own clock for when its test began (its start-up and its
    timeout do not count the time the parent took to read BEGIN), but only between the
    go and the moment it was read: a stamp from the future cannot buy the test time."""
    reader, writer = _pipe(tmp_path)
    exited, closer = multiprocessing.Pipe(duplex=False)
    go_at = time.monotonic() - 10
    prefix = str(tmp_path / "spill-t-")
    frames.send_frame(writer, frames.BEGIN, ("t", go_at + 5 + offset), prefix)
    frames.send_frame(writer, frames.END, None, prefix)
    closer.close()  # the process has exited
    bounds = watch.Bounds(timeout=60, startup=60, grace=1)
    seen = watch.Watch(None, reader, exited, tmp_path / "stack", go_at, bounds)
    before = time.monotonic()
    assert seen.run() is False and seen.expired is None
    if offset == 0.0:  # five seconds after its go, though read only now
        assert seen.began == go_at + 5
    elif offset < 0:  # before its go: at its go
        assert seen.began == go_at
    else:  # later than it was read, or no time at all: when it was read
        assert before <= seen.began <= time.monotonic()
