"""``moe-ep``: list backends, run one layer on a backend and check it against the reference.

Other packages add subcommands through the entry-point group
``moe_ep_spec.commands`` (a callable that takes the argparse subparsers object),
which is how ``moe-ep conformance`` (distribution ``moe-ep-conformance``) and
``moe-ep bench`` (``moe-ep-bench``) arrive. When one of those is not installed,
its name still parses and the error says what to install.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
import traceback
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Dict, List, NoReturn, Optional, Sequence

from . import __version__
from .backend import Availability, MoeEpBackend
from .config import MoeEpConfig
from .errors import CapabilityError, ConfigError, MoeEpError, MoeEpWarning
from .formats import MoeFormat
from .inputs import INPUT_FORMATS, ROUTINGS
from .registry import ENV_BACKEND, DEFAULT_BACKEND, get_registry

__all__ = [
    "ADD_ON_COMMANDS",
    "AddOnCommand",
    "EXIT_CODES",
    "Parser",
    "build_parser",
    "check_input_file",
    "check_output_file",
    "main",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "require_backend",
    "run_parsed",
    "unavailable_reason",
]

COMMANDS_GROUP = "moe_ep_spec.commands"
_FORMATS = [f.value for f in MoeFormat]

#: The exit status of every ``moe-ep`` command, by what happened. A usage mistake
#: (an unknown option, a bad value, a missing input file, an unknown or
#: unavailable backend, output that cannot be made, a selection of no cases) is
#: always 2 with one ``moe-ep: error: ...`` sentence on stderr.
EXIT_CODES: Dict[int, str] = {
    0: "every check, case or measurement passed or was skipped",
    1: "a check, case or measurement failed (or a bench row is slower than its baseline)",
    2: "a usage mistake: the command did no work",
    3: "an internal error (a traceback)",
    130: "interrupted (Ctrl-C)",
}


class Parser(argparse.ArgumentParser):
    """argparse with one voice for every command line mistake: the usage of the
    (sub)command that was typed, ``PROG: error: ...``, and where its options are
    described; exit status 2. Subcommands (``add_subparsers``) get this class too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\nsee `{self.prog} --help` for its options\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (EP sizes, tokens, shapes, repeats)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {value}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a tolerance)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (seconds, tolerances)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0; got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0; got {text}")
    return value


def check_output_file(option: str, path: Optional[str]) -> None:
    """A report file must be writable before the work starts (not after it, when
    the results would be lost). Its folder is never created: a missing folder is
    a usage mistake (MoeEpError naming the folder, exit 2)."""
    if not path:
        return
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    problem = ""
    if os.path.isdir(full):
        problem = "it is a directory"
    elif not os.path.isdir(parent):
        problem = f"the directory {parent} does not exist"
    elif not os.access(parent, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        problem = "it is not writable"
    if problem:
        raise MoeEpError(f"{option} {path}: cannot write the report there: {problem}")


def check_input_file(option: str, path: str) -> None:
    """A file the command reads must exist (MoeEpError, exit 2)."""
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise MoeEpError(f"{option} {path}: the file {what}")


def require_backend(name: Optional[str]) -> MoeEpBackend:
    """The registered backend ``name`` (None: the default one), refused at once when it cannot run here:
    the quick check (what is installed, no framework import) first, so an
    unavailable backend costs what `moe-ep backends` costs; then the full check.
    BackendNotFoundError or BackendUnavailableError (exit 2)."""
    from .errors import BackendUnavailableError

    backend = get_registry().get_backend(name, require_available=False)
    reason = unavailable_reason(backend)
    if reason is not None:
        raise BackendUnavailableError(backend.name, reason)
    return backend


def unavailable_reason(backend: MoeEpBackend) -> Optional[str]:
    """Why ``backend`` cannot run here, or None when it can: its quick check (what is
    installed) first, then the full one; a check that raises is a reason too (a plugin
    that breaks its contract is reported, never raised)."""
    for check in (backend.quick_availability, backend.availability):
        try:
            availability = check()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            return f"its availability check raised {type(exc).__name__}: {exc}"
        if not availability:
            return availability.reason
    return None


@dataclass(frozen=True)
class AddOnCommand:
    """A subcommand another distribution adds, and how to get it.

    Attributes:
        distribution: the distribution that adds it.
        install: the command that installs it (from the repository root).
        summary: what the command does (shown in ``moe-ep --help``).
    """

    distribution: str
    install: str
    summary: str


#: The project's own add-on commands: ``moe-ep NAME`` without its distribution
#: says which one to install instead of "invalid choice".
ADD_ON_COMMANDS: Dict[str, AddOnCommand] = {
    "bench": AddOnCommand("moe-ep-bench", "pip install ./bench", "time every backend against its baselines"),
    "conformance": AddOnCommand(
        "moe-ep-conformance", "pip install ./conformance", "run the conformance suite on backends against the reference"
    ),
}

# MoeEpConfig fields and the `moe-ep run` options that set them (for errors about the fields).
_FIELD_OPTIONS = {
    "num_ranks": "--ep-size",
    "num_experts": "--experts",
    "hidden": "--hidden",
    "intermediate": "--intermediate",
    "num_topk": "--topk",
    "output_format": "--format",
    "combine_format": "--combine-format",
    "intermediate_format": "--intermediate-format",
    "gate_up_clamp": "--clamp",
    "max_tokens_per_rank": "--tokens",
}


# ------------------------------------------------------------------ backends


def _capability_summary(backend: MoeEpBackend) -> str:
    """A short text of what the backend declares: launch, devices, output formats
    (``fmt``) and input encodings (``in``; ``all`` when bf16, mxfp8 and nvfp4), EP sizes when limited, and ``-feature`` for
    every feature it does not have."""
    c = backend.capabilities
    formats = sorted(f.value for f in c.formats)
    parts = [f"launch={c.launch.value}", "dev=" + ",".join(c.devices)]
    parts.append("fmt=" + ("all" if len(formats) == len(_FORMATS) else ",".join(formats)))
    inputs = sorted(f.value for f in c.input_formats)
    parts.append("in=" + ("all" if len(inputs) == len(_FORMATS) else ",".join(inputs)))
    if c.num_ranks is not None:
        parts.append("ranks=" + ",".join(map(str, c.num_ranks)))
    for flag, label in (
        ("backward", "backward"),
        ("generate_c", "stash"),
        ("layered", "layered"),
        ("static_layout", "static"),
        ("dynamic_layout", "dynamic"),
        ("intermediate_format", "intermediate"),
    ):
        if not getattr(c, flag):
            parts.append("-" + label)
    return " ".join(parts)


_NOTE_WIDTH = 100  # the notes under the table wrap at this width

_CAPABILITY_LEGEND = (
    "CAPABILITIES: fmt= the output formats, in= the encodings of the activations and weights it accepts "
    "(all: bf16, mxfp8 and nvfp4); -X marks a feature the backend lacks (backward: the "
    "backward pass, stash: the training stash, layered: dispatch/combine, static/dynamic: a layout, "
    "intermediate: intermediate_format); `moe-ep backends --json` gives every field."
)


def _availability(backend: MoeEpBackend, check: bool) -> Availability:
    try:
        return backend.availability() if check else backend.quick_availability()
    except Exception as exc:  # noqa: BLE001 - a plugin that breaks its contract must not break the listing
        return Availability(False, f"its availability check raised {type(exc).__name__}: {exc}")


def _cmd_backends(args: argparse.Namespace) -> int:
    registry = get_registry()
    with warnings.catch_warnings():  # an unmatched MOE_EP_LOAD_PLUGINS entry is an error here, below
        warnings.simplefilter("ignore", MoeEpWarning)
        backends = registry.list_backends()
    rows: List[Dict[str, Any]] = []
    for b in backends:
        avail = _availability(b, args.check)
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
        print(json.dumps({"backends": rows, "checked": bool(args.check), "plugin_failures": failures}, indent=2))
        return 0
    if not rows:
        print("no MoeEp backends registered (is MOE_EP_LOAD_PLUGINS set to exclude them?)")
    else:
        table = [["NAME", "VERSION", "AVAILABLE", "DISTRIBUTION", "CAPABILITIES"]]
        for r, b in zip(rows, backends):
            table.append(
                [r["name"], r["version"], "yes" if r["available"] else "no", r["distribution"], _capability_summary(b)]
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        unavailable = [r for r in rows if not r["available"]]
        if unavailable:
            print()
            print("not available here:")
            for r in unavailable:
                reason = f"{r['name']}: {r['reason'] or '(no reason given)'}"
                print(textwrap.fill(reason, width=_NOTE_WIDTH, initial_indent="  ", subsequent_indent="    "))
        print()
        notes = [_CAPABILITY_LEGEND]
        if not args.check:
            notes.append(
                "AVAILABLE: judged from what is installed, without importing torch or jax; "
                "`moe-ep backends --check` imports them and asks each backend in full."
            )
        for note in notes:
            print(textwrap.fill(note, width=_NOTE_WIDTH, subsequent_indent="  "))
    for f in failures:
        print(
            f"plugin {f['name']!r} (distribution {f['distribution']}) failed at {f['stage']}: {f['error']}",
            file=sys.stderr,
        )
    unmatched = registry.unmatched_plugins_message()
    if unmatched:
        print(f"moe-ep: error: {unmatched}", file=sys.stderr)
        return 2
    return 0


# ----------------------------------------------------------------------- run


def _make_config(args: argparse.Namespace) -> MoeEpConfig:
    try:
        return MoeEpConfig(
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
    except ConfigError as exc:
        message = str(exc)
        named = sorted((message.find(field), opt) for field, opt in _FIELD_OPTIONS.items() if field in message)
        options = [opt for _, opt in named]
        if options:
            message += f" (set by {', '.join(options)})"
        raise ConfigError(message, field=exc.field, value=exc.value) from None


def _cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from .inputs import random_world
    from .launch import call_world
    from .tolerance import Comparison, compare

    registry = get_registry()
    backend = require_backend(args.backend)
    reference = registry.get_backend("reference")
    config = _make_config(args)
    inputs = random_world(
        config, num_tokens=args.tokens, routing=args.routing, input_format=args.input_format, seed=args.seed
    )
    want_backward = not args.no_backward
    for op in ("forward",) + (("backward",) if want_backward else ()):
        reason = backend.capabilities.unsupported(config, op)
        if reason is not None:
            hint = ""
            if want_backward and ("backward" in reason or "generate_c" in reason):
                hint = "; add --no-backward to check the forward only"
            raise CapabilityError(f"backend {backend.name!r} cannot run this layer: {reason}{hint}", feature=op)

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
        stash = [r.stash for r in ref]  # both backward passes see the same stash
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


# -------------------------------------------------------------------- parser

_RUN_DESCRIPTION = (
    "Make one random MoE layer (random activations, routing, router weights and expert weights), run it on a "
    "backend, forward and, unless --no-backward, backward, run the same layer on the numpy reference, and print "
    "every result's worst error as a multiple of the spec's error budget. Exit status: 0 when every result is "
    "within its budget, 1 when one is not, 2 for a bad option or a layer the backend cannot run."
)


def _add_run_command(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run one random layer on a backend and check it against the reference",
        description=_RUN_DESCRIPTION,
    )
    p.add_argument(
        "--backend",
        default=None,
        metavar="NAME",
        help=f"the backend to check; `moe-ep backends` lists them (default: ${ENV_BACKEND}, else {DEFAULT_BACKEND})",
    )
    p.add_argument(
        "--ep-size", dest="ep_size", type=positive_int, default=2, metavar="N",
        help="number of expert-parallel ranks (default: 2)",
    )
    p.add_argument("--tokens", type=positive_int, default=16, metavar="N", help="tokens on every rank (default: 16)")
    p.add_argument("--hidden", type=positive_int, default=128, metavar="N", help="model width: elements per token (default: 128)")
    p.add_argument(
        "--intermediate", type=positive_int, default=64, metavar="N",
        help="width of each expert's hidden layer; its FC1 makes twice that, gate and up (default: 64)",
    )
    p.add_argument(
        "--experts", type=positive_int, default=8, metavar="N",
        help="experts in the layer, split evenly over the ranks (default: 8)",
    )
    p.add_argument("--topk", type=positive_int, default=2, metavar="K", help="experts each token is routed to (default: 2)")
    p.add_argument("--format", choices=_FORMATS, default="bf16", help="number format of the layer's output (default: bf16)")
    p.add_argument(
        "--combine-format", choices=_FORMATS, default=None,
        help="format the expert results are rounded to on their way back to their tokens (default: the --format value)",
    )
    p.add_argument(
        "--intermediate-format", choices=_FORMATS, default=None,
        help="round each expert's SwiGLU output to this format before FC2 (default: no rounding)",
    )
    p.add_argument(
        "--input-format", choices=INPUT_FORMATS, default="bf16",
        help="encoding of the random activations and expert weights (default: bf16)",
    )
    p.add_argument(
        "--routing", choices=ROUTINGS, default="uniform",
        help="how tokens pick experts: uniform, expert 0 in every token (skewed), only rank 0's experts (one_rank), "
        "a third of the slots unused (unused_mixed), every slot unused (all_unused) (default: uniform)",
    )
    p.add_argument(
        "--clamp", type=float, default=None, metavar="L",
        help="SwiGLU limit: gate clamped to at most L, up to [-L, L] (default: no clamp)",
    )
    p.add_argument(
        "--weights-in-fc2", action="store_true",
        help="apply the router weight after FC2 instead of before it (apply_topk_in_fc1=False; default: before FC2)",
    )
    p.add_argument(
        "--no-backward", action="store_true",
        help="check the forward only, for backends without the backward (default: forward and backward)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed of the layer's inputs (default: 0)")
    p.add_argument(
        "--timeout", type=positive_float, default=300.0, metavar="SECONDS",
        help="how long each operation of a process-per-rank backend may take before its rank processes are "
        "stopped (default: 300)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table (default: table)")
    p.set_defaults(func=_cmd_run)


def _missing_command(name: str, add_on: AddOnCommand) -> Any:
    def run(args: argparse.Namespace) -> int:
        raise MoeEpError(
            f"'moe-ep {name}' comes with the {add_on.distribution} distribution, which is not installed in this "
            f"environment; install it with `{add_on.install}` from the root of the moe-ep-spec repository"
        )

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moe-ep",
        description="The MoeEp operator: list its backends, check one against the reference, and the commands "
        "of the installed add-ons (conformance suite, benchmarks).",
        epilog="`moe-ep COMMAND --help` describes a command's options. Exit status, every command: "
        + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items())
        + ".",
    )
    parser.add_argument("--version", action="version", version=f"moe-ep-spec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = sub  # type: ignore[attr-defined]  # _main finds a subcommand's parser here

    p = sub.add_parser(
        "backends",
        help="list the registered backends: version, whether they can run here (and why not), capabilities",
        description="List the registered MoeEp backends: version, distribution, whether each can run here (the "
        "reasons of those that cannot are printed under the table) and what each declares it supports. "
        "Neither torch nor jax is imported unless --check.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (default: table)")
    p.add_argument(
        "--check", action="store_true",
        help="ask every backend in full whether it can run, importing its framework (slower; "
        "default: judge from what is installed)",
    )
    p.set_defaults(func=_cmd_backends)

    _add_run_command(sub)

    broken: Dict[str, str] = {}
    for ep in sorted(metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken add-on must not break the core CLI
            broken[ep.name] = f"{type(exc).__name__}: {exc}"
            print(f"moe-ep: could not load command {ep.name!r}: {broken[ep.name]}", file=sys.stderr)
    for name, add_on in ADD_ON_COMMANDS.items():
        if name not in sub.choices and name not in broken:
            p = sub.add_parser(name, help=f"{add_on.summary} (not installed: {add_on.install})", add_help=False)
            p.set_defaults(func=_missing_command(name, add_on), missing_command=True)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``moe-ep``: its exit status. A bare ``moe-ep`` prints the help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _main(argv)


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    """MoeEpWarnings as ``moe-ep: warning: ...`` lines; others as Python shows them."""
    if issubclass(category, MoeEpWarning):
        print(f"moe-ep: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _main(argv: List[str]) -> int:
    try:
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 0
        try:
            args, extra = _parse(parser, argv)
        except SystemExit as exc:  # --help, --version (0) or a command line mistake (2, printed)
            return exc.code if isinstance(exc.code, int) else 2
        if getattr(args, "func", None) is None:  # options but no command
            parser.print_help(sys.stderr)
            return 2
        code = run_parsed(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        return _closed_pipe()


def _parse(parser: argparse.ArgumentParser, argv: List[str]) -> Any:
    """``(args, extra)``; an unknown option gets the usage of the subcommand it was
    given to, not the top level's (SystemExit 2)."""
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "missing_command", False):
        command = getattr(args, "command", None)
        sub = getattr(parser, "commands", None)
        target = sub.choices.get(command, parser) if sub is not None and command else parser
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    return args, extra


def _closed_pipe() -> int:
    """The reader of stdout went away (``moe-ep run --json | head``): no traceback,
    and no second error when Python flushes stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (captured): nothing to silence
        pass
    return 1


def run_parsed(args: argparse.Namespace) -> int:
    """Run a parsed command: its exit status; 2 with ``moe-ep: error: ...`` for a
    MoeEpError, 130 on Ctrl-C, 1 when stdout was closed early, 3 with a
    traceback for anything else."""
    try:
        return int(args.func(args))
    except BrokenPipeError:
        return _closed_pipe()
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
