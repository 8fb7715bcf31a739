"""pytest-benchmark and isolated tests: their timings join pytest's table, JSON and saves.

pytest-benchmark keeps each benchmark's timings on its session
(``config._benchmarksession.benchmarks``) and builds the table, ``--benchmark-json``,
``--benchmark-save`` / ``--benchmark-autosave``, ``--benchmark-compare(-fail)`` and
histograms at the end of the session. A test's process would do all of that for its one
test (a JSON file, a saved run, a histogram per isolated test, overwriting each other),
and pytest would report none of the isolated ones. So:

- the tests' processes run with those outputs off (``pytest_gpuiso_child_options``) and
  with pytest's ``--benchmark-cprofile-dump`` prefix (made from the clock at parse time);
- each sends its benchmarks: names, group, params, extra_info, options, iterations, the
  per-round times, and the raw cProfile table (``pstats.Stats.stats``) with
  ``--benchmark-cprofile``;
- pytest rebuilds them as ``Metadata`` of its own session, which then reports, saves and
  compares them as benchmarks of its own (statistics computed from the same rounds).

Under xdist pytest-benchmark disables itself, in the tests' processes as in the workers.

pytest-benchmark's internals used (checked once; without them one warning):
``config._benchmarksession.benchmarks``,
``Metadata(fixture, iterations, options)`` with ``as_dict`` and ``stats.update``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

from ..warning_types import GpuIsoStartWarning, warn_session
from ..wire import wire
from . import plugin_version

PLUGIN = "benchmark"  # pytest-benchmark's entry point name
KEY = "pytest-benchmark"  # its part of the payload
# What a test's process must not write or check for its one test (pytest does, for all).
_OUTPUTS_OFF = (
    "benchmark_json",
    "benchmark_save",
    "benchmark_autosave",
    "benchmark_compare",
    "benchmark_compare_fail",
    "benchmark_histogram",
)
_SENT = ("name", "fullname", "group", "param", "params", "extra_info", "options")


def missing_internals() -> list[str]:
    """What this adapter needs of pytest-benchmark and the installed version lacks."""
    try:
        from pytest_benchmark.session import BenchmarkSession
        from pytest_benchmark.stats import Metadata, Stats
    except ImportError as exc:
        return [str(exc)]
    needs = {
        "BenchmarkSession.finish": hasattr(BenchmarkSession, "finish"),
        "Metadata(fixture, iterations, options)": list(inspect.signature(Metadata).parameters)[:3]
        == ["fixture", "iterations", "options"],
        "Metadata.as_dict": hasattr(Metadata, "as_dict"),
        "Stats.update": hasattr(Stats, "update"),
    }
    return [name for name, there in needs.items() if not there]


def _session(config: Any) -> Any:
    """pytest-benchmark's session object, if it keeps its benchmarks where we read them."""
    session = getattr(config, "_benchmarksession", None)
    return session if isinstance(getattr(session, "benchmarks", None), list) else None


class BenchmarkAdapter:
    """Both sides: outputs off and the timings sent in the test's process, joined in pytest."""

    def pytest_gpuiso_child_options(self, config: Any) -> dict[str, Any] | None:
        if not config.pluginmanager.has_plugin(PLUGIN):
            return None
        option = config.option
        missing = missing_internals()
        if _session(config) is None:
            missing.append("config._benchmarksession.benchmarks")
        if missing:
            warn_session(
                config,
                GpuIsoStartWarning(
                    f"pytest-benchmark {plugin_version('pytest-benchmark')}: no "
                    f"{', '.join(missing)}; isolated tests' benchmarks not reported"
                ),
            )
        # "off" in the shape the option has: [] for the appending ones, else None
        off = {
            dest: [] if isinstance(getattr(option, dest), list) else None
            for dest in _OUTPUTS_OFF
            if hasattr(option, dest)
        }
        if hasattr(option, "benchmark_cprofile_dump"):
            off["benchmark_cprofile_dump"] = option.benchmark_cprofile_dump
        return off

    def pytest_gpuiso_child_payload(self, item: Any, payload: dict[str, Any]) -> None:
        session = _session(item.config)
        if session is None or missing_internals():
            return
        sent = [_benchmark_record(bench) for bench in session.benchmarks if bench]
        if sent:
            payload[KEY] = sent

    def pytest_gpuiso_parent_payload(
        self, item: Any, payload: dict[str, Any], reports: list
    ) -> None:
        sent = payload.get(KEY)
        session = _session(item.config)
        if not sent or session is None:
            return
        from pytest_benchmark.stats import Metadata

        for record in sent:
            fixture = SimpleNamespace(
                **{name: record[name] for name in _SENT if name != "options"},
                has_error=record["has_error"],
                cprofile_stats=_profile_stats(record["cprofile"]),
            )
            bench = Metadata(fixture, iterations=record["iterations"], options=record["options"])
            for duration in record["data"]:
                bench.stats.update(duration)  # per iteration already
            session.benchmarks.append(bench)


def _benchmark_record(bench: Any) -> dict[str, Any]:
    """One benchmark as plain data; values that are not go as their repr."""
    as_dict = bench.as_dict(include_data=True)  # options' callables already as names
    record = {name: as_dict.get(name) for name in _SENT}
    for name in ("params", "extra_info"):
        if isinstance(record[name], dict):
            record[name] = {k: _plain(v) for k, v in record[name].items()}
    record["iterations"] = bench.iterations
    record["data"] = list(bench.stats.data)
    record["has_error"] = bool(bench.has_error)
    profile = getattr(bench, "cprofile_stats", None)
    record["cprofile"] = profile.stats if profile is not None else None
    return record


def _plain(value: Any) -> Any:
    """``value`` as plain data (``wire``); what is not, as its repr (as pytest-benchmark's
    JSON has it)."""
    return wire.plain(value, "", [])


class _Profile:
    """What ``pstats.Stats`` reads a profile from (as from a ``cProfile.Profile``)."""

    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def create_stats(self) -> None:
        pass


def _profile_stats(raw: dict | None) -> Any:
    """A ``pstats.Stats`` of the table the test's process measured."""
    if raw is None:
        return None
    import pstats

    return pstats.Stats(_Profile(raw))


def register(pluginmanager: Any) -> None:
    pluginmanager.register(BenchmarkAdapter(), "gpuiso-adapter-benchmark")
