"""The wire from an isolated process to pytest: frame kinds, send and receive, spill files.

A frame is ``(kind, payload)``, pickled; ``kind`` is one of the constants below,
which are the whole vocabulary: a frame of another kind is an error
(``FrameError``), never silently dropped. Frames larger than ``SPILL_BYTES`` are
written to a private (0600) file in the session directory and only the file's
path crosses the pipe, so the pipe never carries more than a small message and
the parent, which drains it while waiting on the child, never blocks on a
multi-megabyte ``recv``. The parent deletes spill files as it reads them.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
import warnings
from importlib import import_module
from multiprocessing.connection import Connection, wait
from typing import Any

READY = "ready"  # the bootstrap is done: the process can answer a stack-dump request (pid)
PHASE = "phase"  # what the process is doing while it starts: "importing test_x.py" (text)
BEGIN = "begin"  # the test's protocol begins (setup): its timeout clock starts (nodeid)
END = "end"  # the test's protocol (or run_isolated's call) is over: the clock stops (None)
AHEAD = "ahead"  # a prewarmed process collected its test's module before its go (module)
STALE = "stale"  # a prewarmed process can't take its GPUs: start afresh ({cuda, read, module})
REPORT = "report"  # a pytest report, as pytest_report_to_serializable data
WARNING = "warning"  # a warning of the test (``encode_warning``)
JUNIT = "junit"  # a record_xml_attribute / record_testsuite_property call, to replay
TORCH_LEAK = "torch_leak"  # torch's CUDA allocator grew during the test ({device, bytes})
DRIVER = "driver"  # a test that leased no GPU loaded CUDA's driver or NVML (their file names)
EXIT = "exit"  # pytest.exit() or Ctrl-C in the test: the session ends ({interrupt, ...})
ERROR = "error"  # why the process could not run its test (text)
RESULT = "result"  # run_isolated: the function's value
EXCEPTION = "exception"  # run_isolated: the exception it raised (``describe_exception``)
PAYLOAD = "payload"  # other plugins' data from the test's process (pytest_gpuiso_child_payload)
DONE = "done"  # the last frame: the job finished (its exit status)
KINDS = frozenset(
    {
        READY,
        PHASE,
        BEGIN,
        END,
        AHEAD,
        STALE,
        REPORT,
        WARNING,
        JUNIT,
        TORCH_LEAK,
        DRIVER,
        EXIT,
        ERROR,
        RESULT,
        EXCEPTION,
        PAYLOAD,
        DONE,
    }
)

SPILL_BYTES = 1 << 20  # 1 MiB
_SPILL = "__spill__"  # a frame in a file: the payload is its path


class FrameError(ValueError):
    """A frame that is not one of ``KINDS``."""


def portable(value: Any, where: str, problems: list[str]) -> Any:
    """``value`` as it can come back to pytest's process: itself when it pickles and
    unpickles here, else its dicts, lists and tuples rebuilt of portable parts, and any
    other part that cannot come back replaced by its ``repr`` (noted in ``problems``).

    An object that pickles but cannot be rebuilt (an exception whose ``__init__`` takes
    other arguments than it passes to ``Exception``) would otherwise fail pytest's read
    of the frame, and with it the test's result."""
    try:
        pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        return value
    except Exception as exc:  # noqa: BLE001 - whatever a test or plugin put there
        error = exc
    if isinstance(value, dict):
        return {k: portable(v, f"{where}[{k!r}]", problems) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        parts = [portable(v, f"{where}[{n}]", problems) for n, v in enumerate(value)]
        return parts if isinstance(value, list) else tuple(parts)
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__
        text = f"<{type(value).__name__} object>"
    problems.append(f"{where} cannot be sent to pytest's process ({error!r}): its repr is")
    return text


def send_frame(conn: Connection, kind: str, payload: Any, spill_dir: str) -> None:
    """Send one frame; spill it to a private file when it is large."""
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind!r}")
    data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > SPILL_BYTES:
        fd, path = tempfile.mkstemp(prefix="spill-", suffix=".pickle", dir=spill_dir)  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        data = pickle.dumps((_SPILL, path), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def recv_frame(conn: Connection) -> tuple[str, Any]:
    """Receive one frame, reading (and deleting) its spill file if it has one.

    Raises ``EOFError`` when the child has closed its end, ``FrameError`` for a
    frame of an unknown kind.
    """
    kind, payload = pickle.loads(conn.recv_bytes())
    if kind == _SPILL:
        path = payload
        try:
            with open(path, "rb") as f:
                kind, payload = pickle.loads(f.read())
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind!r}")
    return kind, payload


EXITED = "exited"  # pump: the sender exited (all it sent is read)
EXPIRED = "expired"  # pump: the deadline passed


def pump(
    reader: Connection,
    sentinel: Any,
    received: list,
    deadline: float | None,
    until: str | None = None,
) -> str:
    """Collect frames into ``received`` until the sender exits (``EXITED``), the
    ``deadline`` (``time.monotonic()``) passes (``EXPIRED``) or a frame of kind
    ``until`` arrives (that kind; the frames after it stay in the pipe).

    ``sentinel`` becomes readable when the sending process has exited; the frames
    it sent before are all read then. A garbled frame or one of an unknown kind
    ends the reading, with an ``ERROR`` frame that says so.
    """
    waitables = [reader, sentinel]
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return EXPIRED
        ready = wait(waitables, remaining)
        if reader in ready:
            if not _read_frame(reader, received):
                waitables.remove(reader)
            elif until is not None and received[-1][0] == until:
                return until
        if sentinel in ready:
            while reader in waitables and reader.poll(0) and _read_frame(reader, received):
                pass
            return EXITED


def _read_frame(reader: Connection, received: list) -> bool:
    """Read one frame; False once the pipe is closed or unreadable."""
    try:
        received.append(recv_frame(reader))
    except (EOFError, OSError):
        return False
    except Exception as exc:  # a garbled frame, an unknown kind: keep the evidence, stop
        received.append((ERROR, f"unreadable message from the test process: {exc!r}"))
        return False
    return True


def encode_warning(message: warnings.WarningMessage, nodeid: str) -> dict[str, Any]:
    """A warning of the test as plain data (its category by name)."""
    category = message.category
    return {
        "message": str(message.message),
        "category_module": category.__module__,
        "category_name": category.__qualname__,
        "filename": message.filename,
        "lineno": message.lineno,
        "nodeid": nodeid,
    }


def decode_warning(data: dict[str, Any]) -> tuple[Warning, type[Warning]]:
    """The warning and its category again; ``UserWarning`` for a category that cannot be
    imported here or will not take the message."""
    category: Any
    try:
        category = import_module(data["category_module"])
        for part in data["category_name"].split("."):
            category = getattr(category, part)
        if not (isinstance(category, type) and issubclass(category, Warning)):
            raise TypeError
    except Exception:
        category = UserWarning
    try:
        message: Warning = category(data["message"])
    except Exception:
        message = UserWarning(data["message"])
    return message, category
