"""The wire from an isolated process to pytest: frame kinds, their shapes, send and read.

A frame is ``(kind, payload)`` in plain data (``wire``: reading it runs no code);
``kind`` is one of the constants below, which are the whole vocabulary, and each
kind's payload has one shape (``SHAPES``): a frame of another kind or shape is the
test's error, never silently dropped and never pytest's. Frames larger than
``SPILL_BYTES`` are written to a private (0600) file in the session directory, under
a name pytest chose for the test (``spill-<tag>-N``); only ``N`` crosses the pipe,
so the pipe never carries more than a small message. pytest reads the pipe without
blocking (``Reader``): a frame that never completes costs it nothing past the
test's deadline, and what it keeps of one test's frames is bounded (``KEEP_BYTES``,
counted as what they cost decoded, judged before a large one is decoded).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import stat
import struct
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from . import wire

READY = "ready"  # the bootstrap is done: the process can answer a stack-dump request (pid)
PHASE = "phase"  # what the process is doing while it starts: "importing test_x.py" (text)
BEGIN = "begin"  # the test's protocol begins (setup): its timeout clock starts (nodeid, when)
END = "end"  # the test's protocol (or run_isolated's call) is over: the clock stops (None)
AHEAD = "ahead"  # a prewarmed process collected its test's module before its go (module)
STALE = "stale"  # a prewarmed process can't take its GPUs: start afresh ({cuda, read, module})
REPORT = "report"  # a pytest report, as pytest_report_to_serializable data
WARNING = "warning"  # a warning of the test (``encode_warning``)
JUNIT = "junit"  # a record_xml_attribute / record_testsuite_property call, to replay
TORCH_LEAK = "torch_leak"  # torch's CUDA allocator grew during the test ({device, bytes})
DRIVER = "driver"  # a test that leased no GPU loaded CUDA's driver or NVML (their file names)
IMPORTED = "imported"  # what the test imported ({names: [(name, origin)], modules}: learnable)
FIXTURE = "fixture"  # a fixture of a scope broader than the test is set up ((name, scope))
EXIT = "exit"  # pytest.exit() or Ctrl-C in the test: the session ends ({interrupt, ...})
ERROR = "error"  # why the process could not run its test (text)
RESULT = "result"  # run_isolated: the function's value
EXCEPTION = "exception"  # run_isolated: the exception it raised (``describe_exception``)
PAYLOAD = "payload"  # other plugins' data from the test's process (pytest_gpuiso_child_payload)
DONE = "done"  # the job finished (its exit status)
EXITING = "exiting"  # the very last: descriptors closed, only os._exit comes next (None)
SPILL_BYTES = 1 << 20  # 1 MiB: a larger frame goes in a file
SPILL_MAX = 256 << 20  # the largest spill file read
KEEP_BYTES = 512 << 20  # what one test's kept frames may cost decoded (``cost``)
_ALWAYS_KEPT = (READY, BEGIN, END, EXIT, DONE, EXITING)  # past KEEP_BYTES too, when small
SMALL = 64 << 10  # a frame decoded before its cost is judged; the most one that times a test may be
# What a decoded frame costs pytest beyond its encoded bytes (measured on CPython 3.11:
# a decoded item, an empty dict or a short string, keeps 60-72 bytes), and a frame itself.
ITEM_COST, FRAME_COST = 80, 200
_KIND = re.compile(rb'\["T","([a-z_]{1,20})",')  # the start of an encoded frame: its kind
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # JSON strings, escapes included
# A character beyond the BMP: a surrogate's escape, or the lead byte of 4 UTF-8 bytes
_ASTRAL = re.compile(rb"\\u[dD][89abAB]|[\xf0-\xf4]")
_SPILL = "spill"  # a frame in a file: its payload is the file's number
_HEADER = struct.Struct("!i")  # multiprocessing's framing of send_bytes
_READ = 1 << 16


_TEXT = (str,)
_MAYBE_TEXT = (str, type(None))
_INT = (int,)
# The shape of each kind's payload: a type tuple, a dict of field shapes (those keys,
# and no others), a tuple of shapes (that many items), or a list of one shape.
SHAPES: dict[str, Any] = {
    READY: _INT,
    PHASE: _TEXT,
    BEGIN: (_TEXT, (float,)),  # when: the child's time.monotonic() (one clock on Linux)
    END: (type(None),),
    AHEAD: _TEXT,
    STALE: {"cuda": _MAYBE_TEXT, "read": _MAYBE_TEXT, "module": _MAYBE_TEXT},
    REPORT: (dict,),  # pytest_report_to_serializable data; pytest's hook checks the rest
    WARNING: {
        "message": _TEXT,
        "category_module": _TEXT,
        "category_name": _TEXT,
        "category_base": _TEXT,  # its nearest builtin base (``BUILTIN_WARNINGS``)
        "filename": _TEXT,
        "lineno": (int, type(None)),
        "nodeid": _TEXT,
    },
    JUNIT: (_TEXT, _MAYBE_TEXT, _TEXT, _TEXT),
    TORCH_LEAK: {"device": (int, str), "bytes": _INT},
    DRIVER: [_TEXT],
    IMPORTED: {"names": [(_TEXT, _TEXT)], "modules": _INT},
    FIXTURE: (_TEXT, _TEXT),
    EXIT: {"interrupt": (bool,), "message": _TEXT, "returncode": (int, type(None))},
    ERROR: _TEXT,
    RESULT: (bytes,),  # run_isolated's value, pickled: only its caller unpickles it
    EXCEPTION: {
        "type": _TEXT,
        "message": _TEXT,
        "traceback": _TEXT,
        "pickled": (bytes, type(None)),
    },
    PAYLOAD: (dict,),
    DONE: _INT,
    EXITING: (type(None),),
}
KINDS = frozenset(SHAPES)  # the whole vocabulary


UNREADABLE = "unreadable message from the test process: "  # an ERROR frame of the Reader's
UNCOLLECTED = "the isolated process could not collect "  # its test: the test's own error
# In a REPORT's data: its longrepr was a text with no crash line (a missing fixture's), which
# pytest serializes as a plain string; rebuilt as such a text, not as a string, which
# pytest's short summary would quote.
TEXT_REPR = "_gpuiso_text_repr"


class FrameError(ValueError):
    """A frame that is not one of ``KINDS``, or not of its kind's shape."""


def _fits(value: Any, shape: Any) -> bool:
    if isinstance(shape, dict):
        return (
            isinstance(value, dict)
            and value.keys() == shape.keys()
            and all(_fits(value[k], s) for k, s in shape.items())
        )
    if isinstance(shape, list):
        return isinstance(value, list) and all(_fits(v, shape[0]) for v in value)
    if shape and not isinstance(shape[0], type):  # a tuple of shapes
        return (
            isinstance(value, tuple)
            and len(value) == len(shape)
            and all(_fits(v, s) for v, s in zip(value, shape, strict=True))
        )
    if type(value) is int:  # what a JSON report can hold (merge refuses the rest)
        return int in shape and _INT64[0] <= value < _INT64[1]
    return type(value) in shape


_INT64 = (-(1 << 63), 1 << 63)


def check(frame: Any) -> tuple[str, Any]:
    """``frame`` when it is a ``(kind, payload)`` of a known kind and its shape, else
    ``FrameError`` saying what is wrong."""
    if not (isinstance(frame, tuple) and len(frame) == 2 and isinstance(frame[0], str)):
        raise FrameError(f"not a (kind, payload) pair: {type(frame).__name__}")
    kind, payload = frame
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind[:40]!r}")
    if not _fits(payload, SHAPES[kind]):
        raise FrameError(f"a {kind!r} frame of the wrong shape: {sketch(payload)}")
    if kind == TORCH_LEAK and payload["bytes"] < 0:
        raise FrameError(f"a {kind!r} frame of negative bytes: {sketch(payload)}")
    return kind, payload


def sketch(value: Any, most: int = 80) -> str:
    """``value``'s repr in at most ``most`` characters, for a one-line message."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


_spills = itertools.count(1)


def send_frame(conn: Connection, kind: str, payload: Any, spill_prefix: str) -> None:
    """Send one frame; spill it to a private file (``spill_prefix`` + a number) when it
    is large. ``wire.WireError`` for a payload that is not plain data."""
    check((kind, payload))
    data = wire.encode((kind, payload))
    if len(data) > SPILL_BYTES:
        number = next(_spills)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(f"{spill_prefix}{number}", flags, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        data = wire.encode((_SPILL, number))
    conn.send_bytes(data)


class Reader:
    """pytest's end of a test process's pipe: frames read without ever blocking.

    ``fill()`` reads what the pipe holds; ``next()`` gives the frames read so far, one
    at a time; ``drain()`` both, for what the pipe holds now. A frame the process never
    finishes, a spill file that is not one of ours (a link, a FIFO, too large), a frame
    of the wrong shape: each becomes an ``ERROR`` frame saying so, and the rest of the
    stream is read and dropped (it can no longer be trusted). Past ``KEEP_BYTES`` of
    frames, only the small ones that time the test are kept.
    """

    def __init__(self, conn: Connection, directory: Path, spill_name: str) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self.dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.spill_name = spill_name  # the spill files of this test: spill_name + N
        self.buffer = bytearray()
        self.eof = False  # the write end is closed
        self.broken = False  # a bad frame came: the rest is read and dropped
        self.kept = 0  # bytes of frames kept
        self.dropped = 0  # frames not kept past KEEP_BYTES
        self.errors: list[tuple[str, Any]] = []  # ERROR frames of our own, not yet given
        self.unread: list[tuple[str, Any]] = []  # frames given back (``put_back``): first

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        """Close the pipe; remove the spill files not read (a second call does nothing)."""
        self.conn.close()
        if self.dir_fd < 0:
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir_fd):
                if name.startswith(self.spill_name):
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=self.dir_fd)
        os.close(self.dir_fd)
        self.dir_fd = -1

    def fill(self, rounds: int = 16) -> None:
        """Read what the pipe holds now (up to ``rounds`` reads)."""
        for _ in range(rounds):
            try:
                chunk = os.read(self.fd, _READ)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                return
            if not self.broken:
                self.buffer += chunk

    def drain(self, seconds: float) -> list[tuple[str, Any]]:
        """The frames the pipe holds now, without waiting for more (a writer that keeps
        the pipe open and keeps writing gets ``seconds``)."""
        stop = time.monotonic() + seconds
        while not self.eof and time.monotonic() < stop and wait([self], 0):
            self.fill()
        found = []
        while (frame := self.next()) is not None:
            found.append(frame)
        return found

    def put_back(self, frames: list[tuple[str, Any]]) -> None:
        """Have ``frames`` (given by ``next``, in order) given again before any other."""
        self.unread[:0] = frames

    def next(self) -> tuple[str, Any] | None:
        """The next frame read, or None until more arrives."""
        if self.unread:
            return self.unread.pop(0)
        while True:
            if self.errors:
                return self.errors.pop(0)
            if self.broken or not self.buffer:
                return None
            if len(self.buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self.buffer)
                if not 0 <= size <= SPILL_BYTES + _HEADER.size:
                    self._break(f"it sent a message of {size} bytes (at most {SPILL_BYTES})")
                    continue
                end = _HEADER.size + size
                if len(self.buffer) >= end:
                    data = bytes(self.buffer[_HEADER.size : end])
                    del self.buffer[:end]
                    frame = self._frame(data)
                    if frame is not None:
                        return frame
                    continue
            if not self.eof:
                return None
            self._break(
                f"its last message was cut off ({len(self.buffer)} bytes of it arrived "
                "before it closed the pipe)"
            )

    def _frame(self, data: bytes) -> tuple[str, Any] | None:
        spent = None
        try:
            frame = wire.decode(data)  # at most SPILL_BYTES: a spill's number, or small
            if isinstance(frame, tuple) and len(frame) == 2 and frame[0] == _SPILL:
                data = self._spilled(frame[1])
                spent = None if data is None else cost(data)
                if spent is None or self.kept + spent + decoding(data) > KEEP_BYTES:
                    return self._drop("spilled")  # never decoded: it would not be kept
                frame = wire.decode(data)
            kind, payload = check(frame)
        except (wire.WireError, FrameError) as exc:
            self._break(str(exc))
            return None
        spent = cost(data) if spent is None else spent
        if kind in _ALWAYS_KEPT:
            if len(data) > SMALL:
                self._break(f"a {kind!r} frame of {len(data)} bytes (at most {SMALL})")
                return None
        elif self.kept + spent > KEEP_BYTES:
            return self._drop(repr(kind))
        self.kept += spent
        return kind, payload

    def _drop(self, what: str) -> None:
        """A frame past ``KEEP_BYTES``: not kept, said once (the first one's kind)."""
        self.dropped += 1
        if self.dropped == 1:
            self.errors.append(
                (
                    ERROR,
                    f"the test process sent messages that would take more than "
                    f"{KEEP_BYTES >> 20} MiB of pytest's memory; those past it were not kept "
                    f"(the first was a {what} frame)",
                )
            )

    def _spilled(self, number: Any) -> bytearray | None:
        """The contents of this test's spill file ``number``, which is then removed, read
        once; None, unread, when they could not be kept (past ``KEEP_BYTES``). A frame of
        a kind that times the test is refused from its first bytes: it is never that large."""
        if type(number) is not int or number <= 0:
            raise FrameError(f"a spill file number that is not one: {sketch(number)}")
        name = f"{self.spill_name}{number}"
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self.dir_fd)
        except OSError as exc:
            raise FrameError(f"its spill file {name} cannot be read ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FrameError(f"its spill file {name} is not a regular file")
            if st.st_size > SPILL_MAX:
                raise FrameError(
                    f"its spill file {name} has {st.st_size} bytes (at most {SPILL_MAX})"
                )
            said = _KIND.match(os.pread(fd, 32, 0))  # what it says it is, before reading it
            if said and said[1].decode() in _ALWAYS_KEPT:
                kind = said[1].decode()
                raise FrameError(f"a {kind!r} frame of {st.st_size} bytes (at most {SMALL})")
            if self.kept + FRAME_COST + 3 * st.st_size > KEEP_BYTES:  # kept, read, decoded
                return None
            data = bytearray(st.st_size)
            view, got = memoryview(data), 0
            while got < len(data) and (n := os.readv(fd, [view[got:]])):
                got += n
            view.release()
            del data[got:]  # a file cut short while read: what there is
            return data
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.dir_fd)  # a name in our directory, whatever it is

    def _break(self, why: str) -> None:
        self.broken = True
        self.buffer.clear()
        self.errors.append((ERROR, UNREADABLE + why))


def width(data: bytes) -> int:
    """Bytes a character of the frame's text takes once decoded (CPython keeps a string in
    1, 2 or 4 bytes a character, by its widest): 4 where it may hold a character beyond
    the BMP (a surrogate escape, a 4-byte UTF-8 sequence), 2 where any other non-ASCII, 1
    for ASCII. Judged on the bytes, conservatively for the whole frame."""
    if _ASTRAL.search(data):
        return 4
    if not data.isascii() or b"\\u" in data:
        return 2
    return 1


def cost(data: bytes) -> int:
    """What the frame ``data`` costs pytest once decoded, judged without decoding it: its
    text at its width, and each item it holds (counted by the separators outside its
    strings)."""
    bare = _STRINGS.sub(b"", data)
    items = bare.count(b",") + bare.count(b"[") + bare.count(b"{")
    return FRAME_COST + len(data) * width(data) + ITEM_COST * items


def decoding(data: bytes) -> int:
    """What decoding the frame ``data`` needs beside what it keeps (``cost``), until it is
    decoded: its bytes and their text (``wire.decode`` parses a str of them)."""
    return len(data) * (1 + width(data))
