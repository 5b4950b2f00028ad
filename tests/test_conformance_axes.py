"""The conformance table as axes (``moe_ep_conformance.axes``): the pairwise
covering array, its coverage report, the boundary and validation cases, both
backward modes, and the module structure (no import circle)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moe_ep_spec
from moe_ep_conformance import BAD_INPUTS, Case, full_cases, quick_cases, run_case
from moe_ep_conformance.axes import (
    AXES,
    OP_AXES,
    QUICK_AXES,
    axis_values,
    coverage,
    fill,
    forbidden,
    format_coverage,
    grid_rows,
)
from moe_ep_conformance.cases import RUN_OPS, _grid_case

REFERENCE = moe_ep_spec.get_backend("reference")
FULL = full_cases()
QUICK = quick_cases()
PACKAGE = Path(__file__).resolve().parents[1] / "conformance" / "moe_ep_conformance"


# ============================================================================ the covering array


def test_every_pair_that_can_be_built_is_covered() -> None:
    for cov in coverage(FULL):
        assert not cov.missing, (cov.op, cov.missing[:5])
        # only the spec's own rules rule a pair out: no size pair is lost to the reference's time
        assert all("reference's time" not in reason for reason in cov.cannot.values()), (cov.op, cov.cannot)
        assert len(cov.covered) > 0.99 * cov.total, cov.op
    for cov in coverage(QUICK, quick=True):
        assert not cov.missing, (cov.op, cov.missing[:5])


def test_the_size_axes_meet_every_feature() -> None:
    """The combinations issue 39 found missing are in the table."""
    table = [c for c in FULL if c.op in RUN_OPS]

    def has(op: str, **want: object) -> bool:
        return any(c.op == op and all(axis_values(c)[k] == v for k, v in want.items()) for c in table)

    for rows in ("r160", "r300"):
        assert has("backward", rows=rows), rows
    for hidden in (1536, 2560):
        assert has("backward", hidden=hidden) and has("forward", hidden=hidden), hidden
    for inter in ("bf16", "mxfp8", "nvfp4", None):
        assert has("forward", intermediate=384, intermediate_format=inter), inter
    for clamp in (0.75, 7.3):
        for weights_in in ("fc1", "fc2"):
            assert has("forward", intermediate=512, clamp=clamp) and has("backward", intermediate=384, weights_in=weights_in)
    for act in ("fp16", "fp32"):
        assert has("forward", input_format=act, hidden=1024) and has("forward", input_format=act, hidden=2560), act
    for k in (5, 8):
        assert has("forward", num_topk=k, hidden=1024) and has("backward", num_topk=k, hidden=512), k
    # an expert holding more than 128 rows (not a multiple of 64) in the backward
    assert any(c.op == "backward" and c.tokens == "full" and c.max_tokens * c.num_topk / (c.num_experts // c.num_ranks) > 128
               and c.max_tokens * c.num_topk % 64 for c in table)


def test_quick_covers_the_kernel_relevant_axes_at_realistic_sizes() -> None:
    for op in QUICK_AXES:
        mine = [axis_values(c) for c in QUICK if c.op == op]
        for axis, values in QUICK_AXES[op].items():
            assert {v[axis] for v in mine} >= set(values), (op, axis)
    assert any(c.op == "backward" and c.hidden >= 1536 for c in QUICK)
    assert any(c.op == "forward" and c.intermediate > 256 for c in QUICK)
    assert any(c.op == "backward" and axis_values(c)["rows"] == "r160" for c in QUICK)


def test_grid_ids_are_their_values() -> None:
    """A generated case's id is a function of its axis values, never of the
    generator's order: rebuilding the case from the values gives the same id."""
    for quick in (False, True):
        for op, values in grid_rows(quick):
            case = _grid_case(op, values, quick)
            again = _grid_case(op, dict(reversed(list(fill(values).items()))), quick)
            assert again.id == case.id
            assert case in FULL


def test_pinned_grid_ids() -> None:
    """The generated table is the same on every machine (allpairspy pinned in
    constraints.txt): the fourth backward row of the covering array, by id."""
    ids = {c.test_id("reference") for c in FULL}
    fourth = [_grid_case(op, v, False) for op, v in grid_rows(False) if op == "backward"][3]
    assert fourth.test_id("reference") in ids
    assert fourth.id == (
        "ep4-k5-e32-h512-i128-out_bf16-comb_bf16-int_nvfp4-in_mxfp8-wt_mxfp8-tw_fp16-unused_mixed-even-w_fc1-"
        "clamp7.3-static-ct_fp16-strided-bop_bf16-large"
    )


def test_forbidden_names_the_rule() -> None:
    assert "num_topk <= num_experts" in (forbidden("forward", {"num_topk": 8, "local_experts": 1}) or "")
    assert "two slots" in (forbidden("forward", {"num_topk": 1, "routing": "repeated"}) or "")
    assert forbidden("forward", {"num_topk": 8, "num_ranks": 1}) is None  # 8 local experts allow it
    assert "reference's time" in (forbidden("backward", {"hidden": 2560, "intermediate": 512, "rows": "r300",
                                                         "num_ranks": 4, "local_experts": 8}) or "")
    assert set(AXES["backward_operand_format"]) == {None, "bf16"} and "backward_operand_format" in OP_AXES["backward"]


def test_coverage_report_text() -> None:
    text = format_coverage(coverage(QUICK, quick=True))
    assert "forward:" in text and "pairs of axis values covered" in text
    assert text.splitlines()[-1] == "every pair that can be built is covered"
    # a table with one case misses pairs, and says so
    few = format_coverage(coverage([c for c in FULL if c.op == "dispatch"][:1]))
    assert "MISSING: " in few and few.splitlines()[-1].endswith("pair(s) missing")


def test_cli_coverage(tmp_path: Path) -> None:
    env = dict(os.environ, MOE_EP_LOAD_PLUGINS="reference")
    proc = subprocess.run([sys.executable, "-m", "moe_ep_spec.cli", "conformance", "--coverage", "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"coverage of the --quick table: {len(QUICK)} cases")
    assert "every pair that can be built is covered" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "moe_ep_spec.cli", "conformance", "--coverage", "--ep-size", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "only at the EP sizes not selected" in proc.stdout and "MISSING" not in proc.stdout


# ============================================================================ boundaries and validation


def test_every_limit_is_met_and_passed() -> None:
    by_op = {op: [c for c in FULL if c.op == op] for op in RUN_OPS}
    for op, cases in by_op.items():
        assert any(c.capacity == "exact" for c in cases), op
        assert {c.layout for c in cases if c.tokens == "full"} == {"dynamic", "static"}, op
        assert any(c.routing == "id_edges" for c in cases), op
    bad = {c.bad: c for c in FULL if c.op == "bad_input"}
    for kind in ("recv_capacity_short", "forward_recv_capacity_short", "backward_recv_capacity_short",
                 "expert_id_too_high", "expert_id_below_minus_one", "dispatch_expert_id_below_minus_one",
                 "backward_expert_id_below_minus_one", "hidden_not_mxfp8_multiple", "intermediate_not_nvfp4_multiple"):
        assert kind in bad, kind
    for kind in ("too_many_tokens", "dispatch_too_many_tokens", "backward_too_many_tokens"):
        assert {c.layout for c in FULL if c.op == "bad_input" and c.bad == kind} == {"dynamic", "static"}, kind
    assert {c.op for c in FULL if c.values == "clamp_edges"} >= {"forward", "forward_stash", "backward"}


@pytest.mark.parametrize("op", ["dispatch", "forward", "backward"])
def test_capacity_exact_passes_and_one_aligned_row_short_fails(op: str) -> None:
    exact = Case(op, 3, 3, 9, layout="static", capacity="exact", routing="repeated", tokens="uneven")
    prefix = "" if op == "dispatch" else f"{op}_"
    short = Case("bad_input", 3, 3, 9, bad=f"{prefix}recv_capacity_short", layout="static", routing="repeated",
                 tokens="uneven")
    assert exact in FULL and short in FULL
    assert run_case(REFERENCE, exact).outcome == "passed"
    result = run_case(REFERENCE, short)
    assert result.outcome == "passed", result.describe()
    assert "CapacityError" in result.checks[0].message


def test_clamp_edges_put_fc1_on_the_clamp() -> None:
    from moe_ep_conformance.runner import _world

    case = Case("backward", 2, 2, 8, values="clamp_edges", clamp=True, input_format="fp32", weight_format="fp32")
    assert case in FULL
    cfg = case.config()
    world = _world(case, cfg)
    c = np.asarray(world[0].activation, np.float64) @ np.asarray(world[0].fc1_weight[0], np.float64)
    limit = np.float32(0.75)
    assert (c == limit).any() and (c == -limit).any() and (c == np.nextafter(limit, np.float32(1))).any()
    assert run_case(REFERENCE, case).outcome == "passed"


#: Every array argument of every operation, and the bad-input kinds of its wrong shape and wrong dtype.
ARGUMENTS = {
    ("forward", "activation"): ("activation_shape", "activation_dtype"),
    ("forward", "fc1_weight"): ("weight_shape", "weight_dtype"),
    ("forward", "fc2_weight"): ("fc2_weight_shape", "fc2_weight_dtype"),
    ("forward", "topk_idx"): ("topk_idx_shape", "topk_idx_dtype"),
    ("forward", "topk_weights"): ("topk_weights_shape", "topk_weights_dtype"),
    ("dispatch", "tokens"): ("dispatch_tokens_shape", "dispatch_tokens_dtype"),
    ("dispatch", "topk_idx"): ("dispatch_topk_idx_shape", "dispatch_topk_idx_dtype"),
    ("dispatch", "topk_weights"): ("dispatch_topk_weights_shape", "dispatch_topk_weights_dtype"),
    ("backward", "activation"): ("backward_activation_shape", "backward_activation_dtype"),
    ("backward", "fc1_weight"): ("backward_weight_shape", "backward_weight_dtype"),
    ("backward", "fc2_weight"): ("backward_fc2_weight_shape", "backward_fc2_weight_dtype"),
    ("backward", "topk_idx"): ("backward_topk_idx_shape", "backward_topk_idx_dtype"),
    ("backward", "topk_weights"): ("backward_topk_weights_shape", "backward_topk_weights_dtype"),
    ("backward", "grad_output"): ("backward_grad_shape", "backward_grad_dtype"),
    ("backward", "fc1_c"): ("backward_stash_rows", "backward_stash_dtype"),
    ("backward", "route_metadata"): ("backward_route_metadata_shape", "backward_route_metadata_dtype"),
    ("combine", "expert_out"): ("combine_expert_out_shape", "combine_expert_out_dtype"),
    ("dispatch_backward", "grad_tokens"): ("dispatch_backward_grad_shape", "dispatch_backward_grad_tokens_dtype"),
    ("dispatch_backward", "grad_topk_weights"): ("dispatch_backward_grad_weights_shape",
                                                 "dispatch_backward_grad_dtype"),
    ("combine_backward", "grad_output"): ("combine_backward_grad_shape", "combine_backward_grad_dtype"),
}


def test_every_array_argument_gets_wrong_shape_wrong_dtype_and_strided() -> None:
    table = {c.bad for c in FULL if c.op == "bad_input"}
    for (op, arg), kinds in ARGUMENTS.items():
        for kind in kinds:
            assert kind in BAD_INPUTS and BAD_INPUTS[kind][0] == op and kind in table, (op, arg, kind)
        assert BAD_INPUTS[kinds[0]][1] == "ShapeError" and BAD_INPUTS[kinds[1]][1] == "DTypeError", (op, arg)
    # non-contiguous: every operation, block-scaled codes and scales and the stash included
    for op in RUN_OPS:
        assert any(c.op == op and c.strided for c in FULL), op
    for fmt in ("mxfp8", "nvfp4"):
        assert any(c.op == "backward" and c.strided and c.input_format == fmt for c in FULL), fmt
        assert any(c.op == "forward" and c.strided and c.weight_format == fmt for c in FULL), fmt


def test_strided_cases_stride_block_scaled_tensors_and_the_stash() -> None:
    from moe_ep_conformance.runner import _stash_arg, _world

    case = next(c for c in FULL if c.op == "backward" and c.strided and c.input_format == "mxfp8")
    world = _world(case, case.config())
    act = world[0].activation
    assert not act.data.flags.c_contiguous and not act.scale.flags.c_contiguous
    stash = _stash_arg(case, [f.stash for f in REFERENCE.forward(case.config(), world)])
    assert not stash[0].fc1_c.flags.c_contiguous and not stash[0].route_metadata.flags.c_contiguous


@pytest.mark.parametrize("kind", sorted(k for k in BAD_INPUTS if k.startswith(("backward_", "dispatch_backward_"))
                                        or k in ("fc2_weight_dtype", "topk_weights_shape", "weight_wrong_axis",
                                                 "weight_block_scale_mismatch", "dispatch_tokens_shape")))
def test_the_reference_rejects_every_bad_argument(kind: str) -> None:
    case = next(c for c in FULL if c.op == "bad_input" and c.bad == kind)
    result = run_case(REFERENCE, case)
    assert result.outcome == "passed", result.describe()


# ============================================================================ both backward modes


def test_every_backward_case_in_both_modes() -> None:
    backward = [c for c in FULL if c.op == "backward"]
    modes = {c.backward_operand_format for c in backward}
    assert modes == {None, "bf16"}
    grid = {_grid_case(op, v, q).id for q in (False, True) for op, v in grid_rows(q)}
    for c in backward:
        if c.id in grid:
            continue  # the covering array has the mode as an axis
        twin = c.__class__(**{**{f: getattr(c, f) for f in c.__dataclass_fields__ if f != "quick"},
                              "backward_operand_format": "bf16" if c.backward_operand_format is None else None})
        assert twin in FULL, c.id
    assert "bop_bf16" in Case("backward", 2, 2, 8, backward_operand_format="bf16").id


# ============================================================================ module structure


def _imports(name: str) -> set:
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    out = set()
    for node in tree.body:  # module level only
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.add(node.module)
    return out


def test_no_import_circle_among_the_tables_and_the_runner() -> None:
    assert _imports("checks") == set()
    assert _imports("axes") == set()
    assert _imports("format_cases") <= {"checks"}
    assert _imports("cases") <= {"axes", "format_cases"}
    assert "runner" not in _imports("cases") | _imports("format_cases")
    for name in ("cases", "format_cases", "axes", "checks"):  # no import inside a function either
        assert "from .runner" not in (PACKAGE / f"{name}.py").read_text(), name
    for name in ("format_cases", "axes", "checks"):
        assert "from .cases" not in (PACKAGE / f"{name}.py").read_text(), name


def test_tie_cases_put_w_h_and_dc_on_bf16_ties() -> None:
    from moe_ep_conformance.runner import _world

    case = Case("backward", 2, 2, 8, values="bf16_ties", input_format="fp32", weight_format="fp32",
                backward_operand_format="bf16")
    assert case in FULL and {c.backward_operand_format for c in FULL if c.values == "bf16_ties"} == {None, "bf16"}
    cfg = case.config()
    w = _world(case, cfg)[0]
    x, w1, w2 = (np.asarray(a, np.float32) for a in (w.activation, w.fc1_weight, w.fc2_weight))
    i = cfg.intermediate

    def ties(v: np.ndarray) -> float:  # float32 values halfway between two bf16 numbers
        return float(((np.asarray(v, np.float32).view(np.uint32) & 0xFFFF) == 0x8000).mean())

    for t in range(3):
        e = int(w.topk_idx[t, 0]) % cfg.num_local_experts
        c = x[t] @ w1[e]
        g, u = c[:i], c[i:]
        sig = np.float32(1) / (np.float32(1) + np.exp(-g))
        h = g * sig * u
        wh = np.float32(1.5) * h
        dh = w2[e][:, t] * np.float32(1.5)  # one-hot cotangent row t
        assert ties(wh) > 0.5 and ties(dh * g * sig) > 0.5, t
    for c in (case, Case("backward", 2, 2, 8, values="bf16_ties", input_format="fp32", weight_format="fp32")):
        assert run_case(REFERENCE, c).outcome == "passed"
