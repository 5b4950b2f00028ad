"""The pytest plugin that turns the case table into tests.

Load it with ``-p moe_ep_conformance.plugin`` and point pytest at the suite
module (``moe-ep conformance`` does both)::

    pytest -p moe_ep_conformance.plugin --pyargs moe_ep_conformance.suite \\
        -o python_functions="forward forward_stash backward dispatch combine dispatch_backward combine_backward bad_input nan_isolation" \\
        --backend reference --quick

Test ids are ``op[backend-case]``, e.g.
``forward[reference-ep2-k2-e8-out_mxfp8-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-dynamic]``.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Dict, List, Optional

import pytest

import moe_ep_spec

from .cases import Case, all_cases
from .expectations import ExpectationError, Expectations
from .report import Record, Report
from .runner import DEVICES, CaseResult, run_case, run_case_isolated
from .usage import check_ep_sizes, check_report_path, lookup_backend, plugin_failures

__all__ = ["ENV_PREFIXES"]

#: Environment variables shown in the header and recorded in the reports.
ENV_PREFIXES = ("MOE_EP_", "CUDA_VISIBLE_DEVICES", "NCCL_", "XLA_", "JAX_", "TORCH_", "OMP_NUM_THREADS")

_STATE = pytest.StashKey["_State"]()


class _State:
    def __init__(self, config: pytest.Config) -> None:
        opt = config.getoption
        registry = moe_ep_spec.get_registry()
        names = opt("moe_ep_backend") or []
        self.plugin_failures = plugin_failures(registry)
        if names:
            self.backends = [lookup_backend(registry, n) for n in names]  # raises with the registered names
        else:
            self.backends = [b for b in registry.list_backends() if b.is_available()]
        chosen = {b.name for b in self.backends}
        #: (name, reason) of every registered backend left out because it cannot run here.
        self.unavailable = [
            (b.name, b.availability().reason) for b in registry.list_backends() if not names and b.name not in chosen
        ]
        check_ep_sizes(opt("moe_ep_size"), opt("moe_ep_quick"))
        for option, dest in (("--report-json", "moe_ep_report_json"), ("--report-md", "moe_ep_report_md")):
            check_report_path(option, opt(dest))
        self.cases = all_cases(quick=opt("moe_ep_quick"), num_ranks=opt("moe_ep_size") or None)
        self.expectations = Expectations.load(opt("moe_ep_xfail_file") or (), opt("moe_ep_tolerance_file") or ())
        self.timeout_s: float = opt("moe_ep_timeout")
        self.isolate: bool = opt("moe_ep_isolate")
        self.device: str = opt("moe_ep_device")
        self.report_json: Optional[str] = opt("moe_ep_report_json")
        self.report_md: Optional[str] = opt("moe_ep_report_md")
        self.results: Dict[str, CaseResult] = {}
        self.xfail_reasons: Dict[str, str] = {}
        self.report = Report(environment=_environment(), plugin_failures=list(self.plugin_failures))
        for b in self.backends:
            self.report.backends[b.name] = {
                "version": b.version,
                "distribution": b.distribution,
                "launch": b.capabilities.launch.value,
                "devices": list(b.capabilities.devices),
                "capabilities": b.capabilities.as_dict(),
                "framework_versions": _framework_versions(b),
            }


def _framework_versions(backend: moe_ep_spec.MoeEpBackend) -> Dict[str, str]:
    try:
        return {str(k): str(v) for k, v in backend.framework_versions().items()}
    except Exception as exc:  # noqa: BLE001 - a report header must not crash the run
        return {"error": f"{type(exc).__name__}: {exc}"}


def _environment() -> Dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("moe-ep", "MoeEp conformance")
    group.addoption("--backend", dest="moe_ep_backend", action="append", metavar="NAME",
                    help="backend to test (repeatable; default: every available backend)")
    group.addoption("--ep-size", dest="moe_ep_size", action="append", type=int, metavar="N",
                    help="only cases with this EP size (repeatable)")
    group.addoption("--quick", dest="moe_ep_quick", action="store_true", help="the representative subset only")
    group.addoption("--report-json", dest="moe_ep_report_json", metavar="PATH", help="write the JSON report here")
    group.addoption("--report-md", dest="moe_ep_report_md", metavar="PATH", help="write the markdown report here")
    group.addoption("--xfail-file", dest="moe_ep_xfail_file", action="append", metavar="PATH",
                    help="expected failures: one test-id pattern per line (repeatable)")
    group.addoption("--tolerance-file", dest="moe_ep_tolerance_file", action="append", metavar="PATH",
                    help="tolerance overrides: 'PATTERN FACTOR' per line (repeatable)")
    group.addoption("--case-timeout", dest="moe_ep_timeout", type=float, default=120.0, metavar="SECONDS",
                    help="a case that takes longer fails (process-per-rank backends, or with --isolate)")
    group.addoption("--device", dest="moe_ep_device", choices=DEVICES, default="cpu",
                    help="where process-per-rank backends run their ranks (cuda: rank r on cuda:r; cuda-shared: "
                         "every rank on cuda:0, for backends whose ranks can share one GPU)")
    group.addoption("--isolate", dest="moe_ep_isolate", action="store_true",
                    help="run every case of a world backend in its own process (hangs and crashes fail the case)")


def pytest_configure(config: pytest.Config) -> None:
    try:
        config.stash[_STATE] = _State(config)
    except (moe_ep_spec.MoeEpError, ExpectationError) as exc:  # a usage error, not a crash
        raise pytest.UsageError(str(exc)) from None


def _header(config: pytest.Config) -> List[str]:
    state = config.stash[_STATE]
    lines = [
        f"moe-ep-spec {moe_ep_spec.__version__}; python {platform.python_version()}; "
        f"cases per backend: {len(state.cases)}; process-per-rank device: {state.device}",
    ]
    for b in state.backends:
        fw = ", ".join(f"{k} {v}" for k, v in _framework_versions(b).items())
        lines.append(
            f"backend {b.name} {b.version} ({b.distribution or 'in-process'}): launch {b.capabilities.launch.value}, "
            f"devices {','.join(b.capabilities.devices)}; {fw}"
        )
    for name, reason in state.unavailable:
        lines.append(f"backend {name}: not run, unavailable here: {reason}")
    for text in state.plugin_failures:
        lines.append(f"backend plugin FAILED to load, not run: {text}")
    if not state.backends:
        lines.append("no available backend: nothing to test")
    env = state.report.environment
    lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in env.items()) or "(no MOE_EP_/CUDA/NCCL/XLA/JAX variables set)"))
    return lines


@pytest.hookimpl(wrapper=True)
def pytest_report_header(config: pytest.Config) -> Any:
    """The suite's header (what was tested), without pytest's rootdir/configfile
    lines: they name the suite's install directory (site-packages), which says
    nothing about the run."""
    lines = yield
    drop = ("rootdir:", "configfile:", "testpaths:")
    out: List[Any] = [_header(config)]
    for item in lines:
        if isinstance(item, str):
            item = [item]
        out.append([line for line in item if not line.startswith(drop)])
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "moe_ep_case" not in metafunc.fixturenames:
        return
    state = metafunc.config.stash[_STATE]
    op = metafunc.function.__name__
    params, ids = [], []
    for b in state.backends:
        for c in state.cases:
            if c.op == op:
                params.append((b, c))
                ids.append(f"{b.name}-{c.id}")
    metafunc.parametrize("moe_ep_case", params, ids=ids)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    state = config.stash[_STATE]
    # An operation without a case here (e.g. none at this --ep-size) is not a test: pytest
    # would otherwise report it as a skip ("got empty parameter set").
    def has_case(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        return callspec is None or isinstance(callspec.params.get("moe_ep_case"), tuple)

    empty = [item for item in items if not has_case(item)]
    if empty:
        items[:] = [item for item in items if has_case(item)]
        config.hook.pytest_deselected(items=empty)
    for item in items:
        state.expectations.factor_for(item.name)  # an entry matching a collected test is not stale
        entry = state.expectations.xfail_for(item.name)
        if entry is not None:
            state.xfail_reasons[item.name] = entry.reason
            item.add_marker(pytest.mark.xfail(reason=f"{entry.reason} ({entry.source})", strict=True))


def run(request: pytest.FixtureRequest, backend: moe_ep_spec.MoeEpBackend, case: Case) -> None:
    """Body of every suite test: run the case, record it, pass/skip/fail."""
    state = request.config.stash[_STATE]
    test_id = case.test_id(backend.name)
    factor = state.expectations.factor_for(test_id)
    # Process-per-rank backends already run in their own processes (with deadlines).
    isolate = state.isolate and backend.capabilities.launch is moe_ep_spec.Launch.WORLD
    runner = run_case_isolated if isolate else run_case
    result = runner(backend, case, timeout_s=state.timeout_s, tolerance_factor=factor, device=state.device)
    state.results[request.node.nodeid] = result
    if result.outcome == "skipped":
        pytest.skip(result.reason)
    if result.outcome == "failed":
        pytest.fail(result.describe(), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    outcome = yield
    rep = outcome.get_result()
    state = item.config.stash[_STATE]
    result = state.results.get(item.nodeid)
    if result is None or rep.when != "call" and not (rep.when == "setup" and rep.skipped):
        return
    if hasattr(rep, "wasxfail"):
        final = "xfailed" if rep.skipped else "xpassed"
    else:
        final = rep.outcome
    if final == "failed" and result.outcome == "passed":  # e.g. strict xpass
        final = "xpassed"
    if final == "xpassed" and not result.reason:
        result.reason = f"passed, but an expected-failure entry names it: {state.xfail_reasons.get(item.name, '')}"
    state.report.records.append(Record(result, final, state.xfail_reasons.get(item.name, "")))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash[_STATE]
    report = state.report
    report.stale = state.expectations.stale()
    tr = terminalreporter
    if state.backends or state.plugin_failures:
        tr.section("MoeEp conformance summary")
        for b in state.backends:
            tr.write_line(report.summary_line(b.name, b.version))
            for reason, n, first in report.skip_reasons(b.name):
                tr.write_line(f"  skipped {n} case(s): {reason} (e.g. {first})")
        for text in state.plugin_failures:
            tr.write_line(f"backend plugin FAILED to load, not run: {text}", red=True)
    for e in report.stale:
        tr.write_line(f"STALE expectation {e.pattern!r} ({e.source}) matched no test", yellow=True)
    for option, path, write in (
        ("--report-json", state.report_json, report.write_json),
        ("--report-md", state.report_md, report.write_markdown),
    ):
        if not path:
            continue
        try:
            write(path)
        except OSError as exc:  # checked before the run; a disk that filled up since must not hide the summary
            tr.write_line(f"{option} {path}: could not write the report: {exc}", red=True)
        else:
            tr.write_line(f"{'JSON' if option == '--report-json' else 'markdown'} report: {path}")

