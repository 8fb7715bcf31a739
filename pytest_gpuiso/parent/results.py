"""Turn one isolated run's ``Outcome`` into pytest reports.

The child's own reports are used as they are. When the child did not deliver a
complete set (timeout, crash, early exit), the missing phase becomes a failure
whose text says what happened, with the stack at the timeout and the tail of the
child's output, and the protocol is closed with a teardown report so terminal,
junitxml and xdist see a normal test.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from .._compat import TerminalRepr, evaluate_xfail_marks
from ..gpu.xids import faults_text
from ..leaks import Verdict, advice
from ..settings import IsolationSpec
from ..termtext import inert
from ..wire import frames
from .outcome import Outcome

LEAK_SECTION = "gpu-isolate leaks"
LEAK_PROPERTY = "gpu_isolate_leak"  # junit <property> name of each leak
XID_SECTION = "gpu-isolate Xids"  # a failed test's application Xids


def item_reports(
    item: pytest.Item, spec: IsolationSpec, outcome: Outcome, verdict: Verdict | None = None
) -> list[pytest.TestReport]:
    """The child's reports, completed where it did not deliver them all, with its leaks."""
    config = item.config
    reports: list[pytest.TestReport] = []
    unreadable: list[str] = []  # reports pytest could not rebuild: the test's error
    for data in outcome.sent.reports:
        problem = report_problem(data, item.nodeid)
        try:
            if problem is not None:
                raise ValueError(problem)
            text_repr = data.pop(frames.TEXT_REPR, False)
            rep = config.hook.pytest_report_from_serializable(config=config, data=data)
            if isinstance(rep, pytest.TestReport):
                if text_repr is True and isinstance(rep.longrepr, str):
                    rep.longrepr = TextRepr(rep.longrepr)
                rep.longreprtext  # noqa: B018 - rendered now, not in pytest's own reporting
        except Exception as exc:  # noqa: BLE001 - whatever the test's process sent
            why = problem or repr(exc)
            unreadable.append(f"{frames.UNREADABLE}a report pytest cannot take ({why})"[:500])
            continue
        if isinstance(rep, pytest.TestReport):
            reports.append(rep)
    stopped = bool(outcome.sent.exits)  # pytest.exit(): reported as in-process, no more
    complete = outcome.finished and any(r.when == "teardown" for r in reports)
    if (not complete or unreadable) and not stopped:
        # The time the child's reports do not account for (up to the kill, or the crash)
        # goes to the failure, so that junit and --durations show what it took.
        ran = outcome.end.duration - (outcome.end.began or 0.0)
        unreported = max(0.0, ran - sum(r.duration for r in reports))

        def problem(phase: str) -> str:
            return describe_problem(outcome, spec, phase, unreadable)

        _close_with_failure(item, reports, problem, unreported)
    if reports and verdict is not None and verdict.records:
        _attach_leaks(item, reports, verdict)
    return reports


class TextRepr(TerminalRepr):
    """A report's text with no crash line (``frames.TEXT_REPR``): shown whole in the
    failure's section, and, as in-process, not quoted after its short summary line."""

    def __init__(self, text: str) -> None:
        self.text = text

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line)


_PHASES = ("setup", "call", "teardown")
_OUTCOMES = ("passed", "failed", "skipped")


def report_problem(data: dict[str, Any], nodeid: str) -> str | None:
    """What is wrong with a REPORT frame's data for the test ``nodeid``, None when it is
    a test report of that test that pytest's reporting (terminal, junitxml, --durations,
    xdist) can take: it is checked before pytest rebuilds it, since what breaks later
    breaks outside the test, as INTERNALERROR. A report of another test is a forgery."""
    if data.get("_report_type") == "SubTestReport":  # pytest 9's subtests: a TestReport more
        context = data.get("_subtest.context")
        if not (
            isinstance(context, dict)
            and (context.get("msg") is None or isinstance(context.get("msg"), str))
            and isinstance(context.get("kwargs"), dict)
            and all(isinstance(v, str) for v in context["kwargs"].values())
        ):
            return f"its subtest context is {frames.sketch(context, 60)}"
    elif data.get("$report_type") != "TestReport":
        return f"$report_type {frames.sketch(data.get('$report_type'), 60)}, not TestReport"
    if data.get("nodeid") != nodeid:
        return f"nodeid {frames.sketch(data.get('nodeid'), 60)}, not this test's"
    checks = {
        "when": data.get("when") in _PHASES,
        "outcome": data.get("outcome") in _OUTCOMES,
        "location": _is_location(data.get("location")),
        "keywords": isinstance(data.get("keywords"), dict)
        and all(isinstance(k, str) for k in data["keywords"]),
        "sections": _pairs(data.get("sections"), str),
        "user_properties": _pairs(data.get("user_properties"), object),
        "longrepr": _is_longrepr(data.get("longrepr")),
    }
    for field in ("duration", "start", "stop"):
        value = data.get(field, 0.0)
        checks[field] = type(value) in (int, float) and math.isfinite(value)
    for field, fine in checks.items():
        if not fine:
            return f"its {field} is {frames.sketch(data.get(field), 60)}"
    return None


def _is_location(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 3
        and isinstance(value[0], str)
        and (value[1] is None or type(value[1]) is int)
        and isinstance(value[2], str)
    )


def _pairs(value: Any, second: type) -> bool:
    """A list of (str, ``second``) pairs."""
    return isinstance(value, list) and all(
        isinstance(p, (list, tuple))
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], second)
        for p in value
    )


def _is_longrepr(value: Any) -> bool:
    """None, text, a skip's (path, line, reason), or a failure's serialized repr (its
    rendering is tried once it is rebuilt)."""
    if value is None or isinstance(value, str):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) == 3 and isinstance(value[0], str) and isinstance(value[2], str)
    return isinstance(value, dict) and {"reprcrash", "reprtraceback"} <= value.keys()


def _attach_leaks(item: pytest.Item, reports: list[pytest.TestReport], verdict: Verdict) -> None:
    """Show a test's leaks in its teardown report; ``fail`` leaks make teardown an error.

    The section is printed with the test's other sections (-rP, failures); each
    leak also becomes a junit ``<property>`` through the report's user properties.
    """
    last = reports[-1]
    lines = [
        f"{r['kind']}: {inert(r['detail'])}"
        + (" (allowed)" if r.get("allowed") else " (known)" if r.get("level") == "known" else "")
        for r in verdict.records
    ]
    said = verdict.failing and not last.failed  # the failure says the failing leaks in full
    if said:
        problem = (
            f"gpu-isolate: the test left {len(verdict.failing)} leak"
            f"{'s' if len(verdict.failing) != 1 else ''} behind "
            f"(--gpu-isolate-leaks {verdict.policy_text}):\n"
            + "\n".join(f"  {leak.kind}: {inert(leak.detail)}" for leak in verdict.failing)
            + "\nWhat to do:\n"
            + advice([leak.kind for leak in verdict.failing])
        )
        reports[-1] = last = _failed_instead(item, last, problem)
    # What the failure above says in full is not said again in the section.
    shown = [
        line
        for line, r in zip(lines, verdict.records, strict=True)
        if not (said and r.get("level") == "fail" and not r.get("allowed"))
    ]
    if shown:
        last.sections.append((LEAK_SECTION, "\n".join(shown)))
    last.user_properties = [
        *last.user_properties,
        *((LEAK_PROPERTY, line) for line in lines),
    ]


def attach_xids(item: pytest.Item, reports: list[pytest.TestReport], xids: list[dict]) -> None:
    """The application Xids its GPUs raised during the test (``gpu.health``: the entries
    with ``fails_test``): NVIDIA's catalog puts them on the application, so a passed
    call fails naming them; a failure already there stays, with them in a section."""
    text = faults_text(xids)
    if text is None or not reports:
        return
    at = next((i for i, r in enumerate(reports) if r.when == "call"), len(reports) - 1)
    if reports[at].when == "call" and reports[at].passed:
        reports[at] = _failed_instead(item, reports[at], f"gpu-isolate: {text}")
    else:
        reports[at].sections.append((XID_SECTION, text))


def _failed_instead(item: pytest.Item, rep: pytest.TestReport, problem: str) -> pytest.TestReport:
    """A failed report of ``rep``'s phase saying ``problem``, with its sections, user
    properties and duration."""
    failed = synthetic_report(item, rep.when, problem)
    failed.sections = list(rep.sections)
    failed.user_properties = list(rep.user_properties)
    failed.duration = rep.duration
    return failed


def setup_error_reports(item: pytest.Item, message: str) -> list[pytest.TestReport]:
    """An error in setup, before anything ran (a bad marker argument, a lease timeout)."""
    reports: list[pytest.TestReport] = []
    _close_with_failure(item, reports, lambda phase: f"gpu-isolate: {message}")
    return reports


def skip_reports(item: pytest.Item, reason: str) -> list[pytest.TestReport]:
    """Skipped in setup (e.g. it needs more GPUs than exist); nothing was run."""
    path, lineno, _ = item.location
    setup = synthetic_report(item, "setup", None)
    setup.outcome = "skipped"
    setup.longrepr = (str(item.path), (lineno or 0) + 1, f"Skipped: {reason}")
    return [setup, synthetic_report(item, "teardown", None)]


def _close_with_failure(item: pytest.Item, reports: list, problem, duration: float = 0.0) -> None:
    """Fail the first phase that has no report and end with a teardown report.

    ``duration``: the seconds the failure took that no report of the child counts.
    """
    if reports and reports[-1].when == "teardown":
        last = reports.pop()
        failed = synthetic_report(item, "teardown", problem("teardown"))
        failed.sections = list(last.sections)
        failed.duration = last.duration + duration
        reports.append(failed)
        return
    if not reports:
        phase = "setup"
    elif reports[-1].when == "setup" and reports[-1].passed:
        phase = "call"
    else:
        phase = "teardown"
    failed = synthetic_report(item, phase, problem(phase))
    failed.duration = duration
    reports.append(failed)
    if phase != "teardown":
        reports.append(synthetic_report(item, "teardown", None))


def synthetic_report(item: pytest.Item, when: str, problem: str | None) -> pytest.TestReport:
    now = time.time()
    rep = pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={name: 1 for name in item.keywords},
        outcome="passed" if problem is None else "failed",
        longrepr=problem,
        when=when,
        start=now,
        stop=now,
        user_properties=list(item.user_properties),
    )
    if problem is not None and when == "call":
        apply_xfail(item, rep)
    return rep


def apply_xfail(
    item: pytest.Item, rep: pytest.TestReport, exc: BaseException | None = None
) -> None:
    """Make a failed report of an xfail test an expected failure, as pytest's skipping
    plugin does in-process (which needs state only a run's setup gives it): a crash or
    timeout when ``raises`` is not given, an exception ``exc`` that matches it."""
    if item.config.option.runxfail or not rep.failed or hasattr(rep, "wasxfail"):
        return
    try:
        xfailed = evaluate_xfail_marks(item)
    except Exception:
        return
    if xfailed is None:
        return
    if xfailed.raises is None or (exc is not None and isinstance(exc, xfailed.raises)):
        rep.outcome = "skipped"
        rep.wasxfail = xfailed.reason


def describe_problem(
    outcome: Outcome, spec: IsolationSpec, phase: str, unreadable: list[str] | None = None
) -> str:
    """What went wrong in ``phase``, for its failure report (``unreadable``: the reports
    the test's process sent that pytest could not rebuild)."""
    code = outcome.end.exitcode
    errors = [*outcome.sent.errors, *(unreadable or ())]
    if outcome.end.timed_out:
        ended = f"; it was ended by {outcome.end.signal_name}" if outcome.end.signal_name else ""
        escalation = f"(escalation: stack dump, SIGTERM, {spec.grace:g} s grace, SIGKILL)"
        if outcome.end.expired == "startup":
            doing = outcome.launch.phase or (
                "bootstrapping" if outcome.launch.bootstrapped else "starting the interpreter"
            )
            head = (
                f"Start-up timeout: the test process did not finish starting ({doing}) "
                f"within {spec.startup_timeout:g} s{ended} {escalation}; the test did not run "
                "(to allow more: --gpu-isolate-startup-timeout, or startup_timeout= in the "
                "test's gpu_isolated marker)"
            )
        elif outcome.end.expired == "group":  # why: "rank 1 ended and ..." (group._why)
            why = outcome.end.why or "another rank of its group ended"
            allow = "rank_wait= in the marker, or --gpu-isolate-rank-wait"
            head = (
                f"Stopped with its group: {why}, during {phase}{ended} {escalation}; to fix: "
                "its stack below shows where it waited; to allow more: "
                f"{allow if ' ended' in why else 'the bound the other rank ran past'}"
            )
        elif outcome.end.expired == "exit":
            head = f"Exit timeout: the test process did not exit within {spec.startup_timeout:g} s"
            head += f" after its test ended{ended} {escalation}"
        else:
            head = (
                f"Timeout: the isolated test timed out after {spec.timeout:g} s "
                f"(timeout from {spec.timeout_source}) during {phase}{ended} {escalation}; "
                "to fix: its stack below shows where it waited; to allow more: timeout= in "
                "the test's gpu_isolated marker, or --gpu-isolate-timeout"
            )
    elif outcome.end.signal_name:
        head = (
            f"Crashed: the isolated test process crashed with {outcome.end.signal_name} "
            f"(exit code {code}) during {phase}"
        )
    elif any(error.startswith(frames.UNREADABLE) for error in errors):
        head = (
            f"The isolated test process sent pytest a message it cannot take during {phase} "
            f"(exit code {code}); what it sent after it was not read, so its result is unknown"
        )
    elif outcome.sent.errors and not outcome.sent.reports:
        head = f"The isolated test process could not run the test (exit code {code})"
    else:
        head = (
            f"The isolated test process exited with code {code} during {phase} "
            "before reporting a complete result"
        )
    parts = [head, *errors]
    if outcome.end.timed_out:
        if not outcome.launch.bootstrapped:
            missing = "(no stack dump: the process was still starting up)"
        else:
            missing = "(no stack dump: the process did not answer)"
        when = "when its group stopped it" if outcome.end.expired == "group" else "at the timeout"
        parts.append(
            f"Stack of the test process (pid {outcome.end.pid}) {when}:\n"
            + (trim_stack(outcome.end.stack) or missing)
        )
    for n, text in enumerate(outcome.end.captured, 1):
        parts.append(f"Output the test wrote before it ended (captured stream {n}):\n{text}")
    if outcome.end.output_tail:
        parts.append(
            f"Last output of the test process (pid {outcome.end.pid}):\n"
            + trim_stack(outcome.end.output_tail)
        )
    return "\n\n".join(parts)


_INTERNAL = ("/_pytest/", "/pluggy/", "/multiprocessing/", "/pytest_gpuiso/", '"<string>"')


def trim_stack(dump: str) -> str:
    """Keep each thread's frames down to where pytest's own machinery starts.

    faulthandler lists the most recent call first, so the test's frames come
    first and the 30-odd frames of pytest, pluggy and our bootstrap follow.
    """
    out: list[str] = []
    hidden = 0
    in_internals = False
    for line in dump.splitlines():
        is_frame = line.startswith("  File ")
        if not is_frame:
            if hidden:
                out.append(f"  ... {hidden} frames of pytest and pytest-gpuiso internals")
            hidden, in_internals = 0, False
            out.append(line)
            continue
        user_seen = bool(out) and out[-1].startswith("  File ")
        if in_internals or (user_seen and any(marker in line for marker in _INTERNAL)):
            in_internals = True
            hidden += 1
        else:
            out.append(line)
    if hidden:
        out.append(f"  ... {hidden} frames of pytest and pytest-gpuiso internals")
    return "\n".join(out).strip()
