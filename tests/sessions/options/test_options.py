"""Options, ini keys and marker arguments: validation, precedence and where tests run."""

from __future__ import annotations

import re

import pytest

from tests.helpers import USAGE_ERROR

# pytest's report formats, hooks and internals: CI's lowest-versions stage runs them all
pytestmark = pytest.mark.versions


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["--gpu-isolate-timeout=abc"], "invalid value 'abc' for --gpu-isolate-timeout"),
        (["--gpu-isolate-timeout=-1"], "invalid value '-1' for --gpu-isolate-timeout"),
        (["--gpu-isolate-timeout=0"], "invalid value '0' for --gpu-isolate-timeout"),
        (["--gpu-isolate-timeout=nan"], "invalid value 'nan' for --gpu-isolate-timeout"),
        (["--gpu-isolate-grace=-1"], "invalid value '-1' for --gpu-isolate-grace"),
        (["--gpu-isolate-grace=soon"], "invalid value 'soon' for --gpu-isolate-grace"),
    ],
)
def test_bad_command_line_value_is_a_usage_error(gpuiso_spawn, args, culprit):
    """A bad CLI value stops the session with one line naming the option and value."""
    gpuiso_spawn.copy("test_where.py")
    result = gpuiso_spawn.run(*args)
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: {culprit}: expected a number of seconds*"])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def test_a_blank_command_line_value_is_parsed_like_any_other(gpuiso_spawn):
    """Every option reads its value by one rule: given on the command line, blank
    included, it is parsed (a blank count is an error, not the default)."""
    result = gpuiso_spawn.run("--gpu-isolate-slots=")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: gpu-isolate: invalid value '' for --gpu-isolate-slots: expected an integer *"]
    )


@pytest.mark.parametrize(
    ("ini", "culprit"),
    [
        ("gpu_isolate_timeout = abc", "invalid value 'abc' for ini gpu_isolate_timeout"),
        ("gpu_isolate_grace = -2", "invalid value '-2' for ini gpu_isolate_grace"),
        ("gpu_isolate_rank_wait = soon", "invalid value 'soon' for ini gpu_isolate_rank_wait"),
        ("gpu_isolate = maybe", "invalid value 'maybe' for ini gpu_isolate"),
        ("gpu_isolate_warnings = some", "invalid value 'some' for ini gpu_isolate_warnings"),
    ],
)
def test_bad_ini_value_is_a_usage_error(gpuiso_spawn, ini, culprit):
    gpuiso_spawn.copy("test_where.py")
    gpuiso_spawn.pytester.makeini(f"[pytest]\n{ini}\n")
    result = gpuiso_spawn.run()
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: {culprit}*"])
    assert "Traceback" not in result.stderr.str()


def test_grace_zero_is_valid(gpuiso_spawn):
    gpuiso_spawn.copy("test_where.py")
    gpuiso_spawn.run("--gpu-isolate-grace=0").assert_outcomes(passed=2)


MEMORY = (
    "expected bytes or a size such as 12GiB, 512MiB or 1.5GB (in B, KB, MB, GB, TB, KiB, MiB, "
    "GiB or TiB), more than 0 bytes and less than 8 EiB, or a share of the GPU such as 25% "
    "(more than 0%, at most 100%)"
)


def test_bad_marker_arguments_fail_only_their_test(gpuiso_spawn):
    """Each bad marker argument is an error of that test, named in one line of one shape
    (the value, where it came from, every form accepted there); neighbours run."""
    gpuiso_spawn.copy("test_markers.py")
    result = gpuiso_spawn.run("-rA")
    result.assert_outcomes(passed=2, errors=7)
    result.stdout.fnmatch_lines_random(
        [
            # every form gpu_memory accepts, 25% included (the text named sizes only)
            "gpu-isolate: invalid value '12 parsecs' for gpu_isolated marker argument "
            f"gpu_memory: {MEMORY}",
            f"gpu-isolate: invalid value '150%' for gpu_isolated marker argument gpu_memory: "
            f"{MEMORY}",
            "gpu-isolate: invalid value 'abc' for gpu_isolated marker argument timeout: "
            "expected a number of seconds > 0, at most 604800",
            "gpu-isolate: invalid value -1 for gpu_isolated marker argument grace: "
            "expected a number of seconds from 0 to 604800",
            "gpu-isolate: invalid value 1.5 for gpu_isolated marker argument gpus: "
            "expected an integer >= 0",
            "gpu-isolate: invalid value 'timout' for gpu_isolated marker argument name: "
            "expected timeout, startup_timeout, grace, gpus, gpu_memory, allow_leaks, ranks or "
            "rank_wait",
            "gpu-isolate: invalid value (5,) for gpu_isolated marker positional arguments: "
            "expected none, only keyword arguments timeout=, startup_timeout=, grace=, gpus=, "
            "gpu_memory=, allow_leaks=, ranks=, rank_wait=",
            "ERROR test_markers.py::test_bad_timeout*",  # pytest 8.0: no " - message"
            "ERROR test_markers.py::test_positional_argument*",  # pytest 8.0: no " - message"
            "PASSED test_markers.py::test_good_marker",
            "PASSED test_markers.py::test_neighbour",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_marker_isolates_only_marked_tests(gpuiso):
    gpuiso.copy("test_where.py")
    gpuiso.run().assert_outcomes(passed=2)


def test_gpu_isolate_flag_isolates_every_test(gpuiso):
    gpuiso.copy("test_where.py")
    result = gpuiso.run("--gpu-isolate", "-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_where.py::test_unmarked_runs_in_process*"])


def test_ini_gpu_isolate_true_isolates_every_test(gpuiso_spawn):
    gpuiso_spawn.copy("test_where.py")
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate = true\n")
    gpuiso_spawn.run().assert_outcomes(passed=1, failed=1)


def test_no_gpu_isolate_runs_everything_in_process(gpuiso_spawn):
    """--no-gpu-isolate beats the ini file and the marker (for --pdb debugging)."""
    gpuiso_spawn.copy("test_where.py")
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate = true\n")
    result = gpuiso_spawn.run("--no-gpu-isolate", "-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_where.py::test_marked_runs_isolated*"])
    result.stdout.fnmatch_lines(["gpu-isolate: off*"])


def _ours(result: pytest.RunResult) -> list[str]:
    return [line for line in result.stdout.lines if line.startswith("gpu-isolate")]


def test_report_header_describes_settings(gpuiso_spawn):
    """Three lines at pytest's default verbosity (what, timeout; GPUs; leak checks); the
    details with -v."""
    gpuiso_spawn.copy("test_where.py")
    args = ("--gpu-isolate", "--gpu-isolate-timeout=30", "--gpu-isolate-grace=2", "-k", "marked")
    result = gpuiso_spawn.run(*args)
    header = _ours(result)[: _ours(result).index("gpu-isolate: 2 isolated, 0 timed out, 0 crashed")]
    assert header == [
        "gpu-isolate: every test in a fresh process (spawn), timeout 30 s (--gpu-isolate-timeout)",
        "gpu-isolate: no GPUs to lease (from NVML)",
        "gpu-isolate: leak checks shm=warn, process=warn, gpu_memory=warn "
        "(gpu_memory: no GPUs to check)",
    ]
    assert not any(line.startswith("gpu-isolate: started") for line in _ours(result))
    result = gpuiso_spawn.run(*args, "-v")
    result.stdout.fnmatch_lines(
        [
            "gpu-isolate: every test in a fresh process, timeout 30 s "
            "(--gpu-isolate-timeout), grace 2 s, start-up bound 300 s",
            "gpu-isolate: start spawn, preload none, prewarm next 1 test",
            "*",
            "gpu-isolate: started 2 spawn; 1 prewarmed*",
        ]
    )


def test_a_session_that_isolates_nothing_says_nothing(gpuiso_spawn):
    """Installed, with no option and no marked test: no line of ours, and neither NVML
    nor the machinery of isolation is touched (nor imported)."""
    gpuiso_spawn.pytester.makepyfile(
        test_plain="def test_a():\n    assert True\n",
        conftest=(
            "import sys\n"
            "def pytest_unconfigure(config):\n"
            "    ours = ('pytest_gpuiso', 'pynvml')\n"
            "    loaded = sorted(m for m in sys.modules if m.startswith(ours))\n"
            "    open('loaded.txt', 'w').write('\\n'.join(loaded))\n"
        ),
    )
    result = gpuiso_spawn.run("-rA")
    result.assert_outcomes(passed=1)
    assert _ours(result) == []
    loaded = (gpuiso_spawn.path / "loaded.txt").read_text().split()
    assert "pytest_gpuiso.plugin" in loaded  # the plugin was there, and quiet
    for heavy in (
        "pynvml",
        "pytest_gpuiso._lease",
        "pytest_gpuiso.parent.runner",
        "pytest_gpuiso.proc.workdir",
        "pytest_gpuiso.parent.launcher",
    ):
        assert heavy not in loaded, heavy


def test_marked_tests_are_announced_once_collected(gpuiso_spawn):
    """Where only marked tests are isolated, the lines come after collection, with how many."""
    gpuiso_spawn.copy("test_where.py")
    result = gpuiso_spawn.run("-k", "marked")
    header = _ours(result)
    assert header[0] == (
        "gpu-isolate: 1 test marked gpu_isolated in a fresh process (spawn), "
        "timeout 900 s (default)"
    )
    assert result.stdout.lines.index(header[0]) > result.stdout.lines.index("collected 2 items")


def test_help_shows_the_common_options_first(gpuiso_spawn):
    """pytest --help: the options most users set in the main group, the others in a
    tuning group; every one of them is still there."""
    out = gpuiso_spawn.run("--help").stdout.str()
    main = out.split("GPU test isolation (pytest-gpuiso):")[1].split("\n\n")[0]
    tuning = out.split("GPU test isolation, tuning")[1].split("\n\n")[0]
    main_flags = set(re.findall(r"^  (--[a-z-]+)", main, re.M))
    assert "--gpu-isolate" in main_flags and "--gpu-isolate-timeout" in main_flags
    assert len(main_flags) <= 10, main_flags
    assert "--gpu-isolate-prewarm" in tuning and "--gpu-isolate-grace" in tuning


def test_pdb_note_in_header(gpuiso_spawn):
    """--pdb turns isolation off (sessions/isolation/test_pytest_semantics.py checks the runs)."""
    gpuiso_spawn.copy("test_where.py")
    result = gpuiso_spawn.run("--pdb", "-k", "unmarked")
    result.stdout.fnmatch_lines(["gpu-isolate: off (--pdb): every test runs in-process"])


def _timeout_line(result: pytest.RunResult) -> str:
    lines = [line for line in result.stdout.lines if "timed out after" in line]
    assert lines, result.stdout.str()
    return lines[0]


def test_precedence_ini_then_cli_then_marker(gpuiso_spawn):
    """ini < command line < marker: the most specific setting wins."""
    gpuiso_spawn.copy("test_sleep_two.py")
    # Timeouts of 1 s or more: on a loaded machine a spawned process may take more than
    # 0.5 s from its go to the test's call, and a timeout before it fails the setup.
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate_timeout = 1\n")
    # ini alone: 1 s is too short for a 2 s test
    result = gpuiso_spawn.run("--gpu-isolate", "--gpu-isolate-grace=0")
    result.assert_outcomes(failed=1)
    assert "timed out after 1 s (timeout from ini gpu_isolate_timeout)" in _timeout_line(result)
    # command line beats ini
    result = gpuiso_spawn.run("--gpu-isolate", "--gpu-isolate-timeout=1.2", "--gpu-isolate-grace=0")
    result.assert_outcomes(failed=1)
    assert "timed out after 1.2 s (timeout from --gpu-isolate-timeout)" in _timeout_line(result)
    # marker beats both
    gpuiso_spawn.pytester.makeconftest(
        "import pytest\n"
        "def pytest_collection_modifyitems(items):\n"
        "    for item in items:\n"
        "        item.add_marker(pytest.mark.gpu_isolated(timeout=30))\n"
    )
    result = gpuiso_spawn.run("--gpu-isolate-timeout=1.2")
    result.assert_outcomes(passed=1)


def test_marker_grace_is_used(gpuiso_spawn):
    gpuiso_spawn.copy("test_hangs.py")
    gpuiso_spawn.pytester.makeconftest(
        "import pytest\n"
        "def pytest_collection_modifyitems(items):\n"
        "    for item in items:\n"
        "        item.add_marker(pytest.mark.gpu_isolated(timeout=1, grace=0.25))\n"
    )
    result = gpuiso_spawn.run("-k", "sleeps_forever")
    result.assert_outcomes(failed=1)
    assert "0.25 s grace" in _timeout_line(result)


def test_marker_on_module_and_class_and_closest_wins(gpuiso_spawn):
    gpuiso_spawn.copy("test_marker_scopes.py")
    result = gpuiso_spawn.run("--gpu-isolate-grace=0")
    result.assert_outcomes(passed=2, failed=1)
    assert "timed out after 1 s (timeout from marker)" in _timeout_line(result)


def test_every_option_has_an_ini_key_and_typed_booleans(gpuiso_spawn):
    """The options come from one table: each flag names its ini key, booleans are pytest bools."""
    result = gpuiso_spawn.run("--help")
    out = result.stdout.str()
    flags = sorted(set(re.findall(r"--gpu-isolate[a-z-]*", out)))
    assert len(flags) >= 15, flags
    negatives = {
        "--no-gpu-isolate",
        "--gpu-isolate-no-precollect",
        "--gpu-isolate-no-learn-imports",
    }
    for flag in set(flags) - negatives:
        key = flag.lstrip("-").replace("-", "_")
        assert f"ini: {key})" in " ".join(out.split()), flag  # --help wraps lines
        assert re.search(rf"^  {key} \((string|bool)\):", out, re.M), key
    for key in ("gpu_isolate", "gpu_isolate_cleanup", "gpu_isolate_torch_check"):
        assert re.search(rf"^  {key} \(bool\):", out, re.M), key
    assert re.search(r"^  gpu_isolate_precollect \(bool\):", out, re.M)
    assert re.search(r"^  gpu_isolate_learn_imports \(bool\):", out, re.M)
    assert "(ini: gpu_isolate_learn_imports = false)" in " ".join(out.split())
    assert re.search(r"^  gpu_isolate_shm_ignore \(args\):", out, re.M)


@pytest.mark.parametrize(
    ("how", "source"),
    [
        (["--timeout=7"], "pytest-timeout --timeout"),
        (["-o", "timeout=8"], "pytest-timeout ini timeout"),
        ("env", "pytest-timeout PYTEST_TIMEOUT"),
    ],
)
def test_header_names_pytest_timeouts_value(gpuiso_spawn, monkeypatch, how, source):
    """Without a gpu-isolate timeout, the header gives pytest-timeout's, not our default."""
    gpuiso_spawn.copy("test_where.py")
    args = ["-p", "timeout"]
    if how == "env":
        monkeypatch.setenv("PYTEST_TIMEOUT", "9")
    else:
        args += how
    result = gpuiso_spawn.run(*args, "-k", "test_marked")
    seconds = "9" if how == "env" else how[-1].split("=")[-1]
    result.stdout.fnmatch_lines(
        [
            f"gpu-isolate: 1 test marked gpu_isolated in a fresh process (spawn), "
            f"timeout {seconds} s ({source})"
        ]
    )
    assert "(default)" not in result.stdout.str()
