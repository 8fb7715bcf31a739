"""Every private pytest API pytest-gpuiso uses, in one place: the upgrade surface.

Checked (2026-11-24) with the whole suite on pytest 8.0.0 (the lowest declared: CI's last
stage, ``tox -e lowest``) and 9.2.0 (the newest), and with the demo suite on 8.3.5.
``runtestprotocol``, ``known_args`` and ``basetemp`` were moved here later: their pytest
names were checked in the sources of 8.0.0 and 9.2.0 (the suite ran on 9.2.0).
Where pytest's insides are not as expected, the helpers here fall back to public behaviour.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _pytest.capture as _capture
from _pytest import tmpdir as _tmpdir
from _pytest._code.code import TerminalRepr  # noqa: F401 - re-exported
from _pytest.config import Config, _prepareconfig, apply_warning_filters, create_terminal_writer
from _pytest.faulthandler import fault_handler_stderr_fd_key  # noqa: F401 - re-exported
from _pytest.junitxml import _check_record_param_type as check_record_param_type  # noqa: F401
from _pytest.junitxml import xml_key  # noqa: F401 - re-exported
from _pytest.runner import runtestprotocol  # noqa: F401 - re-exported
from _pytest.skipping import evaluate_xfail_marks  # noqa: F401 - re-exported

# pytest.TerminalReporter is public only from pytest 8.4 on.
from _pytest.terminal import TerminalReporter  # noqa: F401 - re-exported
from pytest import StashKey


def prepare_config(args: list[str], plugins: list[Any]) -> Any:
    """Parse pytest's configuration in a process of ours (a test's, the fork server, its
    template) from pytest's own arguments, with what pytest warns about it unsaid here.

    pytest's process parsed the same configuration first and said its config-time
    warnings there, under the project's filters (one its ``filterwarnings = error`` makes
    an error ends that session before any test runs). Here they are an echo, or an
    artifact of this process: ``pytest_gpuiso`` (or a preloaded module) imported before
    pytest marks the installed plugins for assertion rewriting ("Module already imported
    so cannot be rewritten"). So ``Config.issue_config_time_warning`` (public, on pytest
    8.0 and 9.2 the one way pytest and plugins issue them) neither raises nor records
    them, for the life of this process, whose configuration this is.
    """
    Config.issue_config_time_warning = _said_by_pytests_process  # type: ignore[method-assign]
    return _prepareconfig(args, plugins=plugins)


def _said_by_pytests_process(self: Any, warning: Warning, stacklevel: int) -> None:
    """``Config.issue_config_time_warning`` in our processes (``prepare_config``)."""


def set_location(item: Any, location: tuple[str, int | None, str]) -> None:
    """Give ``item`` its ``location`` (a ``cached_property`` on pytest 8.0 and 9.2, which
    reads the test's source to compute it) as pytest's process computed it."""
    if "location" not in vars(item):
        vars(item)["location"] = location


_ANONYMOUS = getattr(_capture, "TemporaryFile", None)  # pytest's own (tempfile's)


def set_capture_tempfile(factory: Callable[..., Any] | None) -> None:
    """Make pytest's fd capture open its files with ``factory`` (None: pytest's own,
    anonymous ones; anonymous if it cannot)."""
    if hasattr(_capture, "TemporaryFile"):
        _capture.TemporaryFile = factory if factory is not None else _ANONYMOUS


def adopt_global_capture(config: Any) -> bool:
    """Keep the global capture this process inherited (suspended) and give it files of its
    own: its fd captures write to fresh files (made by ``TemporaryFile``, named once
    ``set_capture_tempfile`` ran) and restore this process's own stdout and stderr, as
    they now are. The stream objects stay the same, so what a module took at collection
    (a logger around ``sys.stdout``) is ``sys.stdout`` at test time, as in one pytest
    process. False: nothing to adopt (no capture, or not suspended as expected)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    if getattr(capman, "_global_capturing", None) is None:
        return False
    for capture in _global_fd_captures(config, ("out", "err")):
        if capture._state != "suspended":
            return False
        os.dup2(capture.targetfd, capture.targetfd_save)  # restores ours, not the template's
        fresh = _capture.TemporaryFile(buffering=0)
        os.dup2(fresh.fileno(), capture.tmpfile.fileno())
        fresh.close()
    capman.read_global_capture()  # whatever sys capture still held is the template's
    return True


def global_capture_fds(config: Any) -> set[int]:
    """The descriptors of the session's global capture (its files and saved streams):
    pytest's, which each test's process keeps and gives files of its own."""
    fds = set()
    for capture in _global_fd_captures(config, ("in_", "out", "err")):
        fds.update((capture.tmpfile.fileno(), capture.targetfd_save))
    return fds


def _global_fd_captures(config: Any, streams: tuple[str, ...]) -> list[Any]:
    """The session's global capture's fd captures of ``streams`` ("in_", "out", "err");
    none for a stream captured otherwise (sys, tee-sys, no) or without a global capture."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)
    captures = (getattr(capturing, name, None) for name in streams)
    return [c for c in captures if isinstance(c, _capture.FDCaptureBase)]


def basetemp(config: Any) -> Path | None:
    """The session's base temporary directory (made on first call), or None where pytest's
    tmp_path plugin is off (``-p no:tmpdir``)."""
    factory = getattr(config, "_tmp_path_factory", None)
    return factory.getbasetemp() if factory is not None else None


def retarget_basetemp(config: Any, basetemp: str) -> None:
    """Point the session's TempPathFactory at ``basetemp``, in place where its insides are known.

    In place, legacypath's ``tmpdir_factory`` and any plugin that kept a reference see it
    too; elsewhere pytest's tmpdir plugin makes a new factory.
    """
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:  # -p no:tmpdir: no tmp_path, nothing to point
        return
    if hasattr(factory, "_given_basetemp"):
        factory._given_basetemp = Path(os.path.abspath(basetemp))
        factory._basetemp = None
        return
    _tmpdir.pytest_configure(config)


def load_conftests(config: Any, directory: Path) -> None:
    """Import the conftests pytest would load when collecting ``directory``.

    ``consider_namespace_packages`` (ini key and argument) exists from pytest 8.1 on.
    """
    manager = config.pluginmanager
    importmode = config.getoption("importmode")
    try:
        namespaces = config.getini("consider_namespace_packages")
    except ValueError:  # pytest 8.0
        manager._loadconftestmodules(directory, importmode, rootpath=config.rootpath)
        return
    manager._loadconftestmodules(
        directory,
        importmode,
        rootpath=config.rootpath,
        consider_namespace_packages=namespaces,
    )


def rewrite_for(session: Any, initial_paths: tuple[str, ...] | None = None) -> None:
    """What pytest's assertion plugin does at ``pytest_collection``, for a plugin of ours
    that collects in its place: the rewrite hook learns the session, so that a file named
    on the command line that ``python_files`` does not match is rewritten, as in-process.

    ``initial_paths``: the paths pytest's own session started from (``initial_paths``),
    which the hook is to take for the command line's; None: this session's own. A test's
    process collects only its test's file, which would make that file "named on the
    command line" and its plain asserts rewritten (a doctest module's ``assert x, "msg"``
    would then raise with pytest's explanation appended, failing its doctest)."""
    from _pytest.assertion import assertstate_key

    state = session.config.stash.get(assertstate_key, None)
    if state is not None and state.hook is not None:
        seen = session if initial_paths is None else _StartedFrom(session, initial_paths)
        state.hook.set_session(seen)


_INITIAL_PATHS = StashKey[tuple[str, ...]]()


def initial_paths(session: Any) -> tuple[str, ...]:
    """The files and folders ``session`` started from, once it collected (its arguments,
    ``testpaths`` or the rootdir), as the assertion rewriter reads them; read once."""
    paths = session.stash.get(_INITIAL_PATHS, None)
    if paths is None:
        found = getattr(session, "_initialpaths", ())
        paths = session.stash[_INITIAL_PATHS] = tuple(sorted(str(path) for path in found))
    return paths


class _StartedFrom:
    """A session as the assertion rewriter reads it (``_initialpaths``, ``isinitpath``: all
    it reads, pytest 8.0 to 9.2), with the initial paths of pytest's own session."""

    def __init__(self, session: Any, paths: tuple[str, ...]) -> None:
        self._session = session
        self._initialpaths = frozenset(Path(path) for path in paths)

    def isinitpath(self, path: Any, *, with_parents: bool = False) -> bool:
        path = Path(path)
        if path in self._initialpaths:
            return True
        return with_parents and any(path in start.parents for start in self._initialpaths)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def setup_state(session: Any) -> Any:
    """The session's SetupState (the stack of set-up nodes), or None."""
    return getattr(session, "_setupstate", None)


def known_args(config: Any) -> argparse.Namespace:
    """The options pytest parsed before it loaded the initial conftests (undocumented)."""
    return config.known_args_namespace


def apply_session_filters(config: Any) -> None:
    """Apply the ini ``filterwarnings`` and ``-W`` filters, as pytest does for its own
    warnings outside a test (``Config.issue_config_time_warning``)."""
    cmdline = getattr(known_args(config), "pythonwarnings", None) or []
    apply_warning_filters(config.getini("filterwarnings"), cmdline)


def show_setup_on(config: Any, file: Any) -> None:
    """Have ``--setup-show`` (and ``show_test_item``) write to ``file``: they write
    through ``config.get_terminal_writer()``, the terminal reporter's writer."""
    writer = create_terminal_writer(config, file)
    config.get_terminal_writer = lambda: writer
