"""python -m pytest_gpuiso status | reset [--force] [--device GPU] | merge REPORT... |
compare BASE HEAD | --version: inspect or clear the GPU lease table (or lift a GPU's
quarantine), merge the JSON reports of CI shards, or compare a pull request's report with
its base's. Every command exits 0 (ok), 1 (findings, or a refusal) or 2 (a usage error, or
an input or output it cannot use: one "error: ..." line on stderr), as EXIT_STATUS says."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from .gpu import table
from .gpu.leases import REGION_ENV
from .termtext import inert
from .values import VERSION

MERGE_HELP = """\
merge the JSON reports (--gpu-isolate-report) of CI shards into one JSON report, one
Markdown summary and/or pytest-split's durations file; each merged record gets a "shard"
field naming the file it came from. The Markdown summary is also appended to
$GITHUB_STEP_SUMMARY when that is set. The durations file ({nodeid: seconds}, for
pytest-split's --durations-path) holds each test's wall time in its own process, start-up
included (its last attempt, across shards), so that shards balance by what isolation costs;
an existing durations file is updated: tests this run did not run keep their entries.

exit status: 0 when the outputs were written; 2 for a usage error (no REPORT, none of
--markdown, --json, --durations) or when an input report cannot be read or used (missing, not
JSON, another version, a malformed record: nothing is written then) or an output cannot
be written, with one line on stderr: "error: PATH: problem". Tests found in more than
one shard (overlapping shards) are merged anyway, each counted once (every attempt of it
in the shard that holds its last attempt), with one line on stderr: "warning: N tests
are in more than one shard ...", naming the first few and their shards."""


def _error(message: str, status: int = 2) -> int:
    """One ``error: MESSAGE`` line on stderr (inert: it may quote a report's text); the
    exit status (EXIT_STATUS)."""
    print(f"error: {inert(message)}", file=sys.stderr)
    return status


def _merge(opts: argparse.Namespace) -> int:
    from .reports import files, report, run_info, shards

    try:
        merged = shards.merge(opts.reports)
        kept = shards.read_durations(opts.durations) if opts.durations is not None else None
    except shards.ReportError as exc:
        return _error(str(exc))
    overlap = shards.overlap_line(merged.overlapping)
    if overlap:
        print(f"warning: {inert(overlap)}", file=sys.stderr)
    records, runs = merged.records, merged.runs
    for run in runs:  # a shard whose session was killed: what finished before, said so
        said = run_info.partial(run_info.session_of({"session": run.get("session")}))
        if said:
            print(f"warning: {inert(str(run['path']))}{inert(said)}", file=sys.stderr)
    tests = len({r["nodeid"] for r in records})  # a rerun test has a record per attempt
    shards_text = f"{tests} tests from {len(opts.reports)} reports"
    text = report.markdown(records)
    durations = json.dumps(shards.durations(records, kept), indent=2, sort_keys=True) + "\n"
    outputs = [
        (opts.json, "JSON report", lambda path: files.write_json(path, records, shards=runs)),
        (opts.markdown, "Markdown summary", lambda path: files.write_text(path, text)),
        (opts.durations, "durations file", lambda path: files.write_text(path, durations)),
    ]
    for path, what, write in outputs:
        if path is None:
            continue
        try:
            write(path)
        except OSError as exc:
            return _error(f"{path}: cannot write: {exc.strerror or exc}")
        print(f"wrote the merged {what} ({shards_text}) to {inert(path)}")
    _step_summary(text, f"the merged Markdown summary ({shards_text})")
    return 0


def _step_summary(text: str, what: str) -> None:
    """Append ``text`` to ``$GITHUB_STEP_SUMMARY`` where it is set; a CI convenience that
    cannot be written is a warning, never a failure of the command."""
    from .reports import files

    if files.step_summary_path():
        problem = files.append_step_summary(text)
        step = f"${files.STEP_SUMMARY_ENV}"
        if problem:
            print(f"warning: not appended to {step} ({inert(problem)})", file=sys.stderr)
        else:
            print(f"appended {what} to {step}")


COMPARE_HELP = """\
compare two JSON reports (--gpu-isolate-report, or shards merged with `merge --json`),
test by test on each test's last attempt: a leak kind, crash or timeout a test has in
HEAD and did not have in BASE, a start-up or GPU memory peak that grew past its
threshold (new); what BASE had and HEAD no longer has (fixed). A test only in HEAD (one
the change added) is listed, and what it does wrong is new: a leak its marker does not
allow, a crash, a timeout. A test only in BASE is listed for information, never counted.
What is new can also become GitHub annotations at the tests' lines and a GitLab Code
Quality report. The Markdown is also appended to $GITHUB_STEP_SUMMARY when that is set.

With --write-baseline FILE, also write HEAD's leaks as a leak baseline
(--gpu-isolate-leak-baseline); given one report, only that.

exit status: 0 when nothing is new; 1 when something is; 2 for a usage error or when a
report cannot be read or used or an output cannot be written (one line on stderr:
"error: PATH: problem")."""


def _compare(opts: argparse.Namespace) -> int:
    from .reports import baseline, compare, files, findings, run_info, shards

    paths = [path for path in (opts.base, opts.head) if path is not None]
    documents, sides = [], []
    try:
        for path in paths:
            documents.append(shards.document(path))
            sides.append(shards.records_of(path, documents[-1]))
    except shards.ReportError as exc:
        return _error(str(exc))
    head = sides[-1]
    outputs = []  # (path, text, what)
    known = baseline.entries(head) if opts.write_baseline is not None else []
    if opts.write_baseline is not None:
        outputs.append((opts.write_baseline, baseline.text(known), "leak baseline"))
    result = None
    if len(sides) == 2:
        growth = opts.peak_growth * (1 << 20)  # a float: "inf" MiB never grows past it
        result = compare.compare(sides[0], head, opts.startup_growth, growth)
        runs = [run_info.session_of(doc) for doc in documents]
        if any(runs):
            print(f"base: {inert(run_info.line(runs[0]))}\nhead: {inert(run_info.line(runs[1]))}")
        for difference in run_info.differences(*runs):  # a finding may be the runner's
            print(f"warning: the runs differ: {inert(difference)}", file=sys.stderr)
        print(compare.text(result), end="")
        found = findings.of_changes(result.new, head)
        if findings.wanted(opts.annotations):
            for line in findings.workflow_commands(found):
                print(line)
        if opts.markdown is not None:
            outputs.append((opts.markdown, compare.markdown(result), "Markdown"))
        if opts.code_quality is not None:
            outputs.append((opts.code_quality, findings.code_quality(found), "report"))
    for path, text, what in outputs:
        try:
            files.write_text(path, text)
        except OSError as exc:
            return _error(f"{path}: cannot write: {exc.strerror or exc}")
        if what == "leak baseline":
            head, out = inert(opts.head), inert(path)
            print(f"wrote the leak baseline ({len(known)} leaks of {head}) to {out}")
    if result is not None:
        _step_summary(compare.markdown(result), "the comparison's Markdown")
    return 1 if result is not None and result.new else 0


DESCRIPTION = """\
Inspect or clear the GPU lease table that pytest-gpuiso's workers share, merge the JSON
reports of CI shards, or compare a pull request's report with its base's. Options may
come before or after the command."""

EXIT_STATUS = """\
exit status, the same for every command: 0 when all went well (compare: nothing new);
1 for findings or a refusal (compare: something new; reset: a live holder, or a GPU that
still fails its probe); 2 for a usage error, or an input that cannot be read or used (a
report, the lease table) or an output that cannot be written. Each failure is one line
on stderr, "error: ...", that names the file, holder or GPU at fault."""

REGION_HELP = (
    f"lease table file (default: ${REGION_ENV} when set, else /dev/shm/pytest-gpuiso-leases-UID)"
)


def _threshold(text: str) -> float:
    """A growth threshold: a number >= 0 ("inf": never); anything else is a usage error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"not a number >= 0: {text!r}")
    return value


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line parser, and its sub-parsers by command (for their usage errors)."""
    # --region is accepted before the command and after it: the sub-parsers' copy
    # defaults to SUPPRESS so that it does not overwrite a value given before.
    region = argparse.ArgumentParser(add_help=False)
    region.add_argument("--region", metavar="PATH", default=argparse.SUPPRESS, help=REGION_HELP)
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser("python -m pytest_gpuiso", formatter_class=raw)
    parser.description, parser.epilog = DESCRIPTION, EXIT_STATUS
    parser.add_argument("--version", action="version", version=f"pytest-gpuiso {VERSION}")
    parser.add_argument("--region", metavar="PATH", default=None, help=REGION_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", parents=[region], help="print the lease table: leases, waiters")
    reset = sub.add_parser(
        "reset", parents=[region], help="clear a lease table nobody holds, or lift a quarantine"
    )
    reset.add_argument(
        "--force",
        action="store_true",
        help="clear it even while live holders exist, or delete a corrupted table; with "
        "--device, lift the quarantine without probing",
    )
    reset.add_argument(
        "--device",
        metavar="GPU",
        help="only lift the quarantine of this GPU (as status names it), once it passes its "
        "health probe",
    )
    _add_merge(sub, raw)
    _add_compare(sub, raw)
    return parser, sub.choices


def _add_merge(sub: Any, raw: type[argparse.HelpFormatter]) -> None:
    """The ``merge`` command: CI shards' JSON reports into one."""
    merge = sub.add_parser(
        "merge", help="merge CI shards' JSON reports", description=MERGE_HELP, formatter_class=raw
    )
    merge.add_argument("reports", nargs="+", metavar="REPORT", help="JSON report of one shard")
    merge.add_argument("--markdown", type=Path, metavar="PATH", help="write the Markdown summary")
    merge.add_argument("--json", type=Path, metavar="PATH", help="write the merged JSON report")
    merge.add_argument(
        "--durations",
        type=Path,
        metavar="PATH",
        help="write (update) pytest-split's durations file from the isolated tests' wall times",
    )


def _add_compare(sub: Any, raw: type[argparse.HelpFormatter]) -> None:
    """The ``compare`` command: what HEAD's report has new against BASE's."""
    compare = sub.add_parser(
        "compare",
        help="what HEAD's JSON report has new against BASE's",
        description=COMPARE_HELP,
        formatter_class=raw,
        usage="%(prog)s [options] BASE HEAD\n       %(prog)s [options] --write-baseline FILE HEAD",
    )
    compare.add_argument("base", nargs="?", metavar="BASE", help="the base branch's JSON report")
    compare.add_argument("head", nargs="?", metavar="HEAD", help="the pull request's JSON report")
    compare.add_argument("--markdown", type=Path, metavar="PATH", help="also write Markdown")
    compare.add_argument(
        "--write-baseline",
        type=Path,
        metavar="FILE",
        help="write HEAD's leaks as a leak baseline (--gpu-isolate-leak-baseline)",
    )
    compare.add_argument(
        "--annotations",
        choices=("auto", "github", "off"),
        default="auto",
        help="what is new as GitHub annotations at the tests' lines: where GITHUB_ACTIONS=true "
        "(auto, the default), always (github) or never (off)",
    )
    compare.add_argument(
        "--code-quality",
        type=Path,
        metavar="PATH",
        help="also write what is new as a GitLab Code Quality report (JSON)",
    )
    compare.add_argument(
        "--startup-growth",
        type=_threshold,
        default=2.0,
        metavar="SECONDS",
        help="a test's start-up longer by more than this is new (default 2)",
    )
    compare.add_argument(
        "--peak-growth",
        type=_threshold,
        default=512.0,
        metavar="MIB",
        help="a test's GPU memory peak higher by more than this is new (default 512)",
    )


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a name no encoding holds: its escape, no crash
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    parser, commands = _parser()
    opts, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's own usage error
        commands[opts.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if opts.command == "compare":
        fail = commands["compare"].error
        if opts.head is None:  # one report: HEAD
            opts.base, opts.head = None, opts.base
        if opts.head is None or (opts.base is None and opts.write_baseline is None):
            fail("give two reports, BASE and HEAD (one only with --write-baseline)")
        if opts.base is None and (opts.markdown or opts.code_quality):
            fail("--markdown and --code-quality need two reports, BASE and HEAD")
    if opts.command == "merge" and opts.markdown is opts.json is opts.durations is None:
        commands["merge"].error("nothing to write: give --markdown, --json or --durations PATH")
    run = {"compare": _compare, "merge": _merge, "status": table.status, "reset": table.reset}
    try:
        return run[opts.command](opts)
    except BrokenPipeError:  # a reader that stopped early (`status | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
