"""The test's process: what runs in the fresh process an isolated test gets.

Runs in the test's process only (spawned, or forked by the fork server). ``bootstrap``
starts it (dies with pytest, rebuilds pytest's configuration, exits through pytest's
exit hooks) with pytest's options as ``overrides`` sets them, ``relay`` is its pytest
plugin (runs the one test, sends its reports), and ``cuda_state``, ``memory_cap``,
``imports`` and ``env_reads`` watch CUDA, cap GPU memory and note what the test imported
and which environment variables were read before its go. Knows nothing of pytest's side: it
imports neither ``parent``, nor ``forkserver``, ``gpu`` or ``reports``; what it needs
crosses in ``wire``.

Also here: ``exiting`` (how the test's process ends: its exit hooks, then saying so) and
``tracker`` (multiprocessing's resource tracker: its segments, handed to the leak
check).
"""
