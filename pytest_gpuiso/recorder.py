"""The session's records of isolated tests, and every report made of them at its end.

``Recorder`` is a pytest plugin of every pytest process; in the one that writes the
reports (the xdist controller under xdist: its ``Controller``) it collects each test's
JSON record as its last report arrives, and at the session's end writes the JSON
report, the Markdown summary (and ``$GITHUB_STEP_SUMMARY``), GitLab's Code Quality
report, the terminal summary and GitHub's annotations.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import pytest

from .reports.record import record_of

if TYPE_CHECKING:
    from .parent.session import State
    from .reports.baseline import Summary
    from .reports.controller import Controller
    from .reports.findings import Finding
    from .reports.run_info import Session

# The reports' modules are imported at the session's end, where there is something to
# write: a session that isolates nothing never needs them.


class Recorder:
    """Collects the JSON records of isolated tests and writes the reports.

    Records ride on teardown reports, so under xdist the controller receives
    every worker's records test by test, even from a worker that later crashes.
    """

    def __init__(self, config: pytest.Config, state: State, controller: Controller | None) -> None:
        """``controller``: None in an xdist worker, which writes no report."""
        self.config = config
        self.state = state
        self.controller = controller
        self.summaries: list[str] = []  # where the Markdown summary went
        self.unwritten: list[str] = []  # reports that could not be written, and why
        self.baseline: Summary | None = None  # what became of the leak baseline
        self.found: list[Finding] = []  # its findings, for annotations and GitLab
        self.started = time.time()  # the session's start, for the JSON report
        self.collected: float | None = None  # when collection ended (time.monotonic)
        self.own = 0.0  # every test's own time (setup, call, teardown), isolated or not
        self.running: dict[str, None] = {}  # tests begun and not finished, in their order
        self.unsaved = False  # records came since the report was last written
        self.saved_at = 0.0  # when the partial report may be written again (monotonic)
        # A write held back by that pace is made when it has passed, by a timer: the test
        # that runs now (and may hang until the session is killed) is named all the same.
        self.lock = threading.Lock()  # the partial report's state, between the timer and us
        self.later: threading.Timer | None = None
        self.closed = False  # the final report is written: nothing partial after it

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = time.monotonic()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        with self.lock:
            self.running[nodeid] = None
            self.unsaved = True  # the partial report names the tests running now
        self._save_partial()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.own += report.duration or 0.0
        record = record_of(report)
        if record is not None:
            from .reports import findings

            findings.locate(record, self.config.rootpath)
            if self.controller is not None:
                with self.lock:
                    self.controller.records.append(record)
                    self.unsaved = True

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        with self.lock:
            self.running.pop(nodeid, None)
            self.unsaved = True  # it runs no longer
        self._save_partial()

    def _save_partial(self) -> None:
        """What finished so far, and what runs now, at the report's path: a session that is
        killed (a CI job's timeout, the OOM killer) leaves that much. Rewritten whole (never
        torn), at each test's start and end; a report so large that writing it takes over
        20 ms is written again only once ten times that has passed (its cost stays under a
        tenth of the session's time), then by a timer if no test starts or ends before."""
        out = self.controller
        if out is None or out.report_path is None:
            return
        with self.lock:
            if self.closed or not self.unsaved:
                return
            # Imported before the clock: a first write's imports are no measure of what
            # writing the report costs (they would hold the next write back).
            from .reports import files, run_info

            now = time.monotonic()
            if now < self.saved_at:
                if self.later is None:
                    self.later = threading.Timer(self.saved_at - now, self._save_later)
                    self.later.daemon = True
                    self.later.start()
                return
            records = list(out.records)
            args = list(self.config.invocation_params.args)
            running = list(self.running)
            session = run_info.session_block(
                self.started, time.time(), None, records, args, None, running=running
            )
            try:
                files.write_json(out.report_path, records, None, session)
            except OSError:
                return  # said at the session's end, when the final report cannot be written
            self.unsaved = False
            took = time.monotonic() - now
            self.saved_at = now + (10 * took if took > 0.02 else 1e-9)

    def _save_later(self) -> None:
        with self.lock:
            self.later = None
        self._save_partial()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        state, out = self.state, self.controller
        if out is None:
            return  # the xdist controller writes the reports, from every worker's records
        with self.lock:
            self.closed = True
            if self.later is not None:
                self.later.cancel()
        from .reports import files, findings, report

        if state.baseline is not None:
            self.baseline = state.baseline.summary(out.records)
        self.found = findings.of_records(out.records)
        # Checked at configure; what fails now (a full disk) is one line, not a traceback.
        try:
            if out.report_path is not None:
                files.write_json(out.report_path, out.records, self.baseline, self._run(session))
        except OSError as exc:
            self.unwritten.append(f"--gpu-isolate-report {out.report_path}: {_why(exc)}")
        try:
            if out.summary_path is not None or (out.records and files.step_summary_path()):
                self.summaries = report.write_markdown(
                    out.summary_path, out.records, self.baseline, out.report_path
                )
        except OSError as exc:
            self.unwritten.append(f"--gpu-isolate-summary {out.summary_path}: {_why(exc)}")
        try:
            if out.code_quality_path is not None:
                files.write_text(out.code_quality_path, findings.code_quality(self.found))
        except OSError as exc:
            path = out.code_quality_path
            self.unwritten.append(f"--gpu-isolate-code-quality {path}: {_why(exc)}")
        if self.unwritten and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        state, out = self.state, self.controller
        if out is None:
            return  # an xdist worker's terminal is not shown
        from .reports import findings, report

        config = self.config
        if state.unavailable and (config.get_verbosity() < 0 or config.option.no_header):
            # the header's line, which -q and --no-header do not show: said all the same
            terminalreporter.write_line(f"gpu-isolate: off: {state.unavailable}")
        quiet = self.config.get_verbosity() <= -2  # -qq: only what needs attention
        wanted = out.records or self.baseline
        if wanted and not (quiet and not report.notable(out.records) and not self.fixed):
            failed = any(p.startswith("--gpu-isolate-report") for p in self.unwritten)
            written = None if failed else out.report_path
            clock = None  # one process ran every test: its wall clock against their time
            if self.collected is not None and not config.pluginmanager.has_plugin("dsession"):
                clock = (time.monotonic() - self.collected, self.own)
            report.terminal_summary(terminalreporter, out.records, written, self.baseline, clock)
        if out.records and self.config.option.durations is not None:
            report.startup_durations(terminalreporter, out.records, self.config)
        for problem in self.unwritten:
            terminalreporter.write_line(f"gpu-isolate: ERROR: could not write {problem}", red=True)
        if self.summaries:
            terminalreporter.write_line(
                f"gpu-isolate: Markdown summary written to {', '.join(self.summaries)}"
            )
        if findings.wanted(state.settings.annotations):  # none in an xdist worker
            for line in findings.workflow_commands(self.found):
                terminalreporter.write_line(line)

    def _run(self, session: pytest.Session) -> Session:
        """The JSON report's ``session``: this run, where and how it ended."""
        from .reports import run_info

        args = list(self.config.invocation_params.args)
        gpus = self.state.gpus.nvml.inventory()  # None without NVML
        status = session.exitstatus
        return run_info.session_block(
            self.started, time.time(), status, self.controller.records, args, gpus
        )

    @property
    def fixed(self) -> bool:
        return bool(self.baseline and self.baseline["fixed"])


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
