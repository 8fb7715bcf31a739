"""Processes and files of the operating system, for every process of ours.

``proctree`` (process trees: kill, sweep, stack dumps), ``workdir`` (the session's private
directory), ``dead_sessions`` (what a killed session left behind) and ``_linux`` (prctl:
the subreaper, dying with the parent). Imports nothing of ours above it.
"""
