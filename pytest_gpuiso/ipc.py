"""Framed messages from the isolated child to the parent over a one-way Pipe.

A frame is ``(kind, payload)``, pickled. Frames larger than ``SPILL_BYTES`` are
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
from multiprocessing.connection import Connection
from typing import Any

SPILL_BYTES = 1 << 20  # 1 MiB
_SPILL = "__spill__"


def send_frame(conn: Connection, kind: str, payload: Any, spill_dir: str) -> None:
    """Send one frame; spill it to a private file when it is large."""
    data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > SPILL_BYTES:
        fd, path = tempfile.mkstemp(prefix="spill-", suffix=".pickle", dir=spill_dir)  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        data = pickle.dumps((_SPILL, path), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def recv_frame(conn: Connection) -> tuple[str, Any]:
    """Receive one frame, reading (and deleting) its spill file if it has one.

    Raises ``EOFError`` when the child has closed its end.
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
    return kind, payload
