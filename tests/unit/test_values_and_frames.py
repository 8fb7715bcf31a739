"""Fast unit tests of the pure pieces: value parsing, framing and spill, stack trimming."""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import time
from multiprocessing.connection import wait

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpuiso.child import imports
from pytest_gpuiso.options import OPTIONS
from pytest_gpuiso.parent import watch
from pytest_gpuiso.parent.results import trim_stack
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
from pytest_gpuiso.wire import frames, wire


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


def test_the_preload_modules_a_test_needs_are_those_its_files_import(tmp_path):
    (tmp_path / "conftest.py").write_text("import numpy as np\n")
    (tmp_path / "sub").mkdir()
    module = tmp_path / "sub" / "test_x.py"
    module.write_text(
        "import os, einops.layers as layers\n"
        "from safetensors import numpy\n"
        "def test_t():\n"
        "    torch = pytest.importorskip('torch')\n"
        '    jax = importlib.import_module("jax")\n'
    )
    preload = ("torch", "numpy", "einops", "cattrs", "safetensors.torch", "jax", "scipy")
    assert imports.needed(preload, module) == (
        "torch",
        "numpy",
        "einops",
        "safetensors.torch",
        "jax",
    )
    assert imports.needed(preload, tmp_path / "missing.py") == ("numpy",)  # the conftest's


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
