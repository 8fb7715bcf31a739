"""Stand-in warning categories, by name: the module that xdist's controller imports.

A test's warning whose category's module pytest's process has not imported is replayed
with a stand-in class (``replay.stand_in``) whose ``__module__`` is this one. Under xdist
a worker ships each warning to the controller as the category's module and class name,
and the controller imports that module to rebuild it; it imports this module then, never
the test's, and ``__getattr__`` answers the class name with a class of that name.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1024)
def __getattr__(name: str) -> type[Warning]:
    """A ``UserWarning`` subclass named ``name``, one per name (the worker's class knew its
    builtin base; the controller only shows the warning, its filters were applied)."""
    if not name.isidentifier() or name.startswith("__"):
        raise AttributeError(name)
    return type(name, (UserWarning,), {"__module__": __name__})
