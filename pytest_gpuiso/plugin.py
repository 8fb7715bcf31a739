"""pytest hooks: options, marker, dispatch of isolated items, reporting glue.

The work itself lives elsewhere: settings in ``spec``, the parent side of a run
in ``supervisor``, the child side in ``child``, reports in ``results`` and
``report``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from . import _compat, frames, report, workdir
from ._linux import set_child_subreaper
from .call import call_isolated
from .child import CHILD_PLUGIN, ItemJob
from .leaks import Probe, Verdict, judge
from .leaks import torch as torch_check
from .leaks.gpu_memory import GpuMemoryProbe, NvmlReader
from .leaks.shm import ShmProbe, preload_env
from .leases import Devices, Lease, Leases, LeaseTimeout, discover
from .outcome import Outcome
from .prewarm import HIDDEN_GPUS, Prewarmer
from .record import attach_record, build_record, record_of
from .results import apply_xfail, item_reports, setup_error_reports, skip_reports
from .settings import (
    DEFAULT_TIMEOUT,
    MARKER,
    IsolationSpec,
    Settings,
    SpecError,
    spec_for_item,
    wants_isolation,
)
from .supervisor import Started, Supervisor

MARKER_DOC = (
    f"{MARKER}(timeout=None, grace=None, gpus=None, allow_leaks=()): run this test in a fresh "
    "process with a clean CUDA context (pytest-gpuiso)"
)


class GpuIsoLeakWarning(UserWarning):
    """An isolated test left something behind (``--gpu-isolate-leaks=warn``)."""


class GpuIsoStartWarning(UserWarning):
    """The fork server or prewarming could not be used; isolation itself is unaffected."""


@dataclass
class State:
    settings: Settings
    report_path: Path | None
    records: list[dict[str, Any]] = field(default_factory=list)
    supervisor: Supervisor | None = None
    devices: Devices = Devices((), "none")
    leases: Leases | None = None  # None: no GPUs, nothing to lease
    nvml: NvmlReader = field(default_factory=NvmlReader)
    summary_path: Path | None = None
    parallel: bool = False  # an xdist worker: other isolated tests run at the same time
    prewarmer: Prewarmer | None = None
    positions: dict[int, int] | None = None  # id(item) -> index in session.items
    told: int = 0  # how many of the supervisor's notices were shown
    runs: dict[str, int] = field(default_factory=dict)  # isolated runs per start method


STATE = pytest.StashKey[State]()


@dataclass
class Ran:
    """What became of one isolated test: its reports and what its record is made of."""

    reports: list[pytest.TestReport]
    spec: IsolationSpec | None = None
    outcome: Outcome | None = None  # None: no process ran
    lease: Lease | None = None
    verdict: Verdict | None = None

    def record(self, nodeid: str) -> dict[str, Any]:
        return build_record(nodeid, self.reports, self.outcome, self.spec, self.lease, self.verdict)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu-isolate", "GPU test isolation (pytest-gpuiso)")
    group.addoption(
        "--gpu-isolate",
        action="store_true",
        dest="gpu_isolate",
        default=None,
        help="run every test in a fresh process (ini: gpu_isolate).",
    )
    group.addoption(
        "--no-gpu-isolate",
        action="store_false",
        dest="gpu_isolate",
        default=None,
        help="run every test in-process, marked tests included (e.g. for --pdb).",
    )
    group.addoption(
        "--gpu-isolate-timeout",
        dest="gpu_isolate_timeout",
        metavar="SECONDS",
        help="timeout of an isolated test, counted from its turn (default 900; "
        "ini: gpu_isolate_timeout).",
    )
    group.addoption(
        "--gpu-isolate-grace",
        dest="gpu_isolate_grace",
        metavar="SECONDS",
        help="time between SIGTERM and SIGKILL on timeout (default 5; ini: gpu_isolate_grace).",
    )
    group.addoption(
        "--gpu-isolate-report",
        dest="gpu_isolate_report",
        metavar="PATH",
        help="write a JSON report of the isolated tests to PATH (ini: gpu_isolate_report).",
    )
    group.addoption(
        "--gpu-isolate-devices",
        dest="gpu_isolate_devices",
        metavar="auto|none|0,1,...",
        help="GPUs to lease: auto (CUDA_VISIBLE_DEVICES, else NVML), none, or a list of "
        "indices/UUIDs (default auto; ini: gpu_isolate_devices).",
    )
    group.addoption(
        "--gpu-isolate-slots",
        dest="gpu_isolate_slots",
        metavar="N",
        help="how many isolated tests may share one GPU at once (default 1; "
        "ini: gpu_isolate_slots).",
    )
    group.addoption(
        "--gpu-isolate-lease-timeout",
        dest="gpu_isolate_lease_timeout",
        metavar="SECONDS",
        help="fail a test that waited longer than this for its GPUs (default: wait; "
        "ini: gpu_isolate_lease_timeout).",
    )
    group.addoption(
        "--gpu-isolate-leaks",
        dest="gpu_isolate_leaks",
        metavar="warn|fail|off|KIND=LEVEL,...",
        help="what a leak (shm, process, gpu_memory) does: warn, fail the test, or off; "
        "per kind e.g. shm=fail,process=warn (default warn; ini: gpu_isolate_leaks).",
    )
    group.addoption(
        "--gpu-isolate-gpu-tolerance",
        dest="gpu_isolate_gpu_tolerance",
        metavar="MiB",
        help="GPU memory growth ignored by the leak check (default 64; "
        "ini: gpu_isolate_gpu_tolerance).",
    )
    group.addoption(
        "--gpu-isolate-torch-check",
        action="store_true",
        dest="gpu_isolate_torch_check",
        default=None,
        help="in the test's process, compare torch.cuda.memory_allocated() before and after "
        "the test (ini: gpu_isolate_torch_check).",
    )
    group.addoption(
        "--gpu-isolate-cleanup",
        action="store_true",
        dest="gpu_isolate_cleanup",
        default=None,
        help="delete leaked /dev/shm entries after reporting them (only the current user's, "
        "created during that test; ini: gpu_isolate_cleanup).",
    )
    group.addoption(
        "--gpu-isolate-summary",
        dest="gpu_isolate_summary",
        metavar="PATH",
        help="write a Markdown summary (leaks, timeouts, crashes) for PR checks "
        "(ini: gpu_isolate_summary).",
    )
    group.addoption(
        "--gpu-isolate-start",
        dest="gpu_isolate_start",
        metavar="spawn|forkserver",
        help="how isolated processes start: spawn a new interpreter, or fork them from a "
        "server that has imported pytest, the plugins, the conftests and the preload modules "
        "and never touched CUDA (default spawn; ini: gpu_isolate_start).",
    )
    group.addoption(
        "--gpu-isolate-preload",
        dest="gpu_isolate_preload",
        metavar="MODULE,...",
        help="modules the fork server and prewarmed processes import ahead of the tests "
        "(default: torch when installed; none: nothing; ini: gpu_isolate_preload).",
    )
    group.addoption(
        "--gpu-isolate-prewarm",
        dest="gpu_isolate_prewarm",
        metavar="N",
        help="start the processes of the next N isolated tests while one runs; 0: off "
        "(default 1; ini: gpu_isolate_prewarm).",
    )
    group.addoption(
        "--gpu-isolate-no-precollect",
        action="store_false",
        dest="gpu_isolate_precollect",
        default=None,
        help="with the fork server, do not configure pytest and collect the tests' modules "
        "once in a template that each test's process is forked from: each configures and "
        "collects for itself (ini: gpu_isolate_precollect = false).",
    )
    parser.addini("gpu_isolate_start", "spawn or forkserver", default="")
    parser.addini(
        "gpu_isolate_precollect", "fork tests from a pre-collected session (true/false)", default=""
    )
    parser.addini("gpu_isolate_preload", "modules imported ahead of the tests", default="")
    parser.addini("gpu_isolate_prewarm", "processes started ahead of their test", default="")
    parser.addini("gpu_isolate_leaks", "leak policy: warn, fail, off or kind=level,...", default="")
    parser.addini("gpu_isolate_gpu_tolerance", "GPU memory growth ignored, MiB", default="")
    parser.addini("gpu_isolate_torch_check", "compare torch's allocator (true/false)", default="")
    parser.addini("gpu_isolate_cleanup", "delete leaked /dev/shm entries", default="")
    parser.addini("gpu_isolate_summary", "path of the Markdown summary", default="")
    parser.addini(
        "gpu_isolate_shm_ignore", "glob patterns of /dev/shm names never reported", type="args"
    )
    parser.addini("gpu_isolate", "isolate every test (true/false)", default="false")
    parser.addini("gpu_isolate_devices", "GPUs to lease: auto, none or 0,1,...", default="")
    parser.addini("gpu_isolate_slots", "isolated tests per GPU at once", default="")
    parser.addini("gpu_isolate_lease_timeout", "seconds to wait for GPUs", default="")
    parser.addini("gpu_isolate_timeout", "timeout of an isolated test in seconds", default="")
    parser.addini("gpu_isolate_grace", "seconds between SIGTERM and SIGKILL", default="")
    parser.addini("gpu_isolate_report", "path of the JSON report", default="")


def _is_child(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin(CHILD_PLUGIN)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_DOC)
    if _is_child(config):
        return
    settings = Settings.from_config(config)
    report_path = None
    if settings.report_path:
        report_path = Path(config.invocation_params.dir, settings.report_path).resolve()
    state = State(settings=settings, report_path=report_path)
    state.parallel = hasattr(config, "workerinput")
    if settings.summary_path:
        state.summary_path = Path(config.invocation_params.dir, settings.summary_path).resolve()
    if settings.mode != "off":
        workdir.clean_stale()
        state.devices = discover(settings.devices, settings.devices_source)
        if state.devices.names:
            from ._lease import RegionError

            try:
                state.leases = Leases(state.devices, settings.slots)
            except RegionError as exc:
                raise pytest.UsageError(f"gpu-isolate: {exc}") from None
    config.stash[STATE] = state
    config.pluginmanager.register(Recorder(config, state), "gpuiso-recorder")


def pytest_unconfigure(config: pytest.Config) -> None:
    if STATE in config.stash:
        _close(config)
        workdir.remove_process_dir()


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash.get(STATE, None)
    if state is None:
        return []
    s = state.settings
    if s.mode == "off":
        return ["gpu-isolate: off (--no-gpu-isolate): every test runs in-process"]
    scope = "every test" if s.mode == "all" else f"tests marked {MARKER}"
    timeout = (
        f"{s.timeout:g} s ({s.timeout_source})" if s.timeout else f"{DEFAULT_TIMEOUT:g} s (default)"
    )
    lines = [
        f"gpu-isolate: {scope} in a fresh process, timeout {timeout}, grace {s.grace:g} s",
        _start_header(s),
    ]
    d = state.devices
    if d.names:
        lines.append(
            f"gpu-isolate: GPUs {','.join(d.names)} (from {d.source}), "
            f"{s.slots} test{'s' if s.slots != 1 else ''} per GPU at once"
        )
    else:
        lines.append(f"gpu-isolate: no GPUs to lease (from {d.source})")
    lines.append(_leak_header(s, state))
    if config.option.usepdb:
        lines.append("gpu-isolate: --pdb cannot reach into isolated tests; use --no-gpu-isolate")
    return lines


def _start_header(s: Settings) -> str:
    line = f"gpu-isolate: start {s.start}"
    if s.start == "forkserver":
        how = "pre-collected session" if s.precollect else "parsed configuration"
        line += f" (a server per pytest process that never initialises CUDA; forks from a {how})"
    preload = ",".join(s.preload) or "none"
    prewarm = f"next {s.prewarm} test{'s' if s.prewarm != 1 else ''}" if s.prewarm else "off"
    return f"{line}, preload {preload}, prewarm {prewarm}"


def _leak_header(s: Settings, state: State) -> str:
    levels = ", ".join(f"{kind}={level}" for kind, level in s.leaks)
    line = f"gpu-isolate: leak checks {levels}"
    if s.cleanup:
        line += ", leaked /dev/shm entries deleted"
    if s.leak_level("gpu_memory") != "off":
        if not state.devices.names:
            line += " (gpu_memory: no GPUs to check)"
        elif not state.nvml.available():
            line += f" (gpu_memory unavailable: {state.nvml.error})"
        else:
            line += f" (gpu_memory tolerance {s.gpu_tolerance_mib:g} MiB)"
    return line


_SHM_LOGS = itertools.count(1)


def _probes(spec: IsolationSpec, state: State, lease: Lease | None) -> tuple[Probe, ...]:
    """The leak probes of one test, besides the process sweep (which always runs)."""
    s = state.settings
    probes: list[Probe] = []
    if s.leak_level("shm") != "off":
        cleanup = s.cleanup and "shm" not in spec.allow_leaks
        log = workdir.process_dir() / f"shm-{next(_SHM_LOGS)}.log"
        probes.append(ShmProbe(s.shm_ignore, cleanup=cleanup, log=log, alone=not state.parallel))
    if lease is not None and s.leak_level("gpu_memory") != "off" and state.nvml.available():
        probes.append(
            GpuMemoryProbe(state.nvml, lease.devices, s.gpu_tolerance_mib, shared=s.slots > 1)
        )
    return tuple(probes)


def _warn_leaks(item: pytest.Item, verdict: Verdict) -> None:
    """``warn`` leaks reach pytest's warnings summary, like any warning of the test."""
    lineno = (item.location[1] or 0) + 1
    for leak in verdict.warning:
        message = GpuIsoLeakWarning(f"{leak.kind}: {leak.detail}")
        _record_warning(
            item.config, message, GpuIsoLeakWarning, item.nodeid, str(item.path), lineno
        )


def _isolated(item: pytest.Item) -> bool:
    state = item.config.stash.get(STATE, None)
    return state is not None and wants_isolation(item, state.settings)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if not _isolated(item):
        return None
    state = item.config.stash[STATE]
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    started = state.prewarmer.take(item.nodeid) if state.prewarmer is not None else None
    prewarmed: list[bool] = []

    def prewarm() -> None:
        """Start the next tests' processes: once this test has its go, or was not run."""
        if not prewarmed:
            prewarmed.append(True)
            _prewarm(item, nextitem, state)

    try:
        spec = spec_for_item(item, state.settings)
    except SpecError as exc:
        ran = Ran(setup_error_reports(item, str(exc)))
    else:
        ran = _run_isolated_item(item, spec, state, started, prewarm)
        started = None
    finally:
        if started is not None:
            _supervisor(item.config, state).discard(started)
    prewarm()
    reports = ran.reports
    _teardown_parent_stack(item, nextitem, reports)
    attach_record(reports, ran.record(item.nodeid))  # once every report is final
    for rep in reports:
        ihook.pytest_runtest_logreport(report=rep)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _gpus_wanted(item: pytest.Item, spec: IsolationSpec, state: State) -> int:
    """The marker's gpus, else 1 for a marked test when there are GPUs; unmarked tests: 0."""
    if spec.gpus is not None:
        return spec.gpus
    marked = item.get_closest_marker(MARKER) is not None
    return 1 if marked and state.devices.names else 0


def _too_few_gpus(n: int, state: State) -> str | None:
    have = len(state.devices.names)
    if n <= have:
        return None
    found = f"{have} ({', '.join(state.devices.names)})" if have else "none"
    return f"gpu-isolate: test needs {n} GPU{'s' if n != 1 else ''}, {found} available"


def _run_isolated_item(
    item: pytest.Item,
    spec: IsolationSpec,
    state: State,
    started: Started | None,
    after_go: Callable[[], None] | None = None,
) -> Ran:
    """Lease the test's GPUs (in this process), run it in a child, release after reaping.

    ``started``: the test's prewarmed process, if any; discarded when the test does not run.
    ``after_go``: called once the child has its go (prewarming the next tests then keeps
    their starts from delaying this one).
    """
    supervisor = _supervisor(item.config, state)
    n = _gpus_wanted(item, spec, state)
    lease = None
    try:
        too_few = _too_few_gpus(n, state)
        if too_few is not None:
            return Ran(skip_reports(item, too_few))
        if n > 0 and state.leases is not None:
            try:
                lease = state.leases.acquire(n, item.nodeid, state.settings.lease_timeout)
            except LeaseTimeout as exc:
                return Ran(setup_error_reports(item, str(exc)))
        env = state.leases.child_env(lease) if state.leases is not None else None
        job = started.job if started is not None else _item_job(item, state.settings)
        outcome, started = (
            supervisor.run(
                job,
                timeout=spec.timeout,
                grace=spec.grace,
                env=env,
                probes=_probes(spec, state, lease),
                started=started,
                after_go=after_go,
            ),
            None,
        )
    finally:
        if started is not None:
            supervisor.discard(started)
        if lease is not None:
            state.leases.release(lease)
    state.runs[outcome.method] = state.runs.get(outcome.method, 0) + 1
    _tell_start_problems(item, state, supervisor)
    leaks = outcome.leaks + [
        torch_check.leak(data) for data in outcome.frames_of(frames.TORCH_LEAK)
    ]
    verdict = judge(leaks, dict(state.settings.leaks), spec.allow_leaks)
    _replay_warnings(item.config, outcome.frames_of(frames.WARNING))
    _warn_leaks(item, verdict)
    _replay_junit(item.config, outcome.frames_of(frames.JUNIT))
    if outcome.finished and outcome.output:
        _echo(item.config, outcome.output)
    ran = Ran(item_reports(item, spec, outcome, verdict), spec, outcome, lease, verdict)
    reports = ran.reports
    stop = outcome.frames_of(frames.EXIT)
    if stop:  # pytest.exit() or KeyboardInterrupt in the test: end the session here too
        attach_record(reports, ran.record(item.nodeid))
        for rep in reports:
            item.ihook.pytest_runtest_logreport(report=rep)
        if stop[0]["interrupt"]:
            raise KeyboardInterrupt(stop[0]["message"])
        pytest.exit(stop[0]["message"], returncode=stop[0]["returncode"])
    return ran


def _supervisor(config: pytest.Config, state: State) -> Supervisor:
    if state.supervisor is None:
        s = state.settings
        reaper = set_child_subreaper()  # before the fork server starts: it relies on it
        capture = config.getoption("capture") not in ("no", "tee-sys")
        state.supervisor = Supervisor(
            workdir.process_dir(),
            capture_output=capture,
            start=s.start,
            preload=s.preload,
            exec_env=preload_env() if s.leak_level("shm") != "off" else {},
            server_args=(
                tuple(config.invocation_params.args),
                str(config.invocation_params.dir),
                s.precollect and s.mode == "all",  # its template collects what pytest does
            ),
            template_wait=s.template_wait,
        )
        if s.start == "forkserver" and not reaper:
            state.supervisor.method = "spawn"
            state.supervisor.notices.append(
                "the fork server needs PR_SET_CHILD_SUBREAPER (Linux); "
                "isolated tests are started with spawn instead"
            )
        if s.prewarm:
            state.prewarmer = Prewarmer(state.supervisor, s.prewarm)
    return state.supervisor


_LOOKAHEAD = 64  # items scanned past nextitem for the next isolated ones


def _prewarm(item: pytest.Item, nextitem: pytest.Item | None, state: State) -> None:
    """Have the processes of the next isolated tests started (see ``prewarm``)."""
    _supervisor(item.config, state)
    prewarmer = state.prewarmer
    if prewarmer is None or prewarmer.disabled is not None:
        return
    candidates: list[pytest.Item] = []
    if nextitem is not None:
        candidates = [nextitem]
        items = item.session.items
        if not state.parallel:  # under xdist only nextitem is known
            if state.positions is None:
                state.positions = {id(it): i for i, it in enumerate(items)}
            at = state.positions.get(id(nextitem))
            if at is not None:
                candidates = items[at : at + _LOOKAHEAD]
    by_id = {c.nodeid: c for c in candidates if _isolated(c)}
    prewarmer.refill(list(by_id), lambda nodeid: _prepare_warm(by_id[nodeid], state))


def _prepare_warm(item: pytest.Item, state: State) -> tuple[ItemJob, dict[str, str]] | None:
    """The job and start environment of a test's prewarmed process; None: it won't run one."""
    try:
        spec = spec_for_item(item, state.settings)
    except SpecError:
        return None
    n = _gpus_wanted(item, spec, state)
    if _too_few_gpus(n, state) is not None:
        return None
    env: dict[str, str] = {}
    if state.leases is not None:
        env = state.leases.child_env(None) if n == 0 else dict(HIDDEN_GPUS)
    return _item_job(item, state.settings), env


def _tell_start_problems(item: pytest.Item, state: State, supervisor: Supervisor) -> None:
    """Say once (as a warning) that the fork server or prewarming is not used, and why."""
    messages = supervisor.notices[state.told :]
    state.told = len(supervisor.notices)
    prewarmer = state.prewarmer
    if supervisor.stale and prewarmer is not None and prewarmer.disabled is None:
        prewarmer.disable(supervisor.stale)
        messages.append(
            f"prewarming turned off: a process started ahead of its test initialised CUDA "
            f"before it was given its GPUs ({supervisor.stale}); a plugin or conftest uses "
            "CUDA or NVML at import (torch.cuda.is_available() and device_count() do): "
            "call them in fixtures or tests instead"
        )
    lineno = (item.location[1] or 0) + 1
    for text in messages:
        message = GpuIsoStartWarning(f"gpu-isolate: {text}")
        _record_warning(
            item.config, message, GpuIsoStartWarning, item.nodeid, str(item.path), lineno
        )


def _runs_tests(config: pytest.Config) -> bool:
    """False in an xdist controller, which runs no test itself."""
    dist = getattr(config.option, "dist", "no")
    return hasattr(config, "workerinput") or dist == "no" or not dist


def _wants_server(config: pytest.Config, state: State | None) -> bool:
    if state is None or state.settings.mode == "off" or state.settings.start != "forkserver":
        return False
    return _runs_tests(config) and not config.option.collectonly


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """Start the fork server now, so that it imports torch while pytest collects.

    Only when every test is isolated; otherwise once collection found a marked test.
    """
    state = session.config.stash.get(STATE, None)
    if _wants_server(session.config, state) and state.settings.mode == "all":
        _supervisor(session.config, state).start_server()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Tell the fork server the isolated tests' modules: it loads their conftests, collects them."""
    state = session.config.stash.get(STATE, None)
    if not _wants_server(session.config, state):
        return
    modules = {str(item.path) for item in session.items if _isolated(item)}
    if not modules:
        return
    supervisor = _supervisor(session.config, state)
    supervisor.start_server()
    if supervisor.server is not None:
        directories = {str(Path(module).parent) for module in modules}
        precollect = sorted(modules) if state.settings.precollect else []
        supervisor.server.collect(sorted(directories), precollect)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    _close(session.config)


def _close(config: pytest.Config) -> None:
    """Discard prewarmed processes and stop the fork server."""
    state = config.stash.get(STATE, None)
    if state is not None and state.supervisor is not None:
        if state.prewarmer is not None:
            state.prewarmer.close()
        state.supervisor.close()


def _item_job(item: pytest.Item, settings: Settings) -> ItemJob:
    config = item.config
    factory = getattr(config, "_tmp_path_factory", None)
    parent = factory.getbasetemp() if factory is not None else Path(tempfile.gettempdir())
    xml = _junit_xml(config)
    return ItemJob(
        nodeid=item.nodeid,
        collect_arg=_collect_arg(item),
        args=tuple(config.invocation_params.args),
        invocation_dir=str(config.invocation_params.dir),
        basetemp=tempfile.mkdtemp(prefix="isolated-", dir=parent),
        junit_family=getattr(xml, "family", None),
        torch_check=settings.torch_check,
    )


def _junit_xml(config: pytest.Config) -> Any:
    """pytest's LogXML object when this process writes junitxml (not in xdist workers)."""
    return config.stash.get(_compat.xml_key, None)


def _replay_junit(config: pytest.Config, records: list[tuple[str, str | None, str, str]]) -> None:
    """Apply the child's record_xml_attribute / record_testsuite_property calls."""
    xml = _junit_xml(config)
    if xml is None:
        return
    for kind, nodeid, name, value in records:
        if kind == "attribute":
            xml.node_reporter(nodeid).add_attribute(name, value)
        else:
            xml.add_global_property(name, value)


def _echo(config: pytest.Config, text: str) -> None:
    """Show what the test wrote outside capture (e.g. under capsys.disabled()), as in-process."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        sys.stdout.write(text)
        sys.stdout.flush()


def _collect_arg(item: pytest.Item) -> str:
    """Narrow the child's collection to the test function when its name allows it.

    Parameter ids may hold ``::``, ``[`` or spaces, so the ``[...]`` part is never
    passed; the child picks the exact node id among what it collected.
    """
    path = str(item.path)
    _, sep, rest = item.nodeid.partition("::")
    names = rest.split("[", 1)[0]
    if sep and names and all(part.isidentifier() for part in names.split("::")):
        return f"{path}::{names}"
    return path


def _replay_warnings(config: pytest.Config, payloads: list[dict[str, Any]]) -> None:
    for data in payloads:
        message, category = frames.decode_warning(data)
        _record_warning(config, message, category, data["nodeid"], data["filename"], data["lineno"])


def _record_warning(
    config: pytest.Config,
    message: Warning,
    category: type[Warning],
    nodeid: str,
    filename: str,
    lineno: int,
) -> None:
    """Hand a warning of an isolated test to pytest's warnings summary, as in-process."""
    record = warnings.WarningMessage(
        message=message, category=category, filename=filename, lineno=lineno
    )
    config.hook.pytest_warning_recorded.call_historic(
        kwargs=dict(warning_message=record, when="runtest", nodeid=nodeid, location=None)
    )


def _teardown_parent_stack(item: pytest.Item, nextitem: pytest.Item | None, reports: list) -> None:
    """Tear down fixtures that earlier in-process tests left up and ``nextitem`` no longer needs.

    In-process, this teardown would belong to the test run just before
    ``nextitem``, so an error in it fails this test's teardown (an expected failure
    of an xfail test, as pytest's skipping plugin makes it in-process).
    """
    setupstate = _compat.setup_state(item.session)
    if setupstate is None or not setupstate.stack:
        return
    call = pytest.CallInfo.from_call(lambda: setupstate.teardown_exact(nextitem), when="teardown")
    if call.excinfo is None or not reports or reports[-1].when != "teardown":
        return
    failed = item.ihook.pytest_runtest_makereport(item=item, call=call)
    apply_xfail(item, failed, call.excinfo.value)
    failed.sections = list(reports[-1].sections) + list(failed.sections)
    reports[-1] = failed


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout must not also fire in the parent: the supervisor enforces the timeout."""
    return True if _isolated(item) else None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if _isolated(item) else None


class Recorder:
    """Collects the JSON records of isolated tests and writes the reports.

    Records ride on teardown reports, so under xdist the controller receives
    every worker's records test by test, even from a worker that later crashes.
    """

    def __init__(self, config: pytest.Config, state: State) -> None:
        self.config = config
        self.state = state
        self.summaries: list[str] = []  # where the Markdown summary went

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = record_of(report)
        if record is not None:
            self.state.records.append(record)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        state = self.state
        if state.parallel:
            return  # the xdist controller writes the reports, from every worker's records
        if state.report_path is not None:
            report.write_json(state.report_path, state.records)
        if state.summary_path is not None or (state.records and _step_summary()):
            self.summaries = report.write_markdown(state.summary_path, state.records)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        state = self.state
        if state.records:
            report.terminal_summary(terminalreporter, state.records, state.report_path)
        if self.summaries:
            terminalreporter.write_line(
                f"gpu-isolate: Markdown summary written to {', '.join(self.summaries)}"
            )


def _step_summary() -> bool:
    return bool(os.environ.get("GITHUB_STEP_SUMMARY"))


@pytest.fixture
def gpu_isolated_run(request: pytest.FixtureRequest):
    """``gpu_isolated_run(func, *args, timeout=None, gpus=0, **kwargs)``: call ``func`` in a
    fresh spawned process and return its value (see ``pytest_gpuiso.run_isolated``); GPUs
    come from the session's lease table."""
    state = request.config.stash.get(STATE, None)
    grace = state.settings.grace if state is not None else 5.0
    leases = state.leases if state is not None else None

    def run(func, *args, timeout=None, gpus=0, **kwargs):
        return call_isolated(
            func, args, kwargs, timeout=timeout, gpus=gpus, grace=grace, leases=leases
        )

    return run
