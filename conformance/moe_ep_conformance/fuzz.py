"""Seeded fuzzing of backends against the reference: ``moe-ep conformance --fuzz N --seed S``.

Draws N cases over the space the spec allows (operation, EP size, experts, top-k,
hidden and intermediate sizes that fit the drawn formats, output/combine/
intermediate formats, activation and weight encodings, router-weight dtype,
routing pattern, token counts, router-weight placement, clamp, layout), runs
each on the chosen backends with the same checks as the table
(:func:`moe_ep_conformance.runner.run_case`), and on a failure lets
``hypothesis`` shrink it to a small case. The shrunk case is printed with the one
command that reproduces it::

    moe-ep conformance --backend NAME --fuzz-case '{"op": "forward", ...}'

A case's inputs depend on its parameters only (its id), so the command
reproduces it exactly; the same ``--seed`` draws the same cases.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from moe_ep_spec import MoeEpBackend
from moe_ep_spec.errors import ConfigError

from .cases import Case
from .runner import CaseResult, run_case

__all__ = ["FuzzFailure", "fuzz", "case_from_json", "case_to_json", "reproduce_command"]

_OPS = ("forward", "forward_stash", "backward", "dispatch", "combine", "dispatch_backward", "combine_backward")
_FORMATS = ("bf16", "mxfp8", "nvfp4")
_INPUTS = ("fp32", "bf16", "mxfp8", "nvfp4")
_ROUTINGS = ("uniform", "skewed", "one_rank", "unused_mixed", "all_unused")
_TOKENS = ("even", "uneven", "zero_rank")
#: The Case fields a fuzz case sets (its JSON form).
_FIELDS = (
    "op", "num_ranks", "num_topk", "num_experts", "hidden", "intermediate", "output_format", "combine_format",
    "intermediate_format", "input_format", "weight_format", "routing", "tokens", "weights_in", "clamp", "layout",
    "router_format",
)


@dataclass(frozen=True)
class FuzzFailure:
    """A shrunk failing case: ``backend``, the ``case``, its ``result`` and the
    ``command`` that reproduces it."""

    backend: str
    case: Case
    result: CaseResult
    command: str


def case_to_json(case: Case) -> str:
    """The case's parameters as one line of JSON (the ``--fuzz-case`` argument)."""
    return json.dumps({f: getattr(case, f) for f in _FIELDS}, separators=(",", ":"))


def case_from_json(text: str) -> Case:
    """The :class:`Case` of a ``--fuzz-case`` argument; raises ConfigError for
    text that is not a JSON object of Case fields."""
    try:
        params = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--fuzz-case must be a JSON object of case fields; got {text!r} ({exc})", field="fuzz_case") from None
    if not isinstance(params, dict) or set(params) - set(_FIELDS) or "op" not in params:
        raise ConfigError(
            f"--fuzz-case must be a JSON object with 'op' and fields among {', '.join(_FIELDS)}; got {text!r}",
            field="fuzz_case",
        )
    case = Case(**params)
    case.config()  # raises ConfigError for an invalid layer
    return case


def reproduce_command(backend: str, case: Case) -> str:
    """The ``moe-ep conformance`` command line that runs exactly this case."""
    return f"moe-ep conformance --backend {shlex.quote(backend)} --fuzz-case {shlex.quote(case_to_json(case))}"


def _multiple(fmt: Optional[str]) -> int:
    return {"mxfp8": 32, "nvfp4": 16}.get(fmt or "", 1)


def _strategy() -> Any:
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Any) -> Case:
        op = draw(st.sampled_from(_OPS))
        n = draw(st.sampled_from((1, 2, 3, 4)))
        el = draw(st.integers(1, 5))
        e = n * el
        k = draw(st.integers(1, min(e, 9)))
        out = draw(st.sampled_from(_FORMATS))
        comb = draw(st.sampled_from(_FORMATS))
        inter = draw(st.sampled_from((None,) + _FORMATS))
        act = draw(st.sampled_from(_INPUTS))
        wt = draw(st.sampled_from(_INPUTS))
        mh = max(_multiple(out), _multiple(comb))
        hidden = mh * draw(st.integers(1, max(1, 160 // mh)))
        mi = _multiple(inter)
        intermediate = mi * draw(st.integers(1, max(1, 96 // mi)))
        return Case(
            op=op, num_ranks=n, num_topk=k, num_experts=e, hidden=hidden, intermediate=intermediate,
            output_format=out, combine_format=comb, intermediate_format=inter,
            input_format=act, weight_format=wt,
            routing=draw(st.sampled_from(_ROUTINGS)), tokens=draw(st.sampled_from(_TOKENS)),
            weights_in=draw(st.sampled_from(("fc1", "fc2"))), clamp=draw(st.booleans()),
            layout=draw(st.sampled_from(("dynamic", "static"))), router_format=draw(st.sampled_from(("fp32", "bf16"))),
        )

    return cases()


def fuzz(
    backends: Sequence[MoeEpBackend],
    num_cases: int,
    seed: int,
    *,
    timeout_s: float = 120.0,
    device: str = "cpu",
    log: Any = print,
) -> List[FuzzFailure]:
    """Draw ``num_cases`` cases with ``seed`` and run them on every backend; a
    failing case is shrunk. Returns one :class:`FuzzFailure` per failing backend
    (empty: all passed). Skips (undeclared capabilities) count as passes."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    if num_cases < 1:
        raise ConfigError(f"--fuzz must be >= 1; got {num_cases}", field="fuzz", value=num_cases)
    failures = []
    for backend in backends:
        found: Dict[str, Any] = {}

        def check(case: Case) -> None:
            result = run_case(backend, case, timeout_s=timeout_s, device=device)
            if result.outcome == "failed":
                found["case"], found["result"] = case, result
                raise AssertionError(result.reason)

        test = settings(
            max_examples=num_cases, database=None, deadline=None, derandomize=False, print_blob=False,
            suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink),
        )(hseed(seed)(given(_strategy())(check)))
        try:
            test()
        except AssertionError:
            pass
        if "case" in found:
            case, result = found["case"], found["result"]
            command = reproduce_command(backend.name, case)
            failures.append(FuzzFailure(backend.name, case, result, command))
            log(f"FUZZ FAILURE {backend.name} (seed {seed}), shrunk to {case.test_id(backend.name)}:")
            log(result.describe())
            log(f"reproduce: {command}")
        else:
            log(f"fuzz {backend.name}: {num_cases} drawn cases passed (seed {seed})")
    return failures
