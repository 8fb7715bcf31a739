"""What a session's records say, read and written: pytest's process, and the CLI.

Runs in pytest's process at the session's end (the xdist controller's) and in
``python -m pytest_gpuiso`` (``compare``, ``merge``). ``record`` reads the JSON record of
one test; ``report`` writes the JSON report, the Markdown summary and the terminal
summary; ``findings`` (annotations, GitLab), ``baseline`` (known leaks), ``shards``,
``compare`` and ``mdtext``. Never imports ``parent``, ``child`` or ``forkserver``.

Also here: ``controller`` (the reports' side of a session: their paths, the records, the
leak baseline, in the process that writes them), ``files`` (where reports are written:
whole or not at all), ``fixtures``
(broad-scoped fixtures each process set up anew), ``gpu_tables`` (the Markdown sections
about GPUs) and ``run_info`` (a report's ``session`` and ``environment`` blocks).
"""
