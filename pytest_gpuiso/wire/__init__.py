"""What crosses a process boundary, in one place: read by every process, owned by none.

``frames`` (the result channel's messages) and ``payloads`` (the fields of those whose
payload is an object), ``wire`` (plain data, encoded and checked),
``jobs`` (the job contract: what pytest hands a test's process to run), ``plugin_names``
and ``environment`` (every ``PYTEST_GPUISO_*`` variable that crosses
from one process to another: who sets it, who reads it). Imports nothing of ours above it.
"""
