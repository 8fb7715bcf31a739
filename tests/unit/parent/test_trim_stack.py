"""A hung test's stack as pytest's process shows it: the test's frames kept, the
internals folded."""

from __future__ import annotations

from pytest_gpuiso.parent.results import trim_stack


def test_trim_stack_keeps_test_frames_and_folds_internals():
    dump = "\n".join(
        [
            "Thread 0x1 (most recent call first):",
            '  File "/usr/lib/python3/threading.py", line 320 in wait',
            '  File "/x/site-packages/_pytest/runner.py", line 1 in a',
            "",
            "Current thread 0x2 (most recent call first):",
            '  File "/src/test_x.py", line 5 in helper',
            '  File "/src/test_x.py", line 9 in test_x',
            '  File "/x/site-packages/_pytest/python.py", line 187 in pytest_pyfunc_call',
            '  File "/x/site-packages/pluggy/_callers.py", line 1 in _multicall',
            '  File "/x/site-packages/_pytest/runner.py", line 2 in b',
        ]
    )
    trimmed = trim_stack(dump).splitlines()
    assert trimmed == [
        "Thread 0x1 (most recent call first):",
        '  File "/usr/lib/python3/threading.py", line 320 in wait',
        "  ... 1 frames of pytest and pytest-gpuiso internals",
        "",
        "Current thread 0x2 (most recent call first):",
        '  File "/src/test_x.py", line 5 in helper',
        '  File "/src/test_x.py", line 9 in test_x',
        "  ... 3 frames of pytest and pytest-gpuiso internals",
    ]
