"""The wire between a test's process and pytest's: frames, spill files, the budget of
what is decoded, plain data."""

from __future__ import annotations

import multiprocessing
import os
import re
from multiprocessing.connection import wait

import pytest

from pytest_gpuiso.wire import frames, wire


def _read_all(reader: frames.Reader) -> list:
    """Every frame until the sender closes its end."""
    received: list = []
    while not reader.eof:
        wait([reader], 10)
        reader.fill()
        while (frame := reader.next()) is not None:
            received.append(frame)
    return received


def _pipe(tmp_path) -> tuple[frames.Reader, object]:
    conn, writer = multiprocessing.Pipe(duplex=False)
    return frames.Reader(conn, tmp_path, "spill-t-"), writer


@pytest.mark.parametrize("size", [10, frames.SPILL_BYTES - 100, frames.SPILL_BYTES + 1, 5_000_000])
def test_frames_round_trip_and_spill_files_are_removed(tmp_path, size):
    reader, writer = _pipe(tmp_path)
    payload = b"x" * size
    sender = multiprocessing.get_context("fork").Process(
        target=frames.send_frame,
        args=(writer, frames.RESULT, payload, str(tmp_path / "spill-t-")),
    )
    sender.start()
    writer.close()  # a sender that fails closes the pipe: the end of the stream, not a hang
    received = _read_all(reader)
    sender.join()
    assert received == [(frames.RESULT, payload)]
    assert os.listdir(tmp_path) == []
    reader.close()


def _raw(writer, frame) -> None:
    writer.send_bytes(wire.encode(frame))


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (("blob", b"x"), "unknown frame kind 'blob'"),
        ((frames.WARNING, {}), "a 'warning' frame of the wrong shape: {}"),
        ((frames.READY, "1"), "a 'ready' frame of the wrong shape: '1'"),
        ((frames.JUNIT, ("p", None, "n")), "a 'junit' frame of the wrong shape: ('p', None, 'n')"),
        (["ready", 1], "not a (kind, payload) pair: list"),
    ],
)
def test_a_frame_of_an_unknown_kind_or_the_wrong_shape_is_an_error_on_either_side(
    tmp_path, frame, error
):
    """The vocabulary is closed and each kind has one shape: send_frame refuses another,
    and the reader turns one that arrives anyway into an ERROR frame, then drops the rest."""
    reader, writer = _pipe(tmp_path)
    if isinstance(frame, tuple):
        with pytest.raises(frames.FrameError, match=re.escape(error)):
            frames.send_frame(writer, *frame, str(tmp_path / "spill-t-"))
    _raw(writer, frame)
    _raw(writer, (frames.DONE, 0))  # after a bad frame, nothing is trusted
    writer.close()
    assert _read_all(reader) == [
        (frames.ERROR, f"unreadable message from the test process: {error}")
    ]


def test_spill_files_are_private(tmp_path, monkeypatch):
    seen = []
    real_fstat = os.fstat

    def spy(fd):
        st = real_fstat(fd)
        seen.append(st.st_mode & 0o777)
        return st

    reader, writer = _pipe(tmp_path)
    frames.send_frame(
        writer, frames.RESULT, b"y" * (frames.SPILL_BYTES + 1), str(tmp_path / "spill-t-")
    )
    writer.close()
    monkeypatch.setattr(frames.os, "fstat", spy)
    assert [kind for kind, _ in _read_all(reader)] == [frames.RESULT]
    assert seen == [0o600]


@pytest.mark.parametrize(
    "value",
    [
        None,
        {"a": [1, 2.5, (3, "x")], "b": {(1, 2): b"\x00\xff", 3: None}},
        ("\udcff", float("inf"), -(10**30), True, []),
        [[], (), {}, b""],
    ],
)
def test_plain_data_round_trips_exactly(value):
    decoded = wire.decode(wire.encode(value))
    assert decoded == value and repr(decoded) == repr(value)  # tuples stay tuples


@pytest.mark.parametrize(
    "data",
    [b"[1]", b'["X", 1]', b'["D", 1]', b'["B", "***"]', b"{", b'["D", ["L"], 1]', b"[" * 100_000],
)
def test_bytes_that_are_not_a_message_are_a_wire_error(data):
    with pytest.raises(wire.WireError):
        wire.decode(data)


def test_values_that_are_not_plain_become_plain_or_their_repr():
    class Mine:
        def __repr__(self) -> str:
            return "<mine>"

    problems: list[str] = []
    value = {"n": IntFlagLike(3), "f": FloatLike(1.5), "s": [Mine()]}
    assert wire.plain(value, "payload", problems) == {"n": 3, "f": 1.5, "s": ["<mine>"]}
    assert len(problems) == 1 and problems[0].startswith("payload['s'][0] is a ")
    assert wire.plain(Mine(), "p", [], str) == "<mine>"
    with pytest.raises(wire.WireError, match="is not plain data"):
        wire.encode({"x": Mine()})


class IntFlagLike(int):
    pass


class FloatLike(float):
    pass


def test_past_the_budget_only_the_frames_that_time_the_test_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(frames, "KEEP_BYTES", 30_000)
    reader, writer = _pipe(tmp_path)
    prefix = str(tmp_path / "spill-t-")
    frames.send_frame(writer, frames.BEGIN, ("t", 1.0), prefix)
    for n in range(100):
        frames.send_frame(writer, frames.PHASE, f"{n:0200}", prefix)
    frames.send_frame(writer, frames.END, None, prefix)
    frames.send_frame(writer, frames.DONE, 0, prefix)
    writer.close()
    received = _read_all(reader)
    kinds = [kind for kind, _ in received]
    assert kinds[0] == frames.BEGIN and kinds[-2:] == [frames.END, frames.DONE]
    each = frames.cost(wire.encode((frames.PHASE, f"{0:0200}")))
    assert each > 214 + frames.FRAME_COST  # its bytes, the frame, and its items
    begin = frames.cost(wire.encode((frames.BEGIN, ("t", 1.0))))
    assert kinds.count(frames.PHASE) == (30_000 - begin) // each
    errors = [payload for kind, payload in received if kind == frames.ERROR]
    assert errors == [
        "the test process sent messages that would take more than 0 MiB of pytest's memory; "
        "those past it were not kept (the first was a 'phase' frame)"
    ]


def test_a_spilled_frame_past_the_budget_is_never_decoded(tmp_path, monkeypatch):
    """Tiny items cost ~70 bytes each decoded: judged by ``cost`` before decoding."""
    monkeypatch.setattr(frames, "KEEP_BYTES", 64 << 20)
    reader, writer = _pipe(tmp_path)
    prefix = str(tmp_path / "spill-t-")
    amplified = {"x": [{}] * (1 << 20)}  # 3 MiB encoded, ~80 MiB decoded
    assert frames.cost(wire.encode((frames.PAYLOAD, amplified))) > 64 << 20
    frames.send_frame(writer, frames.PAYLOAD, amplified, prefix)
    frames.send_frame(writer, frames.DONE, 0, prefix)
    writer.close()
    decoded = []
    real = wire.decode
    monkeypatch.setattr(wire, "decode", lambda data: decoded.append(len(data)) or real(data))
    received = _read_all(reader)
    assert max(decoded) < frames.SMALL  # the spill's number and DONE, never the spill
    assert [kind for kind, _ in received] == [frames.ERROR, frames.DONE]
    assert received[0][1].endswith("(the first was a spilled frame)")


@pytest.mark.parametrize(
    ("text", "wide"),
    [("ascii " * 100, 1), ("é" * 300, 2), ("\U0001f600" * 150, 4), ("\ud800" * 100, 2)],
)
def test_a_frames_cost_counts_its_text_at_its_decoded_width(text, wide):
    """CPython keeps a string at 1, 2 or 4 bytes a character, by its widest: a frame's
    cost (what it keeps) and its decoding (its bytes and their text, until decoded) count
    its text at that width, so that what is really held stays under KEEP_BYTES."""
    data = wire.encode((frames.PHASE, text))
    assert frames.width(data) == wide
    assert frames.cost(data) >= frames.FRAME_COST + len(data) * wide
    assert frames.decoding(data) == len(data) * (1 + wide)
    assert len(text) * wide <= frames.cost(data)  # at least what its str holds


def test_a_spill_whose_decoding_would_pass_the_budget_is_not_decoded(tmp_path, monkeypatch):
    """Its kept cost alone fits; with its bytes and their text while it is decoded, it
    would not: it is dropped, never decoded."""
    value = {"x": "\U0001f600" * (300 << 10)}  # 1.2 MB of UTF-8: spilled to a file
    data = wire.encode((frames.PAYLOAD, value))
    monkeypatch.setattr(frames, "KEEP_BYTES", frames.cost(data) + len(data))
    reader, writer = _pipe(tmp_path)
    prefix = str(tmp_path / "spill-t-")
    frames.send_frame(writer, frames.PAYLOAD, value, prefix)
    frames.send_frame(writer, frames.DONE, 0, prefix)
    writer.close()
    received = _read_all(reader)
    assert [kind for kind, _ in received] == [frames.ERROR, frames.DONE]
    assert received[0][1].endswith("(the first was a spilled frame)")


def test_a_large_frame_of_a_kind_always_kept_is_an_error(tmp_path):
    reader, writer = _pipe(tmp_path)
    prefix = str(tmp_path / "spill-t-")
    frames.send_frame(writer, frames.BEGIN, ("b" * (2 << 20), 1.0), prefix)
    frames.send_frame(writer, frames.DONE, 0, prefix)
    writer.close()
    received = _read_all(reader)
    assert len(received) == 1 and received[0][0] == frames.ERROR
    assert received[0][1] == frames.UNREADABLE + (
        f"a 'begin' frame of {len(wire.encode((frames.BEGIN, ('b' * (2 << 20), 1.0))))} bytes "
        f"(at most {frames.SMALL})"
    )


@pytest.mark.parametrize(
    ("kind", "value"),
    [(frames.BEGIN, ("b" * (3 << 20), 1.0)), (frames.PAYLOAD, {"x": "b" * (3 << 20)})],
)
def test_a_spill_that_could_not_be_kept_is_never_read_whole(tmp_path, monkeypatch, kind, value):
    """A spilled 'begin' is refused from its first bytes; a spill larger than what is left
    of the budget is dropped unread (before: read whole, then joined: two copies)."""
    monkeypatch.setattr(frames, "KEEP_BYTES", 2 << 20)
    reader, writer = _pipe(tmp_path)
    prefix = str(tmp_path / "spill-t-")
    frames.send_frame(writer, kind, value, prefix)
    frames.send_frame(writer, frames.DONE, 0, prefix)
    writer.close()
    read = []
    real = os.read

    def counted(fd: int, n: int) -> bytes:
        data = real(fd, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counted)
    monkeypatch.setattr(os, "readv", lambda fd, buffers: read.append(-1) or 0)
    received = _read_all(reader)
    assert -1 not in read and max(read, default=0) < 1 << 20, read  # no spill read whole
    assert received[0][0] == frames.ERROR
    assert list(tmp_path.glob("spill-t-*")) == []


def test_a_frame_cut_off_by_the_end_of_the_stream_is_an_error(tmp_path):
    reader, writer = _pipe(tmp_path)
    frames.send_frame(writer, frames.READY, 1, str(tmp_path / "spill-t-"))
    os.write(writer.fileno(), b"\x00\x00\x00\x64" + b"x" * 10)
    writer.close()
    assert _read_all(reader) == [
        (frames.READY, 1),
        (
            frames.ERROR,
            frames.UNREADABLE + "its last message was cut off (14 bytes of it arrived "
            "before it closed the pipe)",
        ),
    ]


def test_drain_takes_what_the_pipe_holds_in_order_and_waits_for_nothing_more(tmp_path):
    reader, writer = _pipe(tmp_path)
    assert reader.drain(5.0) == []  # nothing sent, the writer still open: no wait
    _raw(writer, (frames.PHASE, "importing test_x.py"))
    _raw(writer, (frames.BEGIN, ("t.py::t", 1.0)))
    assert reader.drain(5.0) == [
        (frames.PHASE, "importing test_x.py"),
        (frames.BEGIN, ("t.py::t", 1.0)),
    ]
    assert not reader.eof
    _raw(writer, (frames.END, None))
    writer.close()
    assert reader.drain(5.0) == [(frames.END, None)]
    assert reader.eof
    reader.close()
