"""Unit tests of the leak pieces that need no process: the policy, ``judge``, the GPU memory
probe over recorded NVML samples, and the Markdown summary."""

from __future__ import annotations

import os
import re
import signal
import string
import subprocess
import sys
import time
from typing import Any

import pytest

from pytest_gpuiso.leaks import Leak, RunInfo, judge
from pytest_gpuiso.leaks.gpu_memory import (
    BACKOFF,
    MIB,
    GpuMemoryProbe,
    NvmlUnavailable,
    Sample,
)
from pytest_gpuiso.reports import report
from pytest_gpuiso.values import KINDS, LEVELS, SpecError, parse_allowed, parse_policy

OPTION = "--gpu-isolate-leaks"

# --------------------------------------------------------------------------- parse_policy


@pytest.mark.parametrize("level", LEVELS)
def test_a_bare_level_applies_to_every_kind(level):
    assert parse_policy(level, OPTION) == dict.fromkeys(KINDS, level)


def test_per_kind_levels_leave_the_others_at_warn():
    assert parse_policy("shm=fail", OPTION) == {
        "shm": "fail",
        "process": "warn",
        "gpu_memory": "warn",
    }
    assert parse_policy("gpu_memory=off,process=fail", OPTION) == {
        "shm": "warn",
        "process": "fail",
        "gpu_memory": "off",
    }


@pytest.mark.parametrize(
    "text",
    ["fail,process=warn", "process=warn,fail", "  fail ,\tprocess = warn  ", "process=warn , fail"],
)
def test_a_bare_level_sets_the_kinds_not_named_whatever_the_order(text):
    policy = parse_policy(text, OPTION)
    assert policy == {"shm": "fail", "process": "warn", "gpu_memory": "fail"}
    assert list(policy) == list(KINDS)  # the failure message lists them in this order


@pytest.mark.parametrize(
    ("text", "part", "why"),
    [
        ("shm=loud", "shm=loud", "expected warn|fail|off"),  # unknown level
        ("loud", "loud", "expected warn|fail|off"),  # unknown bare level
        ("FAIL", "FAIL", "expected warn|fail|off"),  # levels are lower case
        ("gpu=fail", "gpu=fail", "kinds shm, process, gpu_memory"),  # unknown kind
        ("=fail", "=fail", "kinds shm, process, gpu_memory"),  # no kind
        ("shm=", "shm=", "expected warn|fail|off"),  # no level
        ("shm=fail=warn", "shm=fail=warn", "expected warn|fail|off"),
        ("warn,", "", "expected warn|fail|off"),  # empty part
        ("", "", "expected warn|fail|off"),
        ("shm=fail,,process=warn", "", "expected warn|fail|off"),
        ("shm=fail,process=warn,shm=warn", "shm=warn", "shm is given twice"),  # duplicate kind
        ("shm=fail, shm = fail", "shm = fail", "shm is given twice"),
        ("warn,process=fail,fail", "fail", "given twice"),  # two defaults: which one?
    ],
)
def test_every_bad_part_is_named_with_the_option(text, part, why):
    with pytest.raises(SpecError) as info:
        parse_policy(text, "ini gpu_isolate_leaks")
    message = str(info.value)
    assert message.startswith(f"invalid value {text!r} for ini gpu_isolate_leaks: ")
    assert f"bad part {part!r}" in message
    assert why in message
    assert "\n" not in message


# --------------------------------------------------------------------------- parse_allowed

MARKER = "gpu_isolated marker argument allow_leaks"


@pytest.mark.parametrize(
    ("value", "kinds"),
    [
        (["shm"], {"shm"}),
        (["shm", "process", "shm"], {"shm", "process"}),
        (("process", "gpu_memory"), {"process", "gpu_memory"}),
        ({"gpu_memory"}, {"gpu_memory"}),
        ("process", {"process"}),
        ("all", set(KINDS)),
        (["all"], set(KINDS)),
        (["shm", "all"], set(KINDS)),
        ([], set()),
        ((), set()),
    ],
)
def test_allowed_kinds(value, kinds):
    allowed = parse_allowed(value, MARKER)
    assert isinstance(allowed, frozenset)
    assert allowed == kinds


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (["gpu"], "unknown kind 'gpu'"),
        ("gpu", "unknown kind 'gpu'"),
        ("shm,process", "unknown kind 'shm,process'"),
        (["shm", "SHM_LEAK"], "unknown kind 'SHM_LEAK'"),
        (["all", "gpu"], "unknown kind 'gpu'"),  # "all" does not hide a typo
        ("", "unknown kind ''"),
        (["shm", 1], "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
        ([None], "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
        ([["shm"]], "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
        (None, "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
        (1, "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
        (True, "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
        (b"shm", "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
        ({"shm": True}, "expected a kind or a list of kinds (shm, process, gpu_memory), or all"),
    ],
)
def test_bad_allowed_values_name_the_value_and_the_marker(value, why):
    with pytest.raises(SpecError) as info:
        parse_allowed(value, MARKER)
    message = str(info.value)
    assert message.startswith(f"invalid value {value!r} for {MARKER}: ")
    assert why in message
    assert "\n" not in message


# --------------------------------------------------------------------------- judge

SHM_LEAK = Leak("shm", "segment /dev/shm/psm_1 (4 KiB) left behind", {"path": "/dev/shm/psm_1"})
PROC = Leak("process", "process 4242 (sleep 100) still running, killed", {"pid": 4242})
GPU = Leak("gpu_memory", "GPU 0: 512 MiB more in use", {"device": "0", "bytes": 512 * MIB})


def test_off_kinds_vanish_and_fail_and_warn_are_split():
    policy = {"shm": "off", "process": "fail", "gpu_memory": "warn"}
    verdict = judge([SHM_LEAK, PROC, GPU, SHM_LEAK], policy, frozenset())
    assert verdict.records == [
        {"kind": "process", "detail": PROC.detail, "pid": 4242, "level": "fail"},
        {
            "kind": "gpu_memory",
            "detail": GPU.detail,
            "device": "0",
            "bytes": 512 * MIB,
            "level": "warn",
        },
    ]
    assert verdict.failing == [PROC]
    assert verdict.warning == [GPU]
    assert verdict.failing + verdict.warning == [PROC, GPU]
    assert verdict.policy_text == "shm=off,process=fail,gpu_memory=warn"


def test_allowed_kinds_are_recorded_but_neither_fail_nor_warn():
    policy = dict.fromkeys(KINDS, "fail")
    verdict = judge([SHM_LEAK, PROC, GPU], policy, frozenset({"shm", "gpu_memory"}))
    assert verdict.records == [
        {"kind": "shm", "detail": SHM_LEAK.detail, "path": "/dev/shm/psm_1", "allowed": True},
        {"kind": "process", "detail": PROC.detail, "pid": 4242, "level": "fail"},
        {
            "kind": "gpu_memory",
            "detail": GPU.detail,
            "device": "0",
            "bytes": 512 * MIB,
            "allowed": True,
        },
    ]
    assert verdict.failing == [PROC]
    assert verdict.warning == []
    # The same under warn: allowed leaks are not warnings either.
    verdict = judge([SHM_LEAK, PROC], dict.fromkeys(KINDS, "warn"), frozenset(KINDS))
    assert (verdict.failing, verdict.warning) == ([], [])
    assert [r["allowed"] for r in verdict.records] == [True, True]


def test_known_kinds_are_recorded_as_known_and_neither_fail_nor_warn():
    """The leak baseline's kinds for the test: reported (level "known"), never failing;
    a kind it does not know is judged as ever, and the marker's allow_leaks wins."""
    policy = dict.fromkeys(KINDS, "fail")
    verdict = judge(
        [SHM_LEAK, PROC, GPU], policy, frozenset({"gpu_memory"}), frozenset({"shm", "gpu_memory"})
    )
    assert [r.get("level") for r in verdict.records] == ["known", "fail", None]
    assert verdict.records[2]["allowed"] is True
    assert (verdict.failing, verdict.warning, verdict.known) == ([PROC], [], [SHM_LEAK])


def test_off_wins_over_allowed_and_the_leak_objects_are_left_alone():
    verdict = judge(
        [SHM_LEAK, PROC], {"shm": "off", "process": "off", "gpu_memory": "fail"}, frozenset({"shm"})
    )
    assert verdict.records == [] and verdict.failing + verdict.warning == []
    assert SHM_LEAK.as_record() == {
        "kind": "shm",
        "detail": SHM_LEAK.detail,
        "path": "/dev/shm/psm_1",
    }


# --------------------------------------------------------------------------- GPU memory probe
#
# Recorded shapes of an H100 (80 GiB) as NVML reports them from inside a container: the
# driver keeps ~535 MiB in use on an idle GPU, and the pids are host pids, which mean
# nothing in our pid namespace.

IDLE = Sample(535 * MIB)
CHILD = 3_123_456  # the test's process, as NVML names it
OTHER = 2_000_001  # someone else's process, there before the test


def used(mib: float, **processes: int) -> Sample:
    return Sample(int(mib * MIB), {int(pid[1:]): b * MIB for pid, b in processes.items()})


class RecordedNvml:
    """Replays recorded samples: ``sample(device)`` returns the next one of that device.

    Running out of samples is an error: each test states exactly how many it expects.
    """

    def __init__(self, script: dict[str, list[Sample]], fail_after: int | None = None):
        self.script = {device: list(samples) for device, samples in script.items()}
        self.taken: dict[str, int] = dict.fromkeys(script, 0)
        self.fail_after = fail_after  # raise NvmlUnavailable from this sample on

    def sample(self, device: str) -> Sample:
        if self.fail_after is not None and sum(self.taken.values()) >= self.fail_after:
            raise NvmlUnavailable(f"GPU {device}: NVML: GPU is lost")
        samples = self.script[device]
        assert self.taken[device] < len(samples), f"probe took more samples of GPU {device}"
        self.taken[device] += 1
        return samples[self.taken[device] - 1]


# CHILD: a leftover of the test the sweep found (gone now): a holder that is the test's.
RUN = RunInfo(41872, 1_700_000_000.0, 1_700_000_003.5, 5.0, frozenset({41872, CHILD}))


def probe_check(
    script: dict[str, list[Sample]], *, shared: bool = False, fail_after: int | None = None
) -> tuple[list[Leak], RecordedNvml, list[float]]:
    """Baseline from each device's first sample, then the check over the rest."""
    nvml = RecordedNvml(script, fail_after)
    delays: list[float] = []
    probe = GpuMemoryProbe(nvml, list(script), shared=shared, sleep=delays.append)
    before = probe.snapshot()
    return probe.check(before, RUN), nvml, delays


def test_async_context_teardown_is_waited_for_with_backoff():
    """Right after reaping, the dead child's context is still being torn down."""
    leaks, nvml, delays = probe_check(
        {
            "0": [
                used(535 + 300, p2000001=300),  # baseline: someone else's process is there
                used(2583 + 300, p3123456=2048, p2000001=300),  # context not torn down yet
                used(1047 + 300, p2000001=300),  # process gone, memory going
                used(535 + 300, p2000001=300),  # back to the baseline
            ]
        }
    )
    assert leaks == []
    assert nvml.taken == {"0": 4}  # no sample after the GPU was back to its baseline
    assert delays == list(BACKOFF[1:3])


def test_a_clean_gpu_is_sampled_once_without_sleeping():
    leaks, nvml, delays = probe_check({"0": [IDLE, IDLE]})
    assert (leaks, nvml.taken, delays) == ([], {"0": 2}, [])


def test_growth_within_the_tolerance_is_no_leak():
    # 40 MiB (a cuBLAS workspace kept by the driver, say) is under the 64 MiB default.
    leaks, nvml, delays = probe_check({"0": [IDLE, used(535 + 40)]})
    assert (leaks, nvml.taken, delays) == ([], {"0": 2}, [])


def test_growth_that_persists_is_one_leak_after_the_whole_backoff():
    leaks, nvml, delays = probe_check({"0": [IDLE] + [used(535 + 512)] * len(BACKOFF)})
    assert nvml.taken == {"0": 1 + len(BACKOFF)}
    assert delays == list(BACKOFF[1:])
    [leak] = leaks
    assert leak.kind == "gpu_memory"
    assert leak.fields == {"device": "0", "bytes": 512 * MIB}
    assert leak.detail == "GPU 0: 512 MiB more in use than before the test (tolerance 64 MiB)"


def test_growth_that_shrinks_into_the_tolerance_late_is_no_leak():
    script = [IDLE] + [used(535 + 512)] * 5 + [used(535 + 10)]
    leaks, nvml, delays = probe_check({"0": script})
    assert leaks == []
    assert nvml.taken == {"0": 7}
    assert delays == list(BACKOFF[1:6])


def test_an_escaped_gpu_holder_is_reported_with_its_nvml_pid_and_its_memory():
    holding = used(535 + 1024 + 4, p3123456=1024)  # its memory, plus a little driver slack
    leaks, nvml, delays = probe_check({"0": [IDLE] + [holding] * len(BACKOFF)})
    assert nvml.taken == {"0": 1 + len(BACKOFF)}
    assert delays == list(BACKOFF[1:])
    # The holder carries its own memory; the 4 MiB of slack left is within the tolerance.
    [holder] = leaks
    assert holder.kind == "gpu_memory"
    assert holder.fields == {"device": "0", "pid": CHILD, "bytes": 1024 * MIB, "holder": True}
    assert holder.detail == (
        f"GPU 0: process {CHILD} (NVML pid, 1024 MiB) appeared on the GPU during the test "
        "and still holds it after the test's processes were reaped"
    )


def test_memory_beyond_what_an_escaped_holder_uses_is_reported_too():
    holding = used(535 + 1024 + 300, p3123456=1024)  # 300 MiB nobody accounts for
    leaks, _, _ = probe_check({"0": [IDLE] + [holding] * len(BACKOFF)})
    holder, growth = leaks
    assert holder.fields["holder"] is True
    assert growth.fields == {"device": "0", "bytes": 300 * MIB}
    assert growth.detail == "GPU 0: 300 MiB more in use than before the test (tolerance 64 MiB)"


def test_a_holder_within_the_tolerance_is_still_a_holder():
    holding = used(535 + 20, p3123456=20)
    leaks, _, _ = probe_check({"0": [IDLE] + [holding] * len(BACKOFF)})
    [leak] = leaks
    assert leak.fields == {"device": "0", "pid": CHILD, "bytes": 20 * MIB, "holder": True}


def test_a_holder_of_unknown_size_is_reported_without_one():
    # Some (v)GPUs report no per-process memory: NVML gives None, the reader 0.
    holding = Sample(535 * MIB, {CHILD: 0})
    leaks, _, _ = probe_check({"0": [IDLE] + [holding] * len(BACKOFF)})
    [leak] = leaks
    assert leak.fields == {"device": "0", "pid": CHILD, "bytes": 0, "holder": True}
    assert f"process {CHILD} (NVML pid) appeared" in leak.detail


def test_a_holder_that_goes_away_during_the_backoff_is_no_leak():
    holding = used(535 + 1024, p3123456=1024)
    leaks, nvml, delays = probe_check({"0": [IDLE, holding, holding, holding, IDLE]})
    assert leaks == []
    assert nvml.taken == {"0": 5}
    assert delays == list(BACKOFF[1:4])


def test_shared_gpus_are_said_so_in_every_record():
    holding = used(535 + 1024 + 300, p3123456=1024)
    leaks, _, _ = probe_check({"0": [IDLE] + [holding] * len(BACKOFF)}, shared=True)
    assert len(leaks) == 2
    for leak in leaks:
        assert leak.fields["shared"] is True
        assert "shared with other tests" in leak.detail


def test_no_nvml_at_the_baseline_means_no_check():
    nvml = RecordedNvml({"0": []}, fail_after=0)
    delays: list[float] = []
    probe = GpuMemoryProbe(nvml, ["0"], sleep=delays.append)
    before = probe.snapshot()
    assert before is None
    assert probe.check(before, RUN) == []
    assert delays == []


def test_nvml_lost_during_the_check_gives_no_leaks_and_no_exception():
    leaky = used(535 + 512)
    leaks, nvml, delays = probe_check({"0": [IDLE] + [leaky] * len(BACKOFF)}, fail_after=3)
    assert leaks == []
    assert nvml.taken == {"0": 3}  # the baseline and two attempts, then the GPU was lost
    assert delays == list(BACKOFF[1:3])


def test_only_the_leaking_gpu_of_two_is_reported():
    leaks, nvml, delays = probe_check(
        {
            "0": [IDLE] * (1 + len(BACKOFF)),
            "GPU-5e2f3c1a-8b7d-4f6e-9a0b-1c2d3e4f5a6b": [IDLE] + [used(535 + 2048)] * len(BACKOFF),
        }
    )
    [leak] = leaks
    assert leak.fields == {
        "device": "GPU-5e2f3c1a-8b7d-4f6e-9a0b-1c2d3e4f5a6b",
        "bytes": 2048 * MIB,
    }
    assert leak.detail.startswith("GPU GPU-5e2f3c1a-8b7d-4f6e-9a0b-1c2d3e4f5a6b: 2048 MiB more")
    assert nvml.taken == dict.fromkeys(["0", "GPU-5e2f3c1a-8b7d-4f6e-9a0b-1c2d3e4f5a6b"], 8)
    assert delays == list(BACKOFF[1:])


def test_the_custom_tolerance_applies():
    nvml = RecordedNvml({"0": [IDLE] + [used(535 + 100)] * len(BACKOFF)})
    probe = GpuMemoryProbe(nvml, ["0"], tolerance_mib=128, sleep=[].append)
    assert probe.check(probe.snapshot(), RUN) == []
    nvml = RecordedNvml({"0": [IDLE] + [used(535 + 100)] * len(BACKOFF)})
    probe = GpuMemoryProbe(nvml, ["0"], tolerance_mib=16, sleep=[].append)
    [leak] = probe.check(probe.snapshot(), RUN)
    assert leak.fields["bytes"] == 100 * MIB and "tolerance 16 MiB" in leak.detail


# --------------------------------------------------------------------------- Markdown
#
# ``read_row`` reads a table row the way GitHub's Markdown (cmark-gfm) does: cells split
# on pipes that are not backslash-escaped, then ``\|`` unescaped in each cell, then the
# cell's inline text (a code span, or text with backslash escapes) turned back into the
# characters a reader sees.

PUNCT = set(string.punctuation)
MARKUP = set("\\`*_[]<>~&")  # "|" is plain text once the table has split the row


def _split_row(line: str) -> list[str]:
    assert line.startswith("|") and line.endswith("|"), line
    cells, cell, i = [], "", 1
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line) and line[i + 1] in PUNCT:
            cell += line[i : i + 2]
            i += 2
        elif line[i] == "|":
            cells.append(cell.replace("\\|", "|").strip())
            cell, i = "", i + 1
        else:
            cell += line[i]
            i += 1
    assert cell == "", f"row does not end with a cell boundary: {line!r}"
    return cells


def _text(cell: str) -> str:
    """Inline text with escapes; any markup character left unescaped fails the test."""
    out, i = "", 0
    while i < len(cell):
        if cell[i] == "\\" and i + 1 < len(cell) and cell[i + 1] in PUNCT:
            out += cell[i + 1]
            i += 2
        else:
            intraword = (
                cell[i] == "_" and cell[i - 1 : i].isalnum() and cell[i + 1 : i + 2].isalnum()
            )
            assert intraword or cell[i] not in MARKUP, f"unescaped {cell[i]!r} in {cell!r}"
            out += cell[i]
            i += 1
    return out


def _code(cell: str) -> str:
    if cell.startswith("<code>"):
        assert cell.endswith("</code>")
        return _text(cell[len("<code>") : -len("</code>")])
    fence = re.match("`+", cell).group()
    assert cell.endswith(fence) and len(cell) > 2 * len(fence), cell
    body = cell[len(fence) : -len(fence)]
    runs = re.findall("`+", body)
    assert fence not in runs, f"the fence {fence!r} appears inside {cell!r}"
    if body.startswith(" ") and body.endswith(" ") and body.strip():
        body = body[1:-1]
    return body


def read_row(line: str) -> list[str]:
    """(code span, text, text) cells of a leak or timeout row, as rendered."""
    code, *texts = _split_row(line)
    return [_code(code), *(_text(t) for t in texts)]


def record(nodeid: str, outcome: str = "passed", *leaks: dict[str, Any], **exit_: Any) -> dict:
    return {
        "nodeid": nodeid,
        "outcome": outcome,
        "duration": 1.25,
        "pid": 41872,
        "timeout": exit_.pop("timeout", 30.0),
        "exit": {"code": exit_.get("code", 0), "signal": None, "timed_out": False, **exit_},
        "escaped": [],
        "leaks": list(leaks),
    }


def leak(kind: str, detail: str, **fields: Any) -> dict:
    return {"kind": kind, "detail": detail, **fields}


def table(text: str, heading: str) -> list[str]:
    """The rows of the table under ``### heading`` (after its delimiter row)."""
    lines = text.splitlines()
    start = lines.index(f"### {heading}") + 4
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


ODD_NODEIDS = [
    "tests/test_a.py::test_pipe[a|b]",
    "tests/test_a.py::test_tick[`x`]",
    "tests/test_a.py::test_ticks[a``b]",
    "tests/test_a.py::test_escaped[\\n\\x00\\\\]",  # pytest's escaped ids have backslashes
    "tests/test_a.py::test_both[\\|]",  # a backslash right before a pipe
    "tests/test_a.py::test_markup[*a*_b_<i>&amp;~~c~~[x](y)]",
    "`starts and ends with a backtick`",
    " spaces around ",
]
ODD_DETAILS = [
    "segment /dev/shm/a|b (4 KiB)",
    "process 4242 (`python -c 'while 1: pass'`) still running",
    "first line\nsecond line\r\nthird\rfourth",
    "path C:\\temp\\|x\\\\ and \\` and \\*",
    "*bold* _it_ <script>alert(1)</script> &lt; [link](http://x) ~~gone~~",
]


@pytest.mark.parametrize("nodeid", ODD_NODEIDS)
@pytest.mark.parametrize("detail", ODD_DETAILS)
def test_leak_rows_render_the_nodeid_and_detail_literally(nodeid, detail):
    text = report.markdown([record(nodeid, "passed", leak("shm", detail))])
    [row] = table(text, "Leaks")
    one_line = re.sub(r"\r\n|\r|\n", " ", detail)
    assert read_row(row) == [nodeid, "shm", one_line]
    assert "\r" not in text


@pytest.mark.parametrize("nodeid", ODD_NODEIDS)
def test_timeout_rows_render_the_nodeid_literally(nodeid):
    text = report.markdown(
        [record(nodeid, "failed", timed_out=True, signal="SIGKILL", timeout=3.0)]
    )
    [row] = table(text, report.FAILED_TITLE)
    assert read_row(row) == [nodeid, "failed", "timed out after 3 s, ended by SIGKILL"]


def test_plain_nodeids_and_details_stay_readable():
    nodeid = "tests/test_model.py::test_step[fp16]"
    text = report.markdown(
        [record(nodeid, "passed", leak("shm", "segment /dev/shm/psm-1 (4 KiB)"))]
    )
    assert table(text, "Leaks") == [f"| `{nodeid}` | shm | segment /dev/shm/psm-1 (4 KiB) |"]


def test_totals_leaks_and_timeouts_add_up():
    records = [
        record("t.py::test_clean"),
        record(
            "t.py::test_two_segments",
            "passed",
            leak("shm", "segment /dev/shm/a (4 KiB)"),
            leak("shm", "segment /dev/shm/b (4 KiB)"),
            leak("process", "process 7 (sleep) killed", allowed=True),
        ),
        record("t.py::test_gpu", "failed", leak("gpu_memory", "GPU 0: 512 MiB more in use")),
        record(
            "t.py::test_hangs", "failed", timed_out=True, signal="SIGKILL", code=-9, timeout=3.0
        ),
        record("t.py::test_hangs_term", "failed", timed_out=True, code=0, timeout=2.5),
        record("t.py::test_segfault", "failed", signal="SIGSEGV", code=-11),
        record("t.py::test_xfail_crash", "xfailed", signal="SIGABRT", code=-6),
    ]
    text = report.markdown(records)
    lines = text.splitlines()
    assert lines[:2] == ["## pytest-gpuiso", ""]
    assert "**7 isolated tests** (4 failed, 2 passed, 1 xfailed)" in lines
    header = lines.index("| leaks | shm | process | gpu_memory | timeouts | crashes |")
    assert lines[header + 1] == "|---|---|---|---|---|---|"
    assert lines[header + 2] == "| 3 in 2 tests | 2 | 0 | 1 | 2 | 2 |"
    assert "Not counted: 1 leak allowed by `allow_leaks` markers." in lines
    assert [read_row(row) for row in table(text, "Leaks")] == [
        ["t.py::test_two_segments", "shm", "segment /dev/shm/a (4 KiB)"],
        ["t.py::test_two_segments", "shm", "segment /dev/shm/b (4 KiB)"],
        ["t.py::test_gpu", "gpu_memory", "GPU 0: 512 MiB more in use"],
    ]
    assert [read_row(row) for row in table(text, report.FAILED_TITLE)] == [
        ["t.py::test_gpu", "failed", "failed"],  # every failed test, not only timeouts
        ["t.py::test_hangs", "failed", "timed out after 3 s, ended by SIGKILL"],
        ["t.py::test_hangs_term", "failed", "timed out after 2.5 s"],
        ["t.py::test_segfault", "failed", "crashed with SIGSEGV"],
        ["t.py::test_xfail_crash", "xfailed", "crashed with SIGABRT"],
    ]
    assert "No leaks, timeouts or crashes." not in text
    assert text.endswith("|\n")


def test_allowed_leaks_alone_are_not_leaks():
    allowed = leak("shm", "segment /dev/shm/a (4 KiB)", allowed=True)
    text = report.markdown([record("t.py::test_a", "passed", allowed, allowed), record("t.py::b")])
    lines = text.splitlines()
    assert "| 0 in 0 tests | 0 | 0 | 0 | 0 | 0 |" in lines
    assert "### Leaks" not in lines
    assert "Not counted: 2 leaks allowed by `allow_leaks` markers." in lines
    assert lines[-1] == "No leaks, timeouts or crashes."
    assert report.leak_counts([record("t.py::test_a", "passed", allowed)]) == {}


def test_a_clean_session_says_so():
    text = report.markdown([record("t.py::test_a"), record("t.py::test_b", "skipped")])
    assert text == (
        "## pytest-gpuiso\n\n"
        "**2 isolated tests** (1 passed, 1 skipped)\n\n"
        "| leaks | shm | process | gpu_memory | timeouts | crashes |\n"
        "|---|---|---|---|---|---|\n"
        "| 0 in 0 tests | 0 | 0 | 0 | 0 | 0 |\n\n"
        "No leaks, timeouts or crashes.\n"
    )
    assert "(none)" in report.markdown([])


def test_tables_are_cut_at_markdown_rows(monkeypatch):
    monkeypatch.setattr(report, "MARKDOWN_ROWS", 3)
    records = [record(f"t.py::test_{n}", "passed", leak("shm", f"segment {n}")) for n in range(5)]
    records += [record(f"t.py::test_crash_{n}", "failed", signal="SIGSEGV") for n in range(4)]
    text = report.markdown(records)
    lines = text.splitlines()
    assert "| 5 in 5 tests | 5 | 0 | 0 | 0 | 4 |" in lines  # the totals count everything
    assert [read_row(row)[2] for row in table(text, "Leaks")] == [
        "segment 0",
        "segment 1",
        "segment 2",
    ]
    assert "2 more leaks are in the JSON report." in lines
    assert [read_row(row)[0] for row in table(text, report.FAILED_TITLE)] == [
        "t.py::test_crash_0",
        "t.py::test_crash_1",
        "t.py::test_crash_2",
    ]
    assert "1 more failed test is in the JSON report." in lines


def test_the_default_cut_is_markdown_rows():
    records = [
        record(f"t.py::test_{n}", "passed", leak("shm", "x"))
        for n in range(report.MARKDOWN_ROWS + 1)
    ]
    text = report.markdown(records)
    assert len(table(text, "Leaks")) == report.MARKDOWN_ROWS
    assert "1 more leak is in the JSON report." in text.splitlines()


# ------------------------------------------------------------------ GPU memory: the peak


class LiveNvml:
    """Answers every sample with what ``state`` says now (the test moves it on)."""

    def __init__(self) -> None:
        self.state: dict[str, Sample] = {"0": used(500), "1": used(500)}
        self.calls = 0

    def sample(self, device: str) -> Sample:
        self.calls += 1
        return self.state[device]


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


def test_the_peak_is_the_most_the_tests_processes_held_on_one_gpu():
    """The test's process and its child (psutil's tree of a real process) use 3 and 2 GiB
    on GPU 0 at one moment, 4 GiB on GPU 1 at another; another process's 7 GiB on GPU 0 is
    not the test's. Peak: 5 GiB. Sampling stops at check()."""
    nvml = LiveNvml()
    tree = subprocess.Popen([sys.executable, "-c", CHILD_AND_GRANDCHILD], stdout=subprocess.PIPE)
    grandchild = int(tree.stdout.readline())
    try:
        probe = GpuMemoryProbe(nvml, ["0", "1"], sleep=[].append)
        before = probe.snapshot()
        probe.during(tree.pid, every=0.01)
        other = {f"p{os.getpid()}": 7 * 1024}
        nvml.state["0"] = used(12000, **{f"p{tree.pid}": 3 * 1024, f"p{grandchild}": 2048}, **other)
        _wait_for(lambda: probe.peak == 5 * GIB, "the 5 GiB peak")
        nvml.state["0"] = used(500, **other)
        nvml.state["1"] = used(4600, **{f"p{grandchild}": 4 * 1024})
        _wait_for(lambda: nvml.calls > 20, "more samples")
        nvml.state = {"0": used(500), "1": used(500)}
        assert probe.check(before, RUN) == []
        calls = nvml.calls
        time.sleep(0.05)
        assert nvml.calls == calls  # the sampler stopped
        assert probe.peak == 5 * GIB
    finally:
        os.kill(grandchild, signal.SIGKILL)
        tree.kill()
        tree.wait()


def test_without_our_pids_the_growth_stands_in_unless_the_gpu_was_shared():
    """NVML reports pids of another namespace (a container): the device's growth over the
    baseline is the peak on an unshared GPU; on a shared one the peak stays unknown."""
    for shared, expected in ((False, 3 * GIB), (True, None)):
        nvml = LiveNvml()
        probe = GpuMemoryProbe(nvml, ["0"], shared=shared, sleep=[].append)
        before = probe.snapshot()
        probe.during(os.getpid(), every=0.01)
        nvml.state["0"] = used(500 + 3 * 1024, p4000000=3 * 1024)
        noted = nvml.calls  # the samples after these saw the 3 GiB
        _wait_for(lambda nvml=nvml, noted=noted: nvml.calls > noted + 2, "samples")
        nvml.state["0"] = used(500)
        probe.check(before, RUN)
        assert probe.peak == expected


CHILD_AND_GRANDCHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""
GIB = 1 << 30


def test_failed_tests_table_names_every_failed_test_and_why():
    records = [
        record("t.py::test_ok"),
        record("t.py::test_assert", "failed"),
        record("t.py::test_leaky", "error", leak("shm", "segment /dev/shm/a", level="fail")),
        record("t.py::test_warned", "passed", leak("shm", "segment /dev/shm/b", level="warn")),
    ]
    rows = [read_row(row) for row in table(report.markdown(records), report.FAILED_TITLE)]
    assert rows == [
        ["t.py::test_assert", "failed", "failed"],
        ["t.py::test_leaky", "error", "its leaks failed it (shm)"],
    ]
