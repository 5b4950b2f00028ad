"""``moe-ep bench``: every backend side by side, against the baselines of the
same run (``all_to_all``, ``copy``, ``grouped_gemm``, ``weight_read``); a
table, JSON and PNG plots.

Added to the ``moe-ep`` command through the entry-point group
``moe_ep_spec.commands`` (:func:`add_command`); ``python -m moe_ep_bench`` runs
the same command on its own (:func:`main`). Imports no torch and no jax: the
torch driver imports torch in the rank processes it spawns, the jax driver
imports jax when it runs (and a backend's availability check may).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import sys
import textwrap
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from . import __version__
from .model import DEFAULT_FORMATS, FORMATS, OPS, BenchSettings, auto_experts, combine_bytes, defaults, dispatch_bytes, gemm_flops, make_routing
from .progress import PROGRESS_MODES, make_progress
from .results import TABLE_WIDTH, Row, add_ratios, dumps, finish, format_table, report

__all__ = ["add_command", "build_parser", "main", "run", "settings_from_args"]


def _positive(text: str) -> int:
    from moe_ep_spec.cli import positive_int

    return positive_int(text)


def _non_negative(text: str) -> int:
    from moe_ep_spec.cli import non_negative_int

    return non_negative_int(text)


def _positive_number(text: str) -> float:
    from moe_ep_spec.cli import positive_float

    return positive_float(text)


def _tolerance(text: str) -> float:
    from moe_ep_spec.cli import non_negative_float

    return non_negative_float(text)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="backend to time (repeatable; default: every available backend with a bench driver)")
    p.add_argument("--ep-size", type=_positive, default=None, metavar="N",
                   help="EP size: ranks (default 2 on cpu, 1 on cuda; cuda needs N GPUs, rank r on cuda:r)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where process-per-rank backends and the baselines run (cuda: rank r on cuda:r)")
    p.add_argument("--tokens", action="append", type=_positive, metavar="N",
                   help="tokens per rank (repeatable; default 128 and 4096 on cuda, 32, 128 and 512 on cpu)")
    p.add_argument("--hidden", type=_positive, default=None, help="hidden H (default 7168 on cuda, 512 on cpu)")
    p.add_argument("--intermediate", type=_positive, default=None, help="intermediate I (default 2048 on cuda, 256 on cpu)")
    p.add_argument("--experts", type=_positive, default=None,
                   help="experts E (default on cuda: 256, or as many as fit --memory-budget-gb at this EP size; 16 on cpu)")
    p.add_argument("--topk", type=_positive, default=None, help="top-k K (default 8 on cuda, 4 on cpu)")
    p.add_argument("--format", action="append", choices=FORMATS, metavar="FMT",
                   help="bf16, mxfp8 or nvfp4 (repeatable; default bf16 and mxfp8)")
    p.add_argument("--intermediate-format", choices=("none", "bf16", "mxfp8", "nvfp4"), default="none",
                   help="the layers' intermediate_format, the rounding of the FC2 operand (default none: exact "
                        "float32, which fast kernels feed to bf16 tensor cores as three bf16 pieces)")
    p.add_argument("--op", action="append", choices=OPS, metavar="OP",
                   help="dispatch, combine, forward, forward_backward (repeatable; default all)")
    p.add_argument("--repeats", type=_positive, default=None, help="timed calls per measurement (default 20 cuda, 5 cpu)")
    p.add_argument("--warmup", type=_non_negative, default=None, help="untimed calls first (default 3 cuda, 1 cpu)")
    p.add_argument("--input-sets", type=_positive, default=None,
                   help="random input sets used in turn (default 4 cuda, 2 cpu)")
    p.add_argument("--seed", type=int, default=0, help="random seed of routing and inputs (default 0)")
    p.add_argument("--backward-operand-format", choices=("none", "bf16"), default="none",
                   help="the layers' backward_operand_format, the operands of the backward's GEMMs (default none: "
                        "exact; bf16: the cotangent, dc and w*h rounded to bf16 as training stacks do); the "
                        "forward_backward rows say which they ran")
    p.add_argument("--json", metavar="PATH",
                   help="write the JSON report here (its directory must exist; checked before the run)")
    p.add_argument("--plot-dir", metavar="DIR",
                   help="write PNG plots here (created if missing; needs matplotlib, checked before the run)")
    p.add_argument("--compare", metavar="BASELINE", help="after the run, compare every row's time with this baseline "
                   "(a bench JSON report, or a file of bench/baselines/); exit 1 when a backend row is slower by "
                   "more than --tolerance")
    p.add_argument("--tolerance", type=_tolerance, default=0.10, metavar="FRACTION",
                   help="with --compare: how much slower than its baseline a row may be (default 0.10: 10 %%)")
    p.add_argument("--wide", action="store_true",
                   help="one wide table: the min-max range, both rates, every ratio, notes (default: one table per "
                        "op, within 100 columns)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes for smoke tests: H=64 I=32 E=8 K=2, tokens 8 and 32, 3 repeats")
    p.add_argument("--timeout", type=_positive_number, default=300.0, metavar="SECONDS",
                   help="seconds one measurement may take before every rank is stopped (default 300)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the baselines (all_to_all, copy, grouped_gemm, weight_read)")
    p.add_argument("--include-slow", action="store_true", help="time world backends (numpy) at any size")
    p.add_argument("--memory-budget-gb", type=_positive_number, default=80.0, metavar="GB",
                   help="per-GPU memory the default expert count may use (default 80)")
    p.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                   help="progress on stderr: auto (a bar when stdout and stderr are terminals, else quiet; default), "
                        "bar, lines (one per measurement), quiet (a line every 30 s), none")
    p.add_argument("--no-progress", action="store_const", const="none", dest="progress", help="--progress none")
    p.add_argument("--cuda-nccl-mode", choices=("synced", "static", "device"), default=None,
                   help="how the cuda-nccl layer runs: synced (host_sync=True, one host synchronisation per call), "
                        "static (host_sync=False over NCCL) or device (host_sync=False over the native layer's device "
                        "exchange); default device on cuda, synced on cpu")
    p.add_argument("--exchange-mode", choices=("throughput", "low_latency"), default="throughput",
                   help="how the device exchange's stages run on CUDA (--cuda-nccl-mode device): throughput (five "
                        "kernels per stage chained with programmatic dependent launch; default) or low_latency (one "
                        "cooperative kernel per stage); the same results bit for bit")


def add_command(subparsers: Any) -> None:
    """Entry point of the group ``moe_ep_spec.commands``: adds ``bench``."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark backends: dispatch, combine, fused forward and forward+backward against baselines",
        description=(
            "Time dispatch, combine and the fused layer (forward, forward+backward) on every backend, with the "
            "baselines of the same run: all_to_all (all_to_all_single moving the same bytes, over NCCL or gloo), "
            "copy (the copy ceiling of those bytes), grouped_gemm (the expert GEMMs alone on the same rows: the "
            "compute roofline) and weight_read (the local experts' weights read once at the device copy "
            "bandwidth: the memory roofline at decode sizes). Prints a table (median and min-max over the "
            "repeats); --json and --plot-dir write the report and PNG plots; --compare checks the times against "
            "a baseline. See docs/benchmarks.md."
        ),
        epilog="Exit status: 0 every measurement ran (or was skipped, with the reason printed), 1 a measurement "
        "failed or (--compare) a row is slower than its baseline, 2 a usage mistake (a bad option, a backend that "
        "cannot run here or has no bench driver, output that cannot be made), 3 an internal error.",
    )
    _add_arguments(p)
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    """``python -m moe_ep_bench``: the bench command alone."""
    from moe_ep_spec.cli import Parser

    p = Parser(prog="moe-ep bench", description="Benchmark MoeEp backends (see docs/benchmarks.md).")
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """The run's settings: the options given, the device's defaults for the rest."""
    device = args.device
    d = defaults(device, args.quick)
    ep = args.ep_size or (1 if device == "cuda" else 2)
    hidden = args.hidden or int(d["hidden"])  # type: ignore[arg-type]
    inter = args.intermediate or int(d["intermediate"])  # type: ignore[arg-type]
    topk = args.topk or int(d["topk"])  # type: ignore[arg-type]
    if args.experts:
        experts = args.experts
    elif d["experts"] is None:
        experts = auto_experts(ep, hidden, inter, topk, args.memory_budget_gb)
    else:
        experts = -(-max(int(d["experts"]), topk) // ep) * ep  # type: ignore[arg-type]
    tokens = tuple(dict.fromkeys(args.tokens)) if args.tokens else tuple(d["tokens"])  # type: ignore[arg-type]
    formats = tuple(dict.fromkeys(args.format)) if args.format else DEFAULT_FORMATS
    ops = tuple(op for op in OPS if op in args.op) if args.op else OPS
    settings = BenchSettings(
        device=device,
        ep_size=ep,
        hidden=hidden,
        intermediate=inter,
        experts=experts,
        topk=topk,
        tokens=tuple(sorted(tokens)),
        formats=formats,
        ops=ops,
        repeats=args.repeats or int(d["repeats"]),  # type: ignore[arg-type]
        warmup=int(d["warmup"]) if args.warmup is None else args.warmup,  # type: ignore[arg-type]
        input_sets=args.input_sets or int(d["input_sets"]),  # type: ignore[arg-type]
        seed=args.seed,
        timeout_s=args.timeout,
        baselines=not args.no_baselines,
        include_slow=args.include_slow,
        intermediate_format=None if args.intermediate_format == "none" else args.intermediate_format,
        backward_operand_format=None if args.backward_operand_format == "none" else args.backward_operand_format,
        cuda_nccl_mode=args.cuda_nccl_mode or ("device" if device == "cuda" else "synced"),
        exchange_mode=args.exchange_mode,
    )
    for fmt in formats:
        settings.config(fmt, max(tokens))  # raises ConfigError on a bad shape
    return settings


def _command(settings: BenchSettings, backends: Sequence[str]) -> str:
    """The command line that repeats this run."""
    parts = ["moe-ep", "bench", "--device", settings.device, "--ep-size", str(settings.ep_size)]
    for b in backends:
        parts += ["--backend", b]
    for t in settings.tokens:
        parts += ["--tokens", str(t)]
    parts += ["--hidden", str(settings.hidden), "--intermediate", str(settings.intermediate),
              "--experts", str(settings.experts), "--topk", str(settings.topk)]
    for f in settings.formats:
        parts += ["--format", f]
    if settings.intermediate_format is not None:
        parts += ["--intermediate-format", settings.intermediate_format]
    if settings.backward_operand_format is not None:
        parts += ["--backward-operand-format", settings.backward_operand_format]
    if "cuda-nccl" in backends:
        parts += ["--cuda-nccl-mode", settings.cuda_nccl_mode]
        if settings.cuda_nccl_mode == "device":
            parts += ["--exchange-mode", settings.exchange_mode]
    if settings.ops != OPS:
        for op in settings.ops:
            parts += ["--op", op]
    parts += ["--repeats", str(settings.repeats), "--warmup", str(settings.warmup),
              "--input-sets", str(settings.input_sets), "--seed", str(settings.seed)]
    if not settings.baselines:
        parts.append("--no-baselines")
    if settings.include_slow:
        parts.append("--include-slow")
    return shlex.join(parts)


def _attach_counts(rows: List[Row], settings: BenchSettings, routings: Dict[int, Any]) -> None:
    """Bytes and operations of every row (the same for every backend and baseline of a case)."""
    for row in rows:
        routing = routings.get(row.tokens)
        if routing is None:
            continue
        if row.op == "dispatch":
            row.bytes, row.bytes_remote = dispatch_bytes(settings, routing, row.format)
        elif row.op == "combine":
            row.bytes, row.bytes_remote = combine_bytes(settings, routing, row.format)
        elif row.backend == "weight_read":
            continue  # its bytes are the weights' (set by its driver)
        else:
            if row.backend != "grouped_gemm":
                d, dr = dispatch_bytes(settings, routing, row.format)
                c, cr = combine_bytes(settings, routing, row.format)
                row.bytes, row.bytes_remote = d + c, dr + cr
            row.flops = gemm_flops(settings, routing, backward=row.op == "forward_backward")
        finish(row)


def _environment(backends: Sequence[Any]) -> Dict[str, Any]:
    import moe_ep_spec

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "moe_ep_spec": moe_ep_spec.__version__,
        "moe_ep_bench": __version__,
        "backends": {b.name: b.version for b in backends},
        "cpu_count": os.cpu_count(),
    }


def _unavailable(backend: Any) -> Optional[str]:
    """Why ``backend`` cannot run here, or None. The torch backend is checked
    without importing torch here (its rank processes call the backend's own
    availability check before any job); every other backend is asked, its quick
    check (what is installed) first."""
    from moe_ep_spec.cli import unavailable_reason

    if backend.name == "torch":
        return None if importlib.util.find_spec("torch") is not None else "torch is not installed (pip install torch)"
    return unavailable_reason(backend)


def run(args: argparse.Namespace) -> int:
    from moe_ep_spec.cli import check_input_file, check_output_file
    from moe_ep_spec.errors import BackendUnavailableError, MoeEpError
    from moe_ep_spec.registry import get_registry

    from .drivers import driver_for
    from .drivers.torch_driver import make_jobs, rows_from_results, run_jobs, unsupported
    from .drivers.world import run_world, world_cases

    settings = settings_from_args(args)
    if settings.device == "cuda":
        # jax (imported here by the jax backends' availability checks and the jax
        # driver) must not take most of the GPU memory the torch driver's ranks need.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    elif settings.ep_size > 8:
        # the jax backends ask XLA for this many CPU devices (default 8) when they first import jax
        os.environ.setdefault("MOE_EP_JAX_CPU_DEVICES", str(settings.ep_size))
    registry = get_registry()
    left_out: List[str] = []
    if args.backend:
        backends = [registry.get_backend(name, require_available=False) for name in dict.fromkeys(args.backend)]
        for b in backends:  # unknown: BackendNotFoundError above; unavailable or no driver: here; all exit 2
            reason = _unavailable(b)
            if reason is not None:
                raise BackendUnavailableError(b.name, reason)
            if driver_for(b.name) is None:
                raise MoeEpError(
                    f"--backend {b.name}: the bench has no driver for this backend (launch model "
                    f"{b.capabilities.launch.value}); a plugin adds one through the entry-point group "
                    f"moe_ep_bench.drivers (docs/backends.md, Benchmarks)"
                )
    else:
        backends = []
        for b in registry.list_backends():
            reason = _unavailable(b)
            if reason is not None:
                left_out.append(f"{b.name} (not available here: {reason})")
            elif driver_for(b.name) is None:
                left_out.append(f"{b.name} (no bench driver)")
            else:
                backends.append(b)
    # Output asked for that cannot be made: refused now, not after the run.
    if args.plot_dir and importlib.util.find_spec("matplotlib") is None:
        raise MoeEpError(f"--plot-dir {args.plot_dir}: the plots need matplotlib, which is not installed "
                         "(pip install matplotlib, or moe-ep-bench[plot])")
    check_output_file("--json", args.json)
    baseline_entries = None
    if args.compare:
        from .compare import load

        check_input_file("--compare", args.compare)
        try:
            baseline_entries = load(args.compare)
        except (ValueError, KeyError) as exc:
            raise MoeEpError(f"--compare {args.compare}: cannot read it as a bench report or baseline: {exc}") from None
    drivers = {b.name: driver_for(b.name) for b in backends}
    rows: List[Row] = []
    skipped_notes: List[str] = []
    if left_out:
        skipped_notes.append("left out of this run (every available backend with a bench driver runs by default): "
                             + "; ".join(left_out))

    torch_installed = importlib.util.find_spec("torch") is not None
    in_ranks = [b.name for b in backends if drivers[b.name] == "torch"]
    baselines = settings.baselines and torch_installed
    if settings.baselines and not torch_installed:
        skipped_notes.append("baselines skipped: torch is not installed (pip install torch, or moe-ep-bench[torch])")

    routings = {t: make_routing(settings, t) for t in settings.tokens}
    jobs = make_jobs(settings, in_ranks, baselines)
    world_rows: Dict[str, List[Row]] = {}
    jax_rows: Dict[str, List[Row]] = {}
    for b in backends:
        if drivers[b.name] == "world":
            world_rows[b.name] = world_cases(b, settings)
        elif drivers[b.name] == "jax":
            from .drivers.jax_driver import jax_cases

            jax_rows[b.name] = jax_cases(b, settings)
    later = list(world_rows.values()) + list(jax_rows.values())
    total = len(jobs) + sum(1 for rs in later for r in rs if r.status == "ok")
    header = (
        f"moe-ep bench: device={settings.device} ep_size={settings.ep_size} hidden={settings.hidden} "
        f"intermediate={settings.intermediate} experts={settings.experts} (local {settings.num_local_experts}) "
        f"topk={settings.topk} tokens={','.join(map(str, settings.tokens))} formats={','.join(settings.formats)} "
        f"repeats={settings.repeats} warmup={settings.warmup} input_sets={settings.input_sets}"
    )
    env = _environment(backends)
    progress = make_progress(total, args.progress)
    try:
        if jobs:
            results, torch_env = run_jobs(settings, routings, jobs, progress)
            env.update(torch_env)
            labels = {name: f"{name} in its rank processes" for name in in_ranks}
            rows += rows_from_results(settings, jobs, results, labels)
        for name in in_ranks:
            for fmt in settings.formats:
                for t in settings.tokens:
                    for op in settings.ops:
                        why = unsupported(name, op, fmt, settings)
                        if why is not None:
                            status = "skipped" if why.startswith("skipped") else "unsupported"
                            rows.append(Row(backend=name, kind="backend", op=op, tokens=t, format=fmt,
                                            ep_size=settings.ep_size, device=settings.device,
                                            status=status, reason=why))
        for b in backends:
            kind = drivers[b.name]
            if kind == "world":
                run_world(b, settings, routings, world_rows[b.name], progress)
                rows += world_rows[b.name]
            elif kind == "jax":
                from .drivers.jax_driver import run_jax

                env.update(run_jax(b, settings, routings, jax_rows[b.name], progress))
                rows += jax_rows[b.name]
            elif callable(kind):
                rows += list(kind(b, settings, routings, progress))
    finally:
        progress.close()

    # The GEMM roofline is measured once in bf16 and stands for every format.
    gemm = [r for r in rows if r.backend == "grouped_gemm" and r.kind == "baseline"]
    rows = [r for r in rows if not (r.backend == "grouped_gemm" and r.kind == "baseline")]
    for r in gemm:
        for fmt in settings.formats:
            copy = Row(**{**r.as_dict(), "format": fmt})
            if fmt != "bf16":
                copy.label = (copy.label + "; " if copy.label else "") + "bf16 GEMM rate"
            rows.append(copy)
    mode = settings.backward_operand_format or "none"
    for r in rows:
        if r.op == "forward_backward" and r.kind == "backend":
            r.backward_operand_format = mode
    _attach_counts(rows, settings, routings)
    add_ratios(rows)

    names = [b.name for b in backends] if args.backend else []
    if not args.wide:
        header = textwrap.fill(header, width=TABLE_WIDTH, subsequent_indent="  ")
    print(format_table(rows, header, wide=args.wide))
    for note in skipped_notes:
        print(note if args.wide else textwrap.fill(note, width=TABLE_WIDTH, subsequent_indent="  ",
                                                   break_on_hyphens=False))
    if "gpus" in env:
        gpus = env["gpus"]
        print(f"torch {env.get('torch')} cuda {env.get('cuda')} nccl {env.get('nccl')}; "
              + ", ".join(f"cuda:{g['index']} {g['name']}" for g in gpus))
    elif "torch" in env:
        print(f"torch {env['torch']} on {env.get('cpu', 'cpu')}, {env.get('torch_threads')} threads per rank")
    plots: List[str] = []
    if args.plot_dir:
        plots = write_plots_safe(rows, settings, args.plot_dir)
        for p in plots:
            print(f"wrote {p}")
    doc = report(settings.as_dict(), env, rows, _command(settings, names), plots)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(dumps(doc) + "\n")
        print(f"wrote {args.json}")
    errors = [r for r in rows if r.status == "error"]
    slower = False
    if baseline_entries is not None:
        from .compare import compare, entries

        result = compare(entries(doc, "this run"), baseline_entries, args.tolerance, args.compare)
        print()
        print("\n".join(result.lines))
        slower = not result.ok
    return 1 if errors or slower else 0


def write_plots_safe(rows: Sequence[Row], settings: BenchSettings, plot_dir: str) -> List[str]:
    from .plots import write_plots

    return write_plots(rows, settings.as_dict(), plot_dir)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moe_ep_bench [options]``: exit 0 when every case ran or was
    skipped, 1 when some failed, 2 on a usage or configuration error."""
    from moe_ep_spec.cli import run_parsed

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a command line mistake (2, printed with the usage)
        return exc.code if isinstance(exc.code, int) else 2
    return run_parsed(args)
