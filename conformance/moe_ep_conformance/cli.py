"""``moe-ep conformance``: the suite from the command line (runs pytest)."""

from __future__ import annotations

import argparse
import os
from typing import Any, List

__all__ = ["add_command", "pytest_args", "run"]


def add_command(subparsers: Any) -> None:
    """Entry point of the group ``moe_ep_spec.commands``: adds ``conformance``."""
    p = subparsers.add_parser(
        "conformance",
        help="run the conformance suite on backends against the reference",
        description="Run the MoeEp conformance suite. With no --backend, every available backend.",
    )
    p.add_argument("--backend", action="append", metavar="NAME", help="backend to test (repeatable)")
    p.add_argument("--ep-size", action="append", type=int, metavar="N", help="only this EP size (repeatable)")
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression over the test ids")
    p.add_argument("--quick", action="store_true", help="the representative subset only")
    p.add_argument("--report-json", metavar="PATH", help="write the JSON report (every case)")
    p.add_argument("--report-md", metavar="PATH", help="write the markdown report (one table per backend)")
    p.add_argument("--xfail-file", action="append", metavar="PATH", help="expected failures file (repeatable)")
    p.add_argument("--tolerance-file", action="append", metavar="PATH", help="tolerance overrides file (repeatable)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS", help="per-case time limit")
    p.add_argument("--device", choices=("cpu", "cuda", "cuda-shared"), default="cpu",
                   help="where process-per-rank backends run their ranks (cuda: rank r on cuda:r; cuda-shared: every "
                        "rank on cuda:0, for backends whose ranks can share one GPU)")
    p.add_argument("--isolate", action="store_true", help="run world backends' cases in their own processes")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("-v", "--verbose", action="count", default=0, help="list every test")
    p.add_argument("--junitxml", metavar="PATH", help="also write JUnit XML")
    # Fuzz mode (fuzz.py): drawn cases instead of the table.
    p.add_argument("--fuzz", type=int, metavar="N", help="draw N random cases (shrinks a failure, prints its command)")
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
    import pytest

    import moe_ep_spec

    from .usage import check_ep_sizes, check_report_path, lookup_backend

    registry = moe_ep_spec.get_registry()
    for name in args.backend or []:
        lookup_backend(registry, name)  # unknown, unavailable or failed to load: `moe-ep: error: ...`, exit 2
    if getattr(args, "fuzz", None) is not None or getattr(args, "fuzz_case", None):
        return _run_fuzz(args)
    # Usage errors before the run, not after it: an EP size the table lacks, a report path that cannot be written.
    check_ep_sizes(args.ep_size, args.quick)
    for option, path in (("--report-json", args.report_json), ("--report-md", args.report_md), ("--junitxml", args.junitxml)):
        check_report_path(option, path)
    argv = pytest_args(args)  # every path made absolute here
    # pytest prints test paths relative to the current directory: from the suite's
    # own directory they read `suite.py::...`, never a site-packages path.
    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    try:
        return int(pytest.main(argv))
    finally:
        os.chdir(cwd)


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
