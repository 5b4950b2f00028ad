"""``moe-ep conformance``: the suite from the command line (runs pytest)."""

from __future__ import annotations

import argparse
import os
from typing import Any, List

from moe_ep_spec.cli import positive_float, positive_int

__all__ = ["add_command", "pytest_args", "run"]


def add_command(subparsers: Any) -> None:
    """Entry point of the group ``moe_ep_spec.commands``: adds ``conformance``."""
    p = subparsers.add_parser(
        "conformance",
        help="run the conformance suite on backends against the reference",
        description="Run the MoeEp conformance suite. With no --backend, every available backend.",
        epilog="Exit status: 0 every case passed (or was skipped or expected to fail), 1 a case failed, 2 a usage "
        "mistake (a bad option, a backend that cannot run here, a missing file, a -k that selects no case), "
        "3 an internal error, 130 interrupted.",
    )
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="backend to test (repeatable; default: every registered backend whose availability() is "
                        "true). An unknown or unavailable name, or one whose plugin failed to import, stops before "
                        "any test with the registered names, the reason or the import error (exit 2)")
    p.add_argument("--ep-size", action="append", type=positive_int, metavar="N",
                   help="only this EP size (repeatable; the quick and the full table have EP sizes 1 to 4)")
    p.add_argument("-k", dest="keyword", metavar="EXPR",
                   help="pytest -k expression over the test ids (substrings joined with and, or, not, parentheses, "
                        "e.g. 'dispatch and ep2', 'out_nvfp4 and not bad_input', or a whole test id); one that "
                        "selects no case is a usage error (exit 2)")
    p.add_argument("--quick", action="store_true",
                   help="the representative subset only: a covering array of the kernel-relevant axes at realistic "
                        "sizes, and every operation")
    p.add_argument("--coverage", action="store_true",
                   help="print which pairs of axis values the selected table (--quick, --ep-size) covers, which "
                        "cannot be built and why, and which are missing; run nothing")
    p.add_argument("--report-json", metavar="PATH",
                   help="write the JSON report (every case); relative paths are from the current directory, and a "
                        "path that cannot be written stops before any test (exit 2), as for --report-md")
    p.add_argument("--report-md", metavar="PATH", help="write the markdown report (one table per backend)")
    p.add_argument("--xfail-file", action="append", metavar="PATH",
                   help="expected failures file, one test-id pattern a line (repeatable)")
    p.add_argument("--tolerance-file", action="append", metavar="PATH",
                   help="tolerance overrides file, 'PATTERN FACTOR' a line (repeatable)")
    p.add_argument("--timeout", type=positive_float, default=120.0, metavar="SECONDS",
                   help="seconds one call of a process-per-rank backend may take before its rank processes are "
                        "stopped; with --isolate, also each case's limit (default 120)")
    p.add_argument("--device", choices=("cpu", "cuda", "cuda-shared"), default="cpu",
                   help="where process-per-rank backends run their ranks (cuda: rank r on cuda:r; cuda-shared: every "
                        "rank on cuda:0, for backends whose ranks can share one GPU, such as cuda-nccl with "
                        "MOE_EP_CUDA_NCCL_EXCHANGE=device: NCCL refuses two ranks on one GPU); world backends "
                        "ignore it")
    p.add_argument("--isolate", action="store_true",
                   help="run world backends' cases in their own processes, so that one that hangs or crashes "
                        "fails its case instead of stopping the run")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("-v", "--verbose", action="count", default=0, help="list every test with its outcome (-vv: more)")
    p.add_argument("--junitxml", metavar="PATH", help="also write JUnit XML (test names are the suite's test ids)")
    # Fuzz mode (fuzz.py): drawn cases instead of the table.
    p.add_argument("--fuzz", type=int, metavar="N",
                   help="instead of the table, draw N random cases over the space the spec allows (a failure is "
                        "shrunk and printed with the command that reproduces it; the same seed draws the same cases)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the fuzz seed (default 0)")
    p.add_argument("--fuzz-case", metavar="JSON", help="run exactly this fuzz case (as a fuzz failure prints it)")
    p.set_defaults(func=run)


def pytest_args(args: argparse.Namespace) -> List[str]:
    """The pytest command line for ``args``."""
    from .cases import OPERATIONS

    here = os.path.dirname(os.path.abspath(__file__))
    out = [
        os.path.join(here, "suite.py"),
        "-p", "moe_ep_conformance.plugin",
        "-p", "no:cacheprovider",
        "--rootdir", here,
        "-c", os.path.join(here, "pytest.ini"),
        "-o", "python_functions=" + " ".join(OPERATIONS),
        "-rfE",
    ]
    for name in args.backend or []:
        out += ["--backend", name]
    for n in args.ep_size or []:
        out += ["--ep-size", str(n)]
    if args.keyword:
        out += ["-k", args.keyword]
    if args.quick:
        out.append("--quick")
    for flag, value in (("--report-json", args.report_json), ("--report-md", args.report_md), ("--junitxml", args.junitxml)):
        if value:
            out += [flag, os.path.abspath(value)]
    for f in args.xfail_file or []:
        out += ["--xfail-file", os.path.abspath(f)]
    for f in args.tolerance_file or []:
        out += ["--tolerance-file", os.path.abspath(f)]
    out += ["--case-timeout", str(args.timeout), "--device", args.device]
    if args.isolate:
        out.append("--isolate")
    if args.exitfirst:
        out.append("-x")
    if args.verbose:
        out.append("-" + "v" * args.verbose)
    return out


def run(args: argparse.Namespace) -> int:
    import moe_ep_spec
    from moe_ep_spec.cli import check_input_file, require_backend

    from .expectations import ExpectationError, Expectations
    from .usage import check_ep_sizes, check_report_path, lookup_backend

    registry = moe_ep_spec.get_registry()
    for name in args.backend or []:
        # Unknown, unavailable or failed to load: `moe-ep: error: ...`, exit 2, before any import of
        # the suite or the backend's framework when what is installed already says no.
        try:
            require_backend(name)
        except moe_ep_spec.BackendNotFoundError:
            lookup_backend(registry, name)  # names a plugin that failed to load, else raises the same error
            raise
    # Usage errors before the run, not after it: a file that is not there, an EP size the table lacks,
    # a report path that cannot be written.
    for option, paths in (("--xfail-file", args.xfail_file), ("--tolerance-file", args.tolerance_file)):
        for path in paths or []:
            check_input_file(option, path)
    try:
        Expectations.load(args.xfail_file or (), args.tolerance_file or ())
    except ExpectationError as exc:
        raise moe_ep_spec.MoeEpError(str(exc)) from None
    if getattr(args, "fuzz", None) is not None or getattr(args, "fuzz_case", None):
        return _run_fuzz(args)
    check_ep_sizes(args.ep_size, args.quick)
    if getattr(args, "coverage", False):
        return _print_coverage(args)
    for option, path in (("--report-json", args.report_json), ("--report-md", args.report_md), ("--junitxml", args.junitxml)):
        check_report_path(option, path)
    import pytest

    argv = pytest_args(args)  # every path made absolute here
    # pytest prints test paths relative to the current directory: from the suite's
    # own directory they read `suite.py::...`, never a site-packages path.
    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    try:
        code = int(pytest.main(argv))
    finally:
        os.chdir(cwd)
    return _exit_status(code, args)


def _exit_status(code: int, args: argparse.Namespace) -> int:
    """pytest's exit status in moe-ep's terms (``moe_ep_spec.cli.EXIT_CODES``):
    0 and 1 as pytest's; a run of no case (pytest's 5) and a pytest usage error (4)
    are usage mistakes, 2 with a sentence; pytest's "interrupted" (2) is 130."""
    import sys

    if code == 5:
        what = f"-k {args.keyword!r} selects" if args.keyword else "the options select"
        table = "quick" if args.quick else "full"
        print(
            f"moe-ep: error: {what} no case of the {table} table "
            f"(backends: {', '.join(args.backend) if args.backend else 'every available one'}); "
            "-k matches words of the test ids, e.g. `-k mxfp8`, `-k 'forward and ep2'`, `-k torch`; "
            "`-v` lists the ids a run selects",
            file=sys.stderr,
        )
        return 2
    if code == 4:
        return 2  # pytest printed the reason
    if code == 2:
        return 130
    return code


def _print_coverage(args: argparse.Namespace) -> int:
    """``--coverage``: the pairs of axis values of the selected table (axes.py); 0."""
    from .axes import coverage, format_coverage
    from .cases import all_cases

    cases = all_cases(quick=args.quick, num_ranks=args.ep_size or None)
    table = "the --quick table" if args.quick else "the full table"
    sizes = f", EP sizes {sorted(set(args.ep_size))}" if args.ep_size else ""
    print(f"coverage of {table}{sizes}: {len(cases)} cases; per operation, every pair of values of two of its axes")
    whole = all_cases(quick=args.quick) if args.ep_size else None
    report = coverage(cases, quick=args.quick, num_ranks=args.ep_size or None, whole=whole)
    print(format_coverage(report, verbose=args.verbose > 0))
    return 0


def _run_fuzz(args: argparse.Namespace) -> int:
    """``--fuzz N --seed S`` or ``--fuzz-case JSON``: 1 when a backend fails."""
    import moe_ep_spec

    from .fuzz import case_from_json, fuzz, reproduce_command
    from .runner import run_case

    registry = moe_ep_spec.get_registry()
    names = args.backend or [b.name for b in registry.list_backends() if b.is_available() and b.name != "reference"]
    backends = [registry.get_backend(n) for n in names] or [registry.get_backend("reference")]
    if args.fuzz_case:
        case = case_from_json(args.fuzz_case)
        failed = 0
        for b in backends:
            result = run_case(b, case, timeout_s=args.timeout, device=args.device)
            print(result.describe() if result.outcome != "passed" else f"{result.test_id}: passed")
            if result.outcome == "failed":
                failed = 1
                print(f"reproduce: {reproduce_command(b.name, case)}")
        return failed
    return 1 if fuzz(backends, args.fuzz, args.seed, timeout_s=args.timeout, device=args.device) else 0
