"""The conformance suite's own machinery (``moe_ep_conformance``): the case table and
its ids, the runner's judgement (pass / skip / fail, messages), process-per-rank and
isolated runs, expected-failure and tolerance files, the reports and the
``moe-ep conformance`` command. The suite's verdicts on the reference itself are the
CI's main job; this file checks that the machinery around them behaves.

Known problems of the conformance package are pinned as ``xfail(strict=True)`` tests,
each with a reason that says what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Dict, Sequence

import numpy as np
import pytest
from rank_backends import CrashingRank, HangingRank, LoopbackReference

import moe_ep_spec
from moe_ep_conformance import (
    BAD_INPUTS,
    OPERATIONS,
    Case,
    CaseResult,
    Check,
    all_cases,
    full_cases,
    quick_cases,
    run_case,
    run_case_isolated,
    run_cases,
)
from moe_ep_conformance.cli import pytest_args
from moe_ep_conformance.expectations import (
    Entry,
    ExpectationError,
    Expectations,
    load_tolerance_file,
    load_xfail_file,
)
from moe_ep_conformance.report import Record, Report
from moe_ep_spec import Capabilities, ForwardResult, MoeEpBackend, MoeFormat
from moe_ep_spec.cli import build_parser
from moe_ep_spec.formats import BF16
from moe_ep_spec.inputs import random_world

REFERENCE = moe_ep_spec.get_backend("reference")
ReferenceBackend = type(REFERENCE)
FULL = full_cases()
QUICK = quick_cases()
LAYERED = ("dispatch", "combine", "dispatch_backward", "combine_backward")

#: forward[...-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-dynamic]
BASE = Case("forward", 2, 2, 8)


@pytest.fixture(scope="module", autouse=True)
def _module_setup():
    """Processes this module starts (ranks, isolated cases) load only the reference
    plugin: they need nothing else, and importing a framework backend in each of them
    is slow. This process's registry is already loaded (REFERENCE), so it is unaffected."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_EP_LOAD_PLUGINS", "reference")
        yield


def _in_table(case: Case) -> Case:
    """The table's own copy of ``case`` (so a test never runs a case the suite lacks)."""
    assert case in FULL, f"{case.test_id('reference')} is not in the case table"
    return FULL[FULL.index(case)]


# =============================================================================== the table


def test_case_ids_and_seeds_are_unique() -> None:
    ids = [c.test_id("reference") for c in FULL]
    assert len(ids) == len(set(ids))
    assert len({c.seed for c in FULL}) == len(FULL)


@pytest.mark.parametrize(
    "case, test_id",
    [
        (BASE, "forward[reference-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-dynamic]"),
        (
            Case("forward", 2, 2, 8, intermediate_format="mxfp8", weights_in="fc2", clamp=True),
            "forward[reference-ep2-k2-e8-out_bf16-comb_bf16-int_mxfp8-in_bf16-wt_bf16-uniform-even-w_fc2-clamp-dynamic]",
        ),
        (
            Case("forward_stash", 4, 8, 16, layout="static"),
            "forward_stash[reference-ep4-k8-e16-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-static]",
        ),
        (
            Case("combine", 4, 8, 16, layout="static", output_format="nvfp4", combine_format="mxfp8"),
            "combine[reference-ep4-k8-e16-out_nvfp4-comb_mxfp8-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-static]",
        ),
        (
            Case("combine_backward", 4, 2, 16, tokens="zero_rank", layout="static"),
            "combine_backward[reference-ep4-k2-e16-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-zero_rank-w_fc1-noclamp-static]",
        ),
        (
            Case("bad_input", 2, 2, 8, layout="static", bad="recv_capacity_overflow"),
            "bad_input[reference-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-static-bad_recv_capacity_overflow]",
        ),
        (
            Case("forward", 2, 2, 8, router_format="bf16", routing="unused_mixed"),
            "forward[reference-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-tw_bf16-unused_mixed-even-w_fc1-noclamp-dynamic]",
        ),
        (
            Case("combine", 2, 1, 4, combine_format="nvfp4", values="edges"),
            "combine[reference-ep2-k1-e4-out_bf16-comb_nvfp4-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-dynamic-edges]",
        ),
    ],
    ids=["base", "intermediate", "stash-k8", "combine-k8", "zero-rank", "bad-input", "bf16-router", "edges"],
)
def test_pinned_ids(case: Case, test_id: str) -> None:
    assert case.test_id("reference") == test_id
    assert _in_table(case).test_id("reference") == test_id


def test_ids_are_stable() -> None:
    again = full_cases()
    assert [c.test_id("b") for c in again] == [c.test_id("b") for c in FULL]
    # The quick flag is not an axis: it changes neither the id nor the seed.
    for c in QUICK[:5]:
        other = dataclasses.replace(c, quick=False)
        assert other.id == c.id and other.seed == c.seed and other == c
    # Report order: operations in OPERATIONS order.
    order = [OPERATIONS.index(c.op) for c in FULL]
    assert order == sorted(order)


def test_full_table_covers_every_operation_and_ep_size() -> None:
    assert {c.op for c in FULL} == set(OPERATIONS)
    assert {c.num_ranks for c in FULL} == {1, 2, 3, 4}
    for op in ("forward", "forward_stash", "backward", *LAYERED, "nan_isolation"):
        assert {c.num_ranks for c in FULL if c.op == op} == {1, 2, 3, 4}, op
    assert {c.num_ranks for c in FULL if c.op == "bad_input"} == {1, 2, 3}
    assert {c.bad for c in FULL if c.op == "bad_input"} == set(BAD_INPUTS)
    for fmt in ("bf16", "mxfp8", "nvfp4"):
        assert any(c.output_format == fmt for c in FULL)
        assert any(c.combine_format == fmt for c in FULL)
        assert any(c.intermediate_format == fmt for c in FULL)
    for axis, values in (
        ("input_format", {"fp32", "bf16", "fp16", "mxfp8", "nvfp4"}),
        ("routing", {"uniform", "skewed", "one_rank", "unused_mixed", "all_unused", "repeated", "id_edges"}),
        ("tokens", {"even", "uneven", "zero_rank", "full", "zero_full"}),
        ("weights_in", {"fc1", "fc2"}),
        ("clamp", {False, True}),
        ("layout", {"dynamic", "static"}),
        ("router_format", {"fp32", "bf16", "fp16"}),
        ("values", {"random", "edges", "large", "clamp_edges", "bf16_ties"}),
        ("cotangent", {"fp32", "bf16", "fp16"}),
        ("index_format", {"int32", "int64"}),
        ("strided", {False, True}),
    ):
        assert {getattr(c, axis) for c in FULL if c.op != "formats"} == values, axis


def test_full_table_reaches_the_sizes_and_shapes_of_issue_17() -> None:
    table = [c for c in FULL if c.op != "formats"]
    assert max(c.hidden for c in table) >= 2048 and max(c.intermediate for c in table) >= 256
    assert any(c.hidden % 128 == 0 and c.hidden > 128 for c in table)
    assert any(c.hidden % 16 and c.input_format in ("mxfp8", "nvfp4") for c in table)  # partial input blocks
    assert any(c.intermediate % 16 and c.weight_format in ("mxfp8", "nvfp4") for c in table)
    assert {c.num_topk % 4 for c in table} >= {1, 2, 3}
    assert max(c.num_experts for c in table) > 255  # ids beyond 8 bits
    assert any(c.index_format == "int64" and c.num_experts > 255 for c in table)
    assert any((c.num_experts // c.num_ranks) & (c.num_experts // c.num_ranks - 1) for c in table)  # not 2^n
    assert any(c.clamp and c.clamp_limit != float(np.array(c.clamp_limit, np.float32).astype(BF16)) for c in table)
    assert any(c.tokens in ("full", "zero_full") for c in table)

    def received(c: Case) -> int:  # routes to rank 0 with `one_rank` routing and full ranks
        return sum(c.tokens_per_rank()) * c.num_topk if c.routing == "one_rank" else 0

    assert max(received(c) for c in table) > 32768  # a 16-bit row counter overflows
    skewed = [c for c in table if c.routing == "skewed" and c.tokens == "full"]
    assert max(c.max_tokens * c.num_ranks for c in skewed) >= 256  # expert 0 gets hundreds of rows
    big = [c for c in table if c.hidden * c.intermediate >= 128 * 1024 or c.max_tokens >= 1024]
    assert big and any(c.quick for c in big), "--quick sees realistic sizes too"
    # a rank with no token, and ranks receiving no route, in every operation and every format
    empty = [c for c in table if c.tokens == "zero_rank" and c.routing == "one_rank"]
    assert {c.op for c in empty} == {"forward", "forward_stash", "backward", *LAYERED}
    for point in ("output_format", "combine_format", "intermediate_format", "input_format"):
        assert {getattr(c, point) for c in empty} >= {"mxfp8", "nvfp4"}, point
    # every bad input the spec's error classes name, on every operation that takes the input
    assert {op for op, _ in BAD_INPUTS.values()} == {"config", "forward", "dispatch", "backward", *LAYERED[1:]}
    assert {err for _, err in BAD_INPUTS.values()} == {
        "ConfigError", "ShapeError", "DTypeError", "FormatError", "RoutingIndexError", "CapacityError", "StashError"
    }
    for op in ("forward", "dispatch", "backward"):
        assert {err for o, err in BAD_INPUTS.values() if o == op} >= {"ShapeError", "DTypeError", "RoutingIndexError",
                                                                      "CapacityError"}, op


@pytest.mark.parametrize(
    "case",
    [
        Case("forward", 2, 5, 40, routing="repeated"),
        Case("forward", 4, 2, 16, input_format="fp16", weight_format="bf16", router_format="fp16",
             index_format="int64", output_format="mxfp8"),
        _in_table(Case("backward", 2, 2, 8, input_format="fp16", weight_format="fp32", router_format="fp16",
                       index_format="int64", cotangent="fp16")),
        Case("forward", 2, 2, 8, strided=True),
        Case("forward", 3, 3, 9, tokens="full", routing="repeated", layout="static"),
        Case("forward", 2, 2, 8, values="large"),
    ],
    ids=["repeated", "fp16-int64", "fp16-cotangent", "strided", "full", "large"],
)
def test_cases_build_the_inputs_their_ids_name(case: Case) -> None:
    from moe_ep_conformance.runner import _world

    world = _world(case, case.config())
    for r, w in enumerate(world):
        assert w.topk_idx.dtype == np.dtype(case.index_format), (r, w.topk_idx.dtype)
        assert np.asarray(w.topk_weights).dtype == {"fp32": np.float32, "bf16": BF16, "fp16": np.float16}[case.router_format]
        if case.input_format == "fp16":
            assert w.activation.dtype == np.float16
        if case.routing == "repeated":
            assert (w.topk_idx[:, -1] == w.topk_idx[:, 0]).all(), "the last slot must repeat slot 0's expert"
        if case.tokens == "full":
            assert w.topk_idx.shape[0] == case.max_tokens == case.config().max_tokens_per_rank
        for name in ("activation", "fc1_weight", "fc2_weight", "topk_idx", "topk_weights"):
            a = getattr(w, name)
            assert a.flags.c_contiguous != case.strided, f"rank {r} {name}: strided={case.strided}"
        if case.values == "large":
            assert np.abs(np.asarray(w.activation, np.float64)).max() > 64, "large values must leave unit scale"
    if case.op == "backward" and case.cotangent == "fp16":
        assert run_case(REFERENCE, case).outcome == "passed"


@pytest.mark.parametrize(
    "case, test_id",
    [
        (
            Case("forward", 1, 3, 6, hidden=2048, intermediate=128, tokens="full", max_tokens=32, routing="skewed",
                 output_format="mxfp8", input_format="mxfp8"),
            "forward[reference-ep1-k3-e6-h2048-i128-out_mxfp8-comb_bf16-in_mxfp8-wt_bf16-skewed-full-mt32-w_fc1-"
            "noclamp-dynamic]",
        ),
        (
            Case("backward", 2, 2, 8, clamp=True, clamp_limit=0.7, weights_in="fc2"),
            "backward[reference-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc2-clamp0.7-dynamic]",
        ),
        (
            Case("backward", 2, 2, 8, input_format="fp16", weight_format="fp32", router_format="fp16",
                 index_format="int64", cotangent="fp16", quick=True),
            "backward[reference-ep2-k2-e8-out_bf16-comb_bf16-in_fp16-wt_fp32-tw_fp16-id_int64-uniform-even-w_fc1-"
            "noclamp-dynamic-ct_fp16]",
        ),
        (
            Case("nan_isolation", 2, 2, 8, strided=True, routing="unused_mixed"),
            "nan_isolation[reference-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-unused_mixed-even-w_fc1-noclamp-"
            "dynamic-strided]",
        ),
        (
            Case("bad_input", 2, 2, 8, bad="backward_stash_mismatch"),
            "bad_input[reference-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-dynamic-"
            "bad_backward_stash_mismatch]",
        ),
    ],
    ids=["realistic", "inexact-clamp", "fp16-int64", "strided", "stash-mismatch"],
)
def test_pinned_ids_of_the_new_axes(case: Case, test_id: str) -> None:
    assert case.test_id("reference") == test_id
    assert _in_table(case).test_id("reference") == test_id


def test_quick_subset() -> None:
    assert {c.op for c in QUICK} == set(OPERATIONS)
    assert all(c.quick for c in QUICK) and all(c in FULL for c in QUICK)
    table = [c for c in QUICK if c.op != "formats"]  # the format cases have their own axes
    assert {c.output_format for c in table} == {"bf16", "mxfp8", "nvfp4"}
    assert {c.layout for c in table} == {"dynamic", "static"}
    assert {c.bad for c in table if c.op == "bad_input"} == set(BAD_INPUTS)
    # the new axes of issue 17 are in the quick subset too
    assert {c.num_ranks for c in table} == {1, 2, 3, 4}
    for axis, value in (("routing", "repeated"), ("tokens", "full"), ("input_format", "fp16"), ("router_format", "fp16"),
                        ("index_format", "int64"), ("cotangent", "bf16"), ("strided", True), ("values", "large")):
        assert any(getattr(c, axis) == value for c in table), (axis, value)
    assert any(c.hidden % 16 for c in table) and any(c.hidden % 128 == 0 for c in table)
    assert any(c.clamp and c.clamp_limit != 0.75 for c in table)
    assert any(c.tokens == "zero_rank" and c.routing == "one_rank" for c in table)
    assert all_cases(quick=True) == QUICK and all_cases() == FULL
    ep4 = all_cases(num_ranks=[4])
    assert ep4 and all(c.num_ranks == 4 for c in ep4)
    assert all_cases(quick=True, num_ranks=[1, 2]) == [c for c in QUICK if c.num_ranks in (1, 2)]


def test_seeds_depend_only_on_the_id() -> None:
    for c in (BASE, *QUICK[:3]):
        assert c.seed == zlib.crc32(f"{c.op}:{c.id}".encode()) & 0x7FFFFFFF
    assert BASE.seed == 913865956
    # The same axes under another operation are another case with other inputs.
    assert Case("forward_stash", 2, 2, 8).seed != BASE.seed
    # The inputs are a function of the seed: a case reproduces by id.
    c = _in_table(BASE)
    a = random_world(c.config(), num_tokens=c.tokens_per_rank(), routing=c.routing, seed=c.seed)
    b = random_world(Case("forward", 2, 2, 8).config(), num_tokens=[6, 6], routing="uniform", seed=BASE.seed)
    for x, y in zip(a, b):
        assert np.asarray(x.activation).tobytes() == np.asarray(y.activation).tobytes()
        assert x.topk_idx.tobytes() == y.topk_idx.tobytes()


# ===================================================================== in-process backends


class Limited(ReferenceBackend):
    """The reference declaring less than it can: bf16 only, no backward, no layered
    primitives, no static layout."""

    name = "limited"
    capabilities = Capabilities(
        formats=frozenset({MoeFormat.BF16}), backward=False, layered=False, static_layout=False
    )


class Raises(MoeEpBackend):
    name = "raises"

    def forward(self, config, inputs):
        raise RuntimeError("kernel launch failed: out of shared memory")


class Float32Output(MoeEpBackend):
    name = "float32-output"

    def forward(self, config, inputs):
        out = REFERENCE.forward(config, inputs)
        return [ForwardResult(moe_ep_spec.dequantize(r.output, np.float32) if config.output_format.is_block_scaled
                              else r.output.astype(np.float32)) for r in out]


class ShortOutput(MoeEpBackend):
    name = "short-output"

    def forward(self, config, inputs):
        return [ForwardResult(r.output[:-1]) for r in REFERENCE.forward(config, inputs)]


class PlainForBlocked(MoeEpBackend):
    """Returns a bf16 array where the configuration asks for a block-scaled output."""

    name = "plain-for-blocked"

    def forward(self, config, inputs):
        return [ForwardResult(moe_ep_spec.round_to_bf16(moe_ep_spec.dequantize(r.output, np.float64)))
                for r in REFERENCE.forward(config, inputs)]


class Float64Grads(ReferenceBackend):
    name = "float64-grads"

    def backward(self, config, inputs, grad_output, stash):
        out = super().backward(config, inputs, grad_output, stash)
        return [dataclasses.replace(r, grad_activation=r.grad_activation.astype(np.float64)) for r in out]


class Bf16WeightGrad(ReferenceBackend):
    """Wrong on purpose: grad_fc2_weight only as precise as bfloat16."""

    name = "bf16-wgrad"

    def backward(self, config, inputs, grad_output, stash):
        out = super().backward(config, inputs, grad_output, stash)
        return [dataclasses.replace(r, grad_fc2_weight=r.grad_fc2_weight.astype(BF16).astype(np.float32)) for r in out]


class ReadsPadding(ReferenceBackend):
    """Wrong on purpose: its combine touches every received row, padding included."""

    name = "reads-padding"

    def combine(self, config, handles, expert_out):
        out = super().combine(config, handles, expert_out)
        touched = [float(np.sum(e)) * 0.0 for e in expert_out]  # NaN when a padding row is NaN
        return [(o.astype(np.float32) + t).astype(o.dtype) for o, t in zip(out, touched)]


class Mutates(ReferenceBackend):
    """Wrong on purpose: scales the caller's router weights in place."""

    name = "mutates"

    def forward(self, config, inputs):
        out = super().forward(config, inputs)
        inputs[0].topk_weights[...] *= 2
        return out


class OneResult(ReferenceBackend):
    name = "one-result"

    def forward(self, config, inputs):
        return super().forward(config, inputs)[:1]


class WrongErrorClass(MoeEpBackend):
    name = "wrong-error"

    def forward(self, config, inputs):
        raise ValueError("nope")


class AcceptsAnything(MoeEpBackend):
    name = "accepts-anything"

    def forward(self, config, inputs):
        return []


class NudgedDispatchWeights(ReferenceBackend):
    """Wrong on purpose: dispatched router weights off by one float32 step."""

    name = "nudged-dispatch"

    def dispatch(self, config, inputs):
        out = super().dispatch(config, inputs)
        return [dataclasses.replace(d, topk_weights=np.nextafter(d.topk_weights, np.float32(np.inf))) for d in out]


class Int32Counts(ReferenceBackend):
    """Wrong on purpose: tokens_per_expert as int32 (the spec says int64)."""

    name = "int32-counts"

    def dispatch(self, config, inputs):
        out = super().dispatch(config, inputs)
        return [
            dataclasses.replace(
                d, handle=dataclasses.replace(d.handle, tokens_per_expert=d.handle.tokens_per_expert.astype(np.int32))
            )
            for d in out
        ]


class ScrubsNaN(ReferenceBackend):
    """Wrong on purpose: replaces non-finite outputs by 0 (section 13.5 says NaN must
    appear exactly where the reference has NaN)."""

    name = "scrubs-nan"

    def forward(self, config, inputs):
        out = super().forward(config, inputs)
        return [dataclasses.replace(r, output=np.nan_to_num(r.output.astype(np.float32), nan=0.0, posinf=0.0,
                                                            neginf=0.0).astype(BF16)) for r in out]


def test_reference_passes_the_quick_cases() -> None:
    results = run_cases(REFERENCE, QUICK)
    assert [r.test_id for r in results] == [c.test_id("reference") for c in QUICK]
    for r in results:
        assert r.outcome == "passed", r.describe()
        assert r.checks and all(c.ok for c in r.checks)
        assert r.ratio == 0.0 and r.reason == "" and r.tolerance_factor == 1.0
        assert r.describe() == f"{r.test_id}: passed"


def _needs_more_than_limited(c: Case) -> bool:
    op = BAD_INPUTS[c.bad][0] if c.op == "bad_input" else c.op
    if op == "config":  # judged on MoeEpConfig alone: never skipped
        return False
    formats = [c.output_format, c.combine_format, c.intermediate_format]
    return (
        op in LAYERED
        or op == "backward"
        or any(f not in (None, "bf16") for f in formats)
        or c.layout == "static"
    )


def test_capabilities_turn_cases_into_capability_skips() -> None:
    table = [c for c in QUICK if c.op != "formats"]  # the format cases have their own axes
    results = {r.test_id: r for r in run_cases(Limited(), table)}
    for c in table:
        r = results[c.test_id("limited")]
        if _needs_more_than_limited(c):
            assert r.outcome == "skipped" and r.reason.startswith("capability: "), r.describe()
            assert not r.checks and r.describe() == f"{r.test_id}: skipped\n  {r.reason}"
        else:
            assert r.outcome == "passed", r.describe()
    reasons = {r.reason for r in results.values() if r.outcome == "skipped"}
    assert {
        "capability: backward not supported",
        "capability: layered dispatch/combine not supported",
        "capability: static layout (recv_capacity) not supported",
        "capability: output_format mxfp8 not supported",
        "capability: combine_format nvfp4 not supported",
        "capability: intermediate_format nvfp4 not supported",
    } <= reasons
    assert sum(r.outcome == "passed" for r in results.values()) >= 10


def test_input_encoding_and_ep_size_capabilities() -> None:
    class Narrow(ReferenceBackend):
        name = "narrow"
        capabilities = Capabilities(input_formats=frozenset({MoeFormat.BF16}), num_ranks=(2,))

    nvfp4_in = _in_table(Case("forward", 2, 2, 8, input_format="nvfp4", weight_format="mxfp8"))
    r = run_case(Narrow(), nvfp4_in)
    assert (r.outcome, r.reason) == ("skipped", "capability: nvfp4 inputs not supported")
    r = run_case(Narrow(), _in_table(Case("forward", 4, 2, 16)))
    assert (r.outcome, r.reason) == ("skipped", "capability: num_ranks 4 not in [2]")
    assert run_case(Narrow(), _in_table(BASE)).outcome == "passed"


def test_a_raising_backend_fails_the_case() -> None:
    r = run_case(Raises(), _in_table(BASE))  # must not raise
    assert r.outcome == "failed"
    assert r.reason.startswith("backend raised RuntimeError: kernel launch failed: out of shared memory\n")
    assert "Traceback" in r.reason
    assert [c.name for c in r.failures] == ["run"] and r.ratio == float("inf")
    assert r.describe().startswith(
        "forward[raises-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-dynamic]: failed\n"
        "  backend raised RuntimeError: kernel launch failed"
    )


@pytest.mark.parametrize(
    "backend, case, message",
    [
        (
            Float32Output(),
            BASE,
            "rank 0 output: expected ndarray(bfloat16, shape=(6, 64)); got ndarray(float32, shape=(6, 64))",
        ),
        (
            ShortOutput(),
            BASE,
            "rank 0 output: expected ndarray(bfloat16, shape=(6, 64)); got ndarray(bfloat16, shape=(5, 64))",
        ),
        (
            PlainForBlocked(),
            Case("forward", 2, 2, 8, output_format="mxfp8"),
            "rank 0 output: expected BlockScaledTensor(mxfp8, shape=(6, 64), axis=1); "
            "got ndarray(bfloat16, shape=(6, 64))",
        ),
        (
            Float64Grads(),
            Case("backward", 2, 2, 8, clamp=True),
            "rank 0 grad_activation: expected ndarray(float32, shape=(6, 64)); got ndarray(float64, shape=(6, 64))",
        ),
        (
            Int32Counts(),
            Case("dispatch", 2, 2, 8),
            "rank 0 tokens_per_expert: expected ndarray(int64, shape=(4,)); got ndarray(int32, shape=(4,))",
        ),
    ],
    ids=["float32-for-bf16", "short", "plain-for-mxfp8", "float64-grad", "int32-counts"],
)
def test_wrong_type_shape_or_dtype_names_expected_and_got(backend: MoeEpBackend, case: Case, message: str) -> None:
    r = run_case(backend, _in_table(case))
    assert r.outcome == "failed"
    assert r.reason == message
    assert r.ratio == float("inf")
    assert f"  {message}" in r.describe().splitlines()


def test_results_outside_the_budget_fail_with_the_worst_element() -> None:
    case = _in_table(Case("backward", 2, 2, 8, clamp=True))
    r = run_case(Bf16WeightGrad(), case)
    assert r.outcome == "failed"
    assert [c.name for c in r.failures] == ["rank 0 grad_fc2_weight", "rank 1 grad_fc2_weight"]
    assert 1 < r.ratio < float("inf")
    assert r.reason.startswith("rank 0 grad_fc2_weight: worst element (")
    assert " x budget " in r.reason
    # A tolerance factor multiplies every budget (and is recorded).
    loose = run_case(Bf16WeightGrad(), case, tolerance_factor=r.ratio * 1.01)
    assert loose.outcome == "passed" and loose.tolerance_factor == pytest.approx(r.ratio * 1.01)
    assert 0.9 < loose.ratio <= 1.0


def test_a_tolerance_factor_does_not_loosen_exact_results() -> None:
    case = _in_table(Case("dispatch", 2, 2, 8))
    r = run_case(NudgedDispatchWeights(), case, tolerance_factor=1e9)
    assert r.outcome == "failed"
    assert [c.name for c in r.failures] == ["rank 0 topk_weights", "rank 1 topk_weights"]
    assert r.reason.endswith("(must be exact)")


def test_combine_must_not_read_padding_rows() -> None:
    static = run_case(ReadsPadding(), _in_table(Case("combine", 2, 2, 8, layout="static")))
    assert static.outcome == "failed"
    assert "element(s) with NaN/inf where the reference differs" in static.reason
    # In the dynamic layout there are no padding rows, so nothing is poisoned.
    assert run_case(ReadsPadding(), _in_table(Case("combine", 2, 2, 8))).outcome == "passed"


def test_modifying_inputs_fails() -> None:
    r = run_case(Mutates(), _in_table(BASE))
    assert (r.outcome, r.reason) == ("failed", "forward modified its inputs; the spec forbids changing any input")


def test_one_result_per_rank() -> None:
    r = run_case(OneResult(), _in_table(BASE))
    assert (r.outcome, r.reason) == ("failed", "forward returned 1 results; expected one per rank (2)")


def test_bad_input_needs_the_spec_error_class() -> None:
    shape = _in_table(Case("bad_input", 2, 2, 8, bad="activation_shape"))
    dtype = _in_table(Case("bad_input", 2, 2, 8, bad="activation_dtype"))
    ok = run_case(REFERENCE, shape)
    assert ok.outcome == "passed" and ok.checks[0].message.startswith("ShapeError: rank 1: ")
    r = run_case(WrongErrorClass(), shape)
    assert (r.outcome, r.reason) == (
        "failed",
        "bad input 'activation_shape' to forward on rank 1: expected moe_ep_spec.ShapeError; got builtins.ValueError: nope",
    )
    r = run_case(AcceptsAnything(), dtype)
    assert (r.outcome, r.reason) == (
        "failed",
        "bad input 'activation_dtype' to forward on rank 1 was accepted; expected moe_ep_spec.DTypeError",
    )


class ExpertSwapCombine(ReferenceBackend):
    """Wrong on purpose: its combine reads the first row of local expert 1 where the
    first row of expert 0 is, and back."""

    name = "expert-swap-combine"

    def combine(self, config, handles, expert_out):
        swapped = []
        for h, y in zip(handles, expert_out):
            y = np.array(y, copy=True)
            if h.tokens_per_expert[0] and h.tokens_per_expert[1]:
                o0, o1 = int(h.expert_offsets[0]), int(h.expert_offsets[1])
                y[[o0, o1]] = y[[o1, o0]]
            swapped.append(y)
        return super().combine(config, handles, swapped)


def test_rows_between_dispatch_and_combine_are_expert_specific() -> None:
    """The combine cases' expert outputs are an expert- and slot-specific transform of
    the dispatched rows (issue 17, item 4): rows of different experts differ even
    where the dispatched tokens are equal (one token sent to two experts of a rank)."""
    from moe_ep_conformance.runner import _expert_rows

    case = _in_table(Case("combine", 2, 2, 8, routing="one_rank", layout="static"))
    cfg = case.config()
    from moe_ep_conformance.runner import _dispatch_world, _world

    dispatched = REFERENCE.dispatch(cfg, _dispatch_world(_world(case, cfg)))
    rows = _expert_rows(cfg, dispatched)
    meta = dispatched[0].handle.route_metadata
    valid = meta[:, 0] >= 0
    assert np.isnan(rows[0][~valid]).all(), "padding rows must be NaN (never read)"
    key = {}
    for i in np.nonzero(valid)[0]:
        src, tok = int(meta[i, 1]), int(meta[i, 2])
        key.setdefault((src, tok), []).append(rows[0][i])
    shared = [v for v in key.values() if len(v) > 1]
    assert shared, "the case must send some token to two experts of one rank"
    for v in shared:
        assert not np.array_equal(v[0], v[1]), "two routes of one token must not give equal rows"
    r = run_case(ExpertSwapCombine(), case)
    assert r.outcome == "failed", r.describe()


def test_a_nan_scrubbing_backend_is_caught() -> None:
    case = _in_table(Case("nan_isolation", 2, 2, 8, routing="unused_mixed"))
    r = run_case(ScrubsNaN(), case)
    assert r.outcome == "failed", r.describe()
    assert "of the poisoned tokens are finite where the reference is NaN/inf" in r.reason


# ===================================================================== process-per-rank

LOOPBACK = LoopbackReference()


@pytest.fixture(scope="module")
def close_rank_pools():
    yield
    close = getattr(moe_ep_spec.launch, "close_pools", None)
    if close is not None:
        close()


def test_process_per_rank_backend_passes(close_rank_pools: None) -> None:
    cases = [
        _in_table(BASE),
        _in_table(Case("backward", 2, 2, 8, clamp=True)),
        _in_table(Case("combine", 2, 2, 8, layout="static", output_format="mxfp8", combine_format="mxfp8")),
        _in_table(Case("bad_input", 2, 2, 8, bad="expert_id_too_high")),
    ]
    for c in cases:
        r = run_case(LOOPBACK, c, timeout_s=60)
        assert r.outcome == "passed", r.describe()
        assert r.test_id == c.test_id("loopback-reference")


def test_hanging_rank_fails_within_the_timeout(close_rank_pools: None) -> None:
    start = time.monotonic()
    r = run_case(HangingRank(), _in_table(BASE), timeout_s=2)
    assert time.monotonic() - start < 2 + 15
    assert r.outcome == "failed"
    assert r.reason.startswith("backend raised RankTimeoutError: forward: ranks [")
    assert "gave no result within timeout_s = 2; all ranks were stopped" in r.reason


def test_crashing_rank_fails(close_rank_pools: None) -> None:
    r = run_case(CrashingRank(), _in_table(BASE), timeout_s=20)
    assert r.outcome == "failed"
    assert r.reason.startswith("backend raised RankCrashError: forward: rank 1 ended with exit code 17")


def test_isolated_process_per_rank_backend_passes() -> None:
    r = run_case_isolated(LOOPBACK, _in_table(BASE), timeout_s=60)
    assert r.outcome == "passed", r.describe()


# =========================================================================== expectations


def _write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_xfail_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "xfail.txt",
        "# known failures of mybackend\n"
        "\n"
        "forward[mybackend-*-out_nvfp4-*]    # issue 12: scale from a float32 reciprocal\n"
        "   backward[mybackend-ep4-*]\n",
    )
    entries = load_xfail_file(path)
    assert entries == [
        Entry("forward[mybackend-*-out_nvfp4-*]", "issue 12: scale from a float32 reciprocal", f"{path}:3"),
        Entry("backward[mybackend-ep4-*]", "expected failure", f"{path}:4"),
    ]


def test_tolerance_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "tol.txt", "backward[mybackend-*]   4    # fp32 atomics\n\ncombine[*]  0.5e1\n")
    entries = load_tolerance_file(path)
    assert entries == [
        Entry("backward[mybackend-*]", "fp32 atomics", f"{path}:1", 4.0),
        Entry("combine[*]", "", f"{path}:3", 5.0),
    ]


@pytest.mark.parametrize(
    "kind, text, message",
    [
        ("xfail", "forward[a-*]\nforward[b-*] 2\n", "{path}:2: an expected-failure entry is one test-id pattern; got 'forward[b-*] 2'"),
        ("tolerance", "forward[a-*]\n", "{path}:1: a tolerance entry is 'PATTERN FACTOR'; got 'forward[a-*]'"),
        ("tolerance", "# c\nforward[a-*] 2 3\n", "{path}:2: a tolerance entry is 'PATTERN FACTOR'; got 'forward[a-*] 2 3'"),
        ("tolerance", "forward[a-*] two\n", "{path}:1: FACTOR must be a finite number > 0; got 'two'"),
        ("tolerance", "forward[a-*] 0\n", "{path}:1: FACTOR must be a finite number > 0; got 0.0"),
        ("tolerance", "forward[a-*] -2\n", "{path}:1: FACTOR must be a finite number > 0; got -2.0"),
        ("tolerance", "forward[a-*] nan\n", "{path}:1: FACTOR must be a finite number > 0; got nan"),
    ],
)
def test_malformed_expectation_files(tmp_path: Path, kind: str, text: str, message: str) -> None:
    path = _write(tmp_path, f"{kind}.txt", text)
    loader = load_xfail_file if kind == "xfail" else load_tolerance_file
    with pytest.raises(ExpectationError) as info:
        loader(path)
    assert str(info.value) == message.format(path=path)
    assert isinstance(info.value, ValueError)


def test_missing_expectation_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ExpectationError, match=r"^expected-failure file '.*nope\.txt' does not exist$"):
        Expectations.load([missing])
    with pytest.raises(ExpectationError, match=r"^tolerance file '.*nope\.txt' does not exist$"):
        Expectations.load((), [missing])


def test_patterns_treat_brackets_literally() -> None:
    tid = BASE.test_id("mybackend")
    assert Entry("forward[mybackend-*]", "", "x:1").matches(tid)
    assert Entry(tid, "", "x:1").matches(tid)  # an exact id with its brackets
    assert Entry("*[mybackend-ep2-*-noclamp-dynamic]", "", "x:1").matches(tid)
    assert Entry("forward[mybackend-ep?-k2-*]", "", "x:1").matches(tid)
    assert not Entry("forward[mybackend-ep4-*]", "", "x:1").matches(tid)
    assert not Entry("forward[other-*]", "", "x:1").matches(tid)
    assert not Entry("forward[mybackend-*", "", "x:1").matches("forward_stash[mybackend-ep2]")
    # "[ab]" is not a character class: it matches the text "[ab]" only.
    assert Entry("op[ab]", "", "x:1").matches("op[ab]")
    assert not Entry("op[ab]", "", "x:1").matches("opa")
    # The whole id must match, not a prefix.
    assert not Entry("forward", "", "x:1").matches(tid)


def test_stale_entries_and_factors(tmp_path: Path) -> None:
    xf = _write(tmp_path, "xf.txt", "forward[b-*]  # broad\nforward[b-ep2-*]  # shadowed by line 1\nbackward[b-*]\n")
    tol = _write(tmp_path, "tol.txt", "forward[b-*] 2\nforward[b-ep2-*] 3\ncombine[b-*] 8\n")
    exp = Expectations.load([xf], [tol])
    tid = BASE.test_id("b")
    assert exp.xfail_for(tid) == Entry("forward[b-*]", "broad", f"{xf}:1")  # the first match wins
    assert exp.xfail_for("dispatch[b-ep2]") is None
    assert exp.factor_for(tid) == 6.0  # every matching factor, multiplied
    assert exp.factor_for("dispatch[b-ep2]") == 1.0
    assert [e.source for e in exp.stale()] == [f"{xf}:2", f"{xf}:3", f"{tol}:3"]


# ================================================================================ reports


def _result(case: Case, outcome: str, reason: str = "", ratio: float = 0.0, checks: Sequence[Check] = ()) -> CaseResult:
    return CaseResult(case.test_id("demo"), "demo", case, outcome, reason, ratio, list(checks), 0.25, 1.0)


def _demo_report(tmp_path: Path) -> Report:
    fwd2 = Case("forward", 2, 2, 8)
    fwd2b = Case("forward", 2, 2, 8, routing="skewed")
    fwd4 = Case("forward", 4, 2, 16, output_format="mxfp8")
    bwd = Case("backward", 2, 2, 8, clamp=True)
    comb = Case("combine", 2, 2, 8, layout="static")
    records = [
        Record(_result(fwd2, "passed", ratio=0.5, checks=[Check("rank 0 output", True, 0.5, 1e-3)]), "passed"),
        Record(
            _result(
                fwd2b,
                "failed",
                "rank 0 output: worst | element\nsecond line",
                float("inf"),
                [Check("rank 0 output", False, float("inf"), 2.0, "rank 0 output: worst | element")],
            ),
            "failed",
        ),
        Record(_result(fwd4, "skipped", "capability: output_format mxfp8 not supported"), "skipped"),
        Record(_result(bwd, "failed", "rank 1 grad_fc2_weight: 3 x budget", 3.0), "xfailed", "issue 12"),
        Record(_result(comb, "passed"), "xpassed", "issue 13"),
    ]
    meta = {"version": "1.2", "distribution": "demo-dist", "launch": "world", "devices": ["cpu"],
            "capabilities": {}, "framework_versions": {"numpy": "9.9"}}
    stale = [Entry("dispatch[demo-*]", "old", "xf.txt:4")]
    return Report(backends={"demo": meta}, records=records, stale=stale, environment={"MOE_EP_X": "1"})


def test_report_json(tmp_path: Path) -> None:
    report = _demo_report(tmp_path)
    data = report.to_json()
    assert data["schema"] == "moe-ep-conformance/1"
    assert data["environment"] == {"MOE_EP_X": "1"}
    assert data["backends"]["demo"]["version"] == "1.2"
    assert data["summary"] == {"demo": {"passed": 1, "failed": 1, "skipped": 1, "xfailed": 1, "xpassed": 1}}
    assert data["stale_expectations"] == [{"pattern": "dispatch[demo-*]", "source": "xf.txt:4", "reason": "old"}]
    cases = {c["id"].split("[")[0] + "/" + c["outcome"]: c for c in data["cases"]}
    assert set(cases) == {"forward/passed", "forward/failed", "forward/skipped", "backward/xfailed", "combine/xpassed"}
    passed = cases["forward/passed"]
    assert set(passed) == {"id", "backend", "case", "params", "outcome", "reason", "error_over_budget",
                           "max_abs_error", "tolerance_factor", "duration_s", "checks"}
    assert passed["id"] == "forward[demo-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-uniform-even-w_fc1-noclamp-dynamic]"
    assert passed["case"] == passed["id"][len("forward[demo-"):-1]
    assert passed["params"]["num_ranks"] == 2 and passed["params"]["op"] == "forward"
    assert passed["error_over_budget"] == 0.5 and passed["max_abs_error"] == 1e-3
    assert passed["checks"] == [{"name": "rank 0 output", "ok": True, "error_over_budget": 0.5, "max_abs_error": 1e-3}]
    assert cases["forward/failed"]["error_over_budget"] == "inf"  # JSON has no infinity
    assert cases["forward/skipped"]["reason"] == "capability: output_format mxfp8 not supported"
    assert cases["backward/xfailed"]["reason"] == "issue 12"  # the expectation's reason
    json.dumps(data, allow_nan=False)
    path = tmp_path / "r.json"
    report.write_json(str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(data))


def test_report_names_worst_case_time_and_skip_reasons(tmp_path: Path) -> None:
    report = _demo_report(tmp_path)
    line = report.summary_line("demo", "1.2")
    assert line.startswith("demo 1.2: 1 passed, 1 failed, 1 skipped, 1 xfailed, 1 xpassed in 1.2 s; "
                           "worst passing error/budget 0.5 (forward[demo-ep2-k2-e8-"), line
    assert "check 'rank 0 output', 0.25 s)" in line and "; slowest case " in line
    assert report.skip_reasons("demo") == [
        ("capability: output_format mxfp8 not supported", 1, Case("forward", 4, 2, 16, output_format="mxfp8").test_id("demo"))
    ]
    md = report.to_markdown().splitlines()
    skipped = md[md.index("### Skipped") + 2]
    assert skipped.startswith("- 1 case(s): capability: output_format mxfp8 not supported (e.g. `forward[demo-ep4-")
    assert any(x.startswith("Time: 1.2 s. Worst passing case: `forward[demo-ep2-") and "check 'rank 0 output'" in x
               for x in md)
    details = report.to_json()["details"]["demo"]
    assert details["worst_passing"]["check"] == "rank 0 output"
    assert details["skip_reasons"][0]["reason"] == "capability: output_format mxfp8 not supported"
    report.plugin_failures = ["plugin 'broken' (distribution broken-dist) failed at import: ImportError: no libfoo.so"]
    md = report.to_markdown()
    assert "## Plugins that failed to load" in md and "ImportError: no libfoo.so" in md
    assert report.to_json()["plugin_failures"] == report.plugin_failures


def test_a_plugin_that_failed_to_load_is_named_when_asked_for() -> None:
    from moe_ep_conformance.usage import lookup_backend, plugin_failures
    from moe_ep_spec.registry import PluginFailure

    class Registry:
        def get_backend(self, name):
            raise moe_ep_spec.BackendNotFoundError(name, ["reference"], None)

        def failures(self):
            return (PluginFailure("broken", "broken-dist", "import", ImportError("libfoo.so: cannot open")),)

    with pytest.raises(moe_ep_spec.BackendError) as info:
        lookup_backend(Registry(), "broken")
    assert str(info.value) == (
        "backend 'broken' cannot be tested: its plugin 'broken' (distribution broken-dist) failed to import: "
        "ImportError: libfoo.so: cannot open"
    )
    with pytest.raises(moe_ep_spec.BackendNotFoundError):
        lookup_backend(Registry(), "other")
    assert plugin_failures(Registry()) == [
        "plugin 'broken' (distribution broken-dist) failed at import: ImportError: libfoo.so: cannot open"
    ]


def test_report_markdown(tmp_path: Path) -> None:
    report = _demo_report(tmp_path)
    md = report.to_markdown()
    lines = md.splitlines()
    assert lines[0] == "# MoeEp conformance report"
    assert "## demo 1.2" in lines
    assert "Launch: world; devices: cpu; distribution: demo-dist; frameworks: numpy 9.9." in lines
    assert "Totals: 1 passed, 1 failed, 1 skipped, 1 xfailed, 1 xpassed. Worst error/budget of a passing case: 0.5." in lines
    table = [line for line in lines if line.startswith("|")]
    assert table == [
        "| operation | ep2 bf16 | ep4 mxfp8 |",
        "|---|---|---|",
        "| forward | **1/1/0 · inf** | 0/0/1 |",
        "| backward | 0/0/0 (1 xf) · 3 |  |",
        "| combine | **0/1/0 · 0** |  |",
    ]
    failures = lines[lines.index("### Failures") + 2:]
    assert failures[0] == (
        "- `forward[demo-ep2-k2-e8-out_bf16-comb_bf16-in_bf16-wt_bf16-skewed-even-w_fc1-noclamp-dynamic]` (failed): "
        "rank 0 output: worst \\| element"
    )
    assert failures[1].startswith("- `combine[demo-") and failures[1].endswith("` (xpassed): ")
    assert "## Stale expectation entries" in lines
    assert "- `dispatch[demo-*]` (xf.txt:4) matched no test" in lines
    assert lines[-1].startswith("Cells: passed / failed / skipped (xfailed)")
    path = tmp_path / "r.md"
    report.write_markdown(str(path))
    assert path.read_text() == md


# ==================================================================================== CLI


def test_cli_options_become_pytest_arguments(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["conformance", "--backend", "a", "--backend", "b", "--ep-size", "2", "--ep-size", "4", "-k", "forward",
         "--quick", "--report-json", "j.json", "--report-md", "m.md", "--xfail-file", "x.txt",
         "--tolerance-file", "t.txt", "--timeout", "7", "--isolate", "-x", "-vv", "--junitxml", "ju.xml"]
    )
    argv = pytest_args(args)
    assert argv[0].endswith(os.path.join("moe_ep_conformance", "suite.py"))
    assert ["-p", "moe_ep_conformance.plugin"] == argv[1:3]
    assert "python_functions=" + " ".join(OPERATIONS) in argv
    joined = " ".join(argv)
    for expected in (
        "--backend a --backend b",
        "--ep-size 2 --ep-size 4",
        "-k forward",
        "--quick",
        f"--report-json {os.path.abspath('j.json')}",
        f"--report-md {os.path.abspath('m.md')}",
        f"--junitxml {os.path.abspath('ju.xml')}",
        f"--xfail-file {os.path.abspath('x.txt')}",
        f"--tolerance-file {os.path.abspath('t.txt')}",
        "--case-timeout 7.0",
        "--isolate",
        " -x",
        " -vv",
    ):
        assert expected in joined, expected
    defaults = pytest_args(parser.parse_args(["conformance"]))
    assert "--case-timeout" in defaults and defaults[defaults.index("--case-timeout") + 1] == "120.0"
    assert not {"--quick", "--isolate", "-x", "--backend", "-k"} & set(defaults)


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MOE_EP_LOAD_PLUGINS="reference", MOE_EP_TEST_MARKER="1")
    env.pop("MOE_EP_BACKEND", None)
    return subprocess.run(
        [sys.executable, "-m", "moe_ep_spec.cli", "conformance", "--backend", "reference", *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )


def _header_ok(stdout: str) -> None:
    lines = stdout.splitlines()
    assert any(
        line.startswith(f"backend reference {REFERENCE.version} (moe-ep-spec): launch world") for line in lines
    ), stdout
    env_line = next(line for line in lines if line.startswith("environment:"))
    assert "MOE_EP_TEST_MARKER=1" in env_line and "MOE_EP_LOAD_PLUGINS=reference" in env_line


def test_cli_strict_xpass_and_stale_entry(tmp_path: Path) -> None:
    passing = BASE.test_id("reference")
    assert passing in {c.test_id("reference") for c in QUICK}
    stale = "combine[reference-*-no_such_axis-*]"
    (tmp_path / "xfail.txt").write_text(f"{passing}   # issue 7: believed broken\n{stale}\n")
    proc = _cli(tmp_path, "--quick", "--report-json", "r.json", "--report-md", "r.md", "--xfail-file", "xfail.txt")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    _header_ok(out)
    assert f"reference {REFERENCE.version}: {len(QUICK) - 1} passed, 0 failed, 0 skipped, 0 xfailed, 1 xpassed" in out
    assert "[XPASS(strict)] issue 7: believed broken" in out
    assert f"STALE expectation '{stale}' ({tmp_path / 'xfail.txt'}:2) matched no test" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["reference"] == {"passed": len(QUICK) - 1, "failed": 0, "skipped": 0, "xfailed": 0, "xpassed": 1}
    outcomes = {c["id"]: c["outcome"] for c in data["cases"]}
    assert len(outcomes) == len(QUICK) and outcomes[passing] == "xpassed"
    assert [e["pattern"] for e in data["stale_expectations"]] == [stale]
    assert data["environment"]["MOE_EP_TEST_MARKER"] == "1"
    md = (tmp_path / "r.md").read_text()
    assert f"- `{passing}` (xpassed): " in md
    assert f"- `{stale}` ({tmp_path / 'xfail.txt'}:2) matched no test" in md


def test_cli_keyword_selection(tmp_path: Path) -> None:
    (tmp_path / "tol.txt").write_text("dispatch_backward[reference-ep2-*]  2  # widened on purpose\n")
    proc = _cli(tmp_path, "-k", "dispatch and ep2", "--report-json", "r.json", "--tolerance-file", "tol.txt",
                "--junitxml", "junit.xml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _header_ok(proc.stdout)
    wanted = {c.test_id("reference") for c in FULL}
    wanted = {t for t in wanted if "dispatch" in t and "ep2" in t}
    data = json.loads((tmp_path / "r.json").read_text())
    got = {c["id"] for c in data["cases"]}
    assert got == wanted
    assert {t.split("[")[0] for t in got} == {"dispatch", "dispatch_backward", "bad_input"}
    assert all(c["outcome"] == "passed" for c in data["cases"])
    factors = {c["id"]: c["tolerance_factor"] for c in data["cases"]}
    assert all(f == (2.0 if t.startswith("dispatch_backward[") else 1.0) for t, f in factors.items())
    assert data["stale_expectations"] == []
    assert f'tests="{len(wanted)}"' in (tmp_path / "junit.xml").read_text()


def test_cli_usage_errors_stop_before_the_run(tmp_path: Path) -> None:
    proc = _cli(tmp_path, "--ep-size", "8")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr == "moe-ep: error: --ep-size 8: the full table has no case with that EP size; it has EP sizes 1, 2, 3, 4\n"
    proc = _cli(tmp_path, "--quick", "--report-md", "no/such/dir/r.md")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--report-md no/such/dir/r.md: cannot write the report there: the directory " in proc.stderr
    proc = _cli(tmp_path, "--quick", "--report-json", str(tmp_path))
    assert proc.returncode == 2 and "cannot write the report there: it is a directory" in proc.stderr


def test_cli_output_names_no_install_paths(tmp_path: Path) -> None:
    proc = _cli(tmp_path, "--quick", "--ep-size", "3", "-v")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    _header_ok(out)
    for leak in ("rootdir:", "configfile:", "site-packages", "dist-packages", str(Path(__file__).parents[1] / "conformance")):
        assert leak not in out, leak
    assert "suite.py::forward[reference-ep3-" in out
    assert "deselected" in out and "skipped" not in out.split("MoeEp conformance summary")[-1].split(" in ")[-1]
    line = next(x for x in out.splitlines() if x.startswith(f"reference {REFERENCE.version}: "))
    assert " 0 skipped, 0 xfailed, 0 xpassed in " in line and "; slowest case " in line


def test_cli_deselected_tolerance_entry_is_not_stale(tmp_path: Path) -> None:
    (tmp_path / "tol.txt").write_text("forward[reference-*]  2\n")
    (tmp_path / "xfail.txt").write_text("backward[reference-*]\n")
    proc = _cli(tmp_path, "--quick", "-k", "nan_isolation", "--tolerance-file", "tol.txt", "--xfail-file", "xfail.txt")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "xfail.txt:1) matched no test" not in proc.stdout  # holds today
    assert "tol.txt:1) matched no test" not in proc.stdout  # fails today


# ========================================================================== isolated runs


class HangingWorld(ReferenceBackend):
    """A world backend whose forward never returns."""

    name = "hanging-world"

    def forward(self, config, inputs):
        time.sleep(3600)
        return super().forward(config, inputs)


class CrashingWorld(ReferenceBackend):
    """A world backend whose forward kills its process."""

    name = "crashing-world"

    def forward(self, config, inputs):
        os._exit(3)


ISOLATED_TIMEOUT_S = 1.0


_ISOLATED_RUNS: Dict[str, Any] = {}


def _isolated_run(key: str) -> Any:
    """``(result, seconds)`` of run_case_isolated on the hanging or the crashing world
    backend, run once and kept for the tests that judge it. In the test's own thread:
    runs in a background thread, concurrent with the other tests' process starts, twice
    left the hanging case's process dead with exit code 255 before it ran (in CI and
    here), which is not what these tests are about."""
    if key not in _ISOLATED_RUNS:
        backend = {"hang": HangingWorld, "crash": CrashingWorld}[key]()
        start = time.monotonic()
        result = run_case_isolated(backend, _in_table(BASE), timeout_s=ISOLATED_TIMEOUT_S)
        _ISOLATED_RUNS[key] = (result, time.monotonic() - start)
    return _ISOLATED_RUNS[key]


def test_isolated_world_backend_passes() -> None:
    r = run_case_isolated(REFERENCE, _in_table(BASE), timeout_s=60)
    assert r.outcome == "passed", r.describe()


def test_isolated_hang_becomes_a_failed_case() -> None:
    result, elapsed = _isolated_run("hang")
    assert result.outcome == "failed"
    assert result.reason == "no result within timeout_s = 1: the backend hung"
    assert [c.name for c in result.checks] == ["run"] and result.ratio == float("inf")
    assert elapsed < ISOLATED_TIMEOUT_S + 60  # the runner waits timeout_s + 10 s of start-up; the rest is slack


def test_isolated_crash_becomes_a_failed_case() -> None:
    result, _ = _isolated_run("crash")
    assert result.outcome == "failed"
    assert result.reason == "the case's process died with exit code 3 and no result"


def test_isolated_hang_is_reported_within_timeout_s() -> None:
    _, elapsed = _isolated_run("hang")
    assert elapsed < ISOLATED_TIMEOUT_S + 15  # 15 s for spawning the process and importing numpy
