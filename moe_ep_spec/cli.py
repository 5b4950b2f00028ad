"""``moe-ep``: list backends, run one layer on a backend and check it against the reference.

Other packages add subcommands through the entry-point group
``moe_ep_spec.commands`` (a callable that takes the argparse subparsers object),
which is how ``moe-ep conformance`` arrives with the conformance package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from importlib import metadata
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from . import __version__
from .api import ForwardResult
from .backend import MoeEpBackend
from .config import MoeEpConfig
from .errors import MoeEpError
from .formats import MoeFormat
from .inputs import INPUT_FORMATS, ROUTINGS, random_world
from .launch import call_world
from .registry import get_registry
from .tolerance import Comparison, compare

__all__ = ["main", "build_parser", "run_parsed"]

COMMANDS_GROUP = "moe_ep_spec.commands"
_FORMATS = [f.value for f in MoeFormat]


def _capability_summary(backend: MoeEpBackend) -> str:
    c = backend.capabilities
    parts = ["fmt=" + ",".join(sorted(f.value for f in c.formats))]
    for flag in ("backward", "generate_c", "layered", "static_layout"):
        if getattr(c, flag):
            parts.append(flag)
    parts.append(f"launch={c.launch.value}")
    parts.append("dev=" + ",".join(c.devices))
    parts.append("ranks=" + ("any" if c.num_ranks is None else ",".join(map(str, c.num_ranks))))
    return " ".join(parts)


def _cmd_backends(args: argparse.Namespace) -> int:
    registry = get_registry()
    rows: List[Dict[str, Any]] = []
    for b in registry.list_backends():
        avail = b.availability()
        rows.append(
            {
                "name": b.name,
                "version": b.version,
                "available": avail.available,
                "reason": avail.reason,
                "capabilities": b.capabilities.as_dict(),
                "distribution": b.distribution or registry.source(b.name),
            }
        )
    failures = [
        {"name": f.name, "distribution": f.distribution, "stage": f.stage, "error": f"{type(f.exception).__name__}: {f.exception}"}
        for f in registry.failures()
    ]
    if args.json:
        print(json.dumps({"backends": rows, "plugin_failures": failures}, indent=2))
        return 0
    if not rows:
        print("no MoeEp backends registered (is MOE_EP_LOAD_PLUGINS set to exclude them?)")
    else:
        table = [["NAME", "VERSION", "AVAILABLE", "DISTRIBUTION", "CAPABILITIES"]]
        for r, b in zip(rows, registry.list_backends()):
            status = "yes" if r["available"] else f"no: {r['reason']}"
            table.append([r["name"], r["version"], status, r["distribution"], _capability_summary(b)])
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    for f in failures:
        print(
            f"plugin {f['name']!r} (distribution {f['distribution']}) failed at {f['stage']}: {f['error']}",
            file=sys.stderr,
        )
    return 0


def _stash_list(results: Sequence[ForwardResult]) -> list:
    return [r.stash for r in results]


def _cmd_run(args: argparse.Namespace) -> int:
    registry = get_registry()
    backend = registry.get_backend(args.backend)
    reference = registry.get_backend("reference")
    config = MoeEpConfig(
        num_experts=args.experts,
        hidden=args.hidden,
        intermediate=args.intermediate,
        num_topk=args.topk,
        num_ranks=args.ep_size,
        output_format=args.format,
        combine_format=args.combine_format or args.format,
        intermediate_format=args.intermediate_format,
        apply_topk_in_fc1=not args.weights_in_fc2,
        gate_up_clamp=args.clamp,
        generate_c=not args.no_backward,
        max_tokens_per_rank=args.tokens,
    )
    inputs = random_world(
        config, num_tokens=args.tokens, routing=args.routing, input_format=args.input_format, seed=args.seed
    )
    want_backward = not args.no_backward
    for op in ("forward",) + (("backward",) if want_backward else ()):
        reason = backend.capabilities.unsupported(config, op)
        if reason is not None:
            print(f"backend {backend.name!r} cannot run this layer: {reason}", file=sys.stderr)
            return 2

    report: Dict[str, Any] = {
        "backend": backend.name,
        "version": backend.version,
        "config": {k: (v.value if isinstance(v, MoeFormat) else v) for k, v in vars(config).items()},
        "tokens_per_rank": args.tokens,
        "routing": args.routing,
        "input_format": args.input_format,
        "seed": args.seed,
    }
    comparisons: List[Comparison] = []

    t0 = time.perf_counter()
    got = call_world(backend, "forward", config, inputs, timeout_s=args.timeout)
    report["forward_seconds"] = time.perf_counter() - t0
    ref, budgets = reference.forward_and_budget(config, inputs)  # type: ignore[attr-defined]
    for r in range(config.num_ranks):
        comparisons.append(compare(f"rank {r} output", got[r].output, ref[r].output, budgets[r].output))

    if want_backward:
        rng = np.random.default_rng(args.seed + 1)
        grads = [rng.standard_normal((args.tokens, config.hidden)).astype(np.float32) for _ in range(config.num_ranks)]
        stash = _stash_list(ref)  # both backward passes see the same stash
        t0 = time.perf_counter()
        got_b = call_world(backend, "backward", config, inputs, grads, stash, timeout_s=args.timeout)
        report["backward_seconds"] = time.perf_counter() - t0
        ref_b, bud_b = reference.backward_and_budget(config, inputs, grads, stash)  # type: ignore[attr-defined]
        for r in range(config.num_ranks):
            for field in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
                comparisons.append(
                    compare(
                        f"rank {r} {field}",
                        getattr(got_b[r], field),
                        getattr(ref_b[r], field),
                        getattr(bud_b[r], field),
                    )
                )
    ok = all(c.ok for c in comparisons)
    report["ok"] = ok
    report["checks"] = [
        {"name": c.name, "ok": c.ok, "error_over_budget": c.ratio, "max_abs_error": c.max_abs_error}
        for c in comparisons
    ]
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(
            f"backend {backend.name} {backend.version}: ep_size={config.num_ranks} tokens/rank={args.tokens} "
            f"hidden={config.hidden} intermediate={config.intermediate} experts={config.num_experts} "
            f"topk={config.num_topk} output={config.output_format.value} combine={config.combine_format.value} "
            f"input={args.input_format} routing={args.routing}"
        )
        line = f"forward  {report['forward_seconds'] * 1e3:9.2f} ms"
        if want_backward:
            line += f"   backward {report['backward_seconds'] * 1e3:9.2f} ms"
        print(line)
        print(f"{'check':32s} {'max |error|':>12s} {'error/budget':>13s}  result")
        for c in comparisons:
            print(f"{c.name:32s} {c.max_abs_error:12.3e} {c.ratio:13.3e}  {'ok' if c.ok else 'FAIL'}")
        for c in comparisons:
            if not c.ok:
                print("FAIL " + c.describe())
        print("PASS: within the spec's tolerance" if ok else "FAIL: outside the spec's tolerance")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-ep", description="The MoeEp operator: backends, checks and tools.")
    parser.add_argument("--version", action="version", version=f"moe-ep-spec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("backends", help="list registered backends, their availability and capabilities")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("run", help="run one layer forward and backward on a backend and check it against the reference")
    p.add_argument("--backend", default=None, help="backend name (default: $MOE_EP_BACKEND or 'reference')")
    p.add_argument("--ep-size", "--num-ranks", dest="ep_size", type=int, default=2, help="num_ranks (default 2)")
    p.add_argument("--tokens", type=int, default=16, help="num_tokens per rank (default 16)")
    p.add_argument("--hidden", type=int, default=128, help="hidden (default 128)")
    p.add_argument("--intermediate", type=int, default=64, help="intermediate (default 64)")
    p.add_argument("--experts", type=int, default=8, help="num_experts (default 8)")
    p.add_argument("--topk", type=int, default=2, help="num_topk (default 2)")
    p.add_argument("--format", choices=_FORMATS, default="bf16", help="output_format (default bf16)")
    p.add_argument("--combine-format", choices=_FORMATS, default=None, help="combine_format (default: --format)")
    p.add_argument("--intermediate-format", choices=_FORMATS, default=None, help="intermediate_format (default none)")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="bf16", help="activation/weight encoding")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform", help="routing pattern (default uniform)")
    p.add_argument("--clamp", type=float, default=None, help="gate_up_clamp (default none)")
    p.add_argument("--weights-in-fc2", action="store_true", help="apply_topk_in_fc1=False")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a process-per-rank run may take")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.set_defaults(func=_cmd_run)

    for ep in sorted(metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken add-on must not break the core CLI
            print(f"moe-ep: could not load command {ep.name!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_parsed(build_parser().parse_args(argv))


def run_parsed(args: argparse.Namespace) -> int:
    """Run a parsed command: its exit status; 2 with ``moe-ep: error: ...`` for a
    MoeEpError, 130 on Ctrl-C, 3 with a traceback for anything else."""
    try:
        return int(args.func(args))
    except MoeEpError as exc:
        print(f"moe-ep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - print the traceback, fail with a distinct code
        traceback.print_exc()
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
