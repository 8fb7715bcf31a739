"""One isolated test's life, as pytest's process lives it (the xdist worker's under xdist).

Runs in pytest's process only. ``runner`` takes a test down one straight path: its plan
(``plans``), its GPU lease, its process started (``launcher``, ``started``, ``prewarm``)
and watched to its end (``supervisor``, ``watch``, ``leaving``) or counted among those
that could not start (``start_failures``), what it sent decoded (``outcome``,
``results``) and replayed into pytest (``replay``), its verdict (``verdict``).
``session`` holds the session's settings and flags (cheap); ``worker`` what it isolates
with, made once (the settings, the GPUs, the door, the prewarmer, the GPUs' health; what
isolating runs loads behind it); ``call`` runs a function isolated (``run_isolated``).
Owns the tests' processes and the leases they hold; never creates a CUDA context.

Also here: ``turn`` (what one test's run holds until it ends), ``distributed`` (a test
run as N ranks: ``ranks=``), ``group`` (its processes waited for as one: the first to
end cuts the others' time) and ``ranks`` (their reports made one verdict),
``recording`` (each test's JSON record, built once), ``serving`` (the session's use of
the fork server), ``early`` (its interpreter, started before the conftests load) and
``standins`` (stand-in warning categories, for xdist's controller).
"""
