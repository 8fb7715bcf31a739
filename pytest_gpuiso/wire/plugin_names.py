"""The names our pytest plugins register under in the processes that run no session of
their own, for the modules that look for them (``pluginmanager.has_plugin``).

A bottom floor of its own: the adapters ask "is this a test's process?" without
importing the test's side (``child.relay``) or the fork server.
"""

from __future__ import annotations

CHILD_PLUGIN = "gpuiso-child"  # a test's process, forked ones included (child.relay)
SERVER_PLUGIN = "gpuiso-forkserver"  # the fork server, before it parses (forkserver.server)
