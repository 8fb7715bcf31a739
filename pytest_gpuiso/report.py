"""Reports of the isolated tests: the JSON file and the terminal summary."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


def write_json(path: Path, records: list[dict[str, Any]]) -> None:
    """Write the report atomically (a reader never sees half a file)."""
    document = {"version": SCHEMA_VERSION, "tests": records}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gpuiso-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def terminal_summary(tr: Any, records: list[dict[str, Any]], path: Path | None) -> None:
    timed_out = [r for r in records if r["exit"]["timed_out"]]
    crashed = [r for r in records if r["exit"]["signal"] and not r["exit"]["timed_out"]]
    escaped = sum(len(r.get("escaped", [])) for r in records)
    tr.write_sep("-", "gpu-isolate")
    parts = [f"{len(records)} isolated", f"{len(timed_out)} timed out", f"{len(crashed)} crashed"]
    if escaped:
        parts.append(f"{escaped} escaped processes killed")
    tr.write_line("gpu-isolate: " + ", ".join(parts))
    for r in timed_out:
        tr.write_line(f"  TIMEOUT {r['nodeid']} (after {r['timeout']:g} s)")
    for r in crashed:
        tr.write_line(f"  CRASHED {r['nodeid']} ({r['exit']['signal']})")
    if path is not None:
        tr.write_line(f"gpu-isolate: JSON report written to {path}")
