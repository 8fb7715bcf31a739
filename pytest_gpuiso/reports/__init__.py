"""What a session's records say, read and written: pytest's process, and the CLI.

Runs in pytest's process at the session's end (the xdist controller's) and in
``python -m pytest_gpuiso`` (``compare``, ``merge``). ``record`` reads the JSON record of
one test; ``report`` writes the JSON report, the Markdown summary and the terminal
summary; ``findings`` (annotations, GitLab), ``baseline`` (known leaks), ``shards``,
``compare`` and ``mdtext``. Never imports ``parent``, ``child`` or ``forkserver``.
"""
