"""Validation rules and derived values of :class:`MoeEpConfig` (design brief section 1)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from moe_ep_spec import ConfigError, FormatError, MoeEpConfig, MoeEpError, MoeFormat

BASE = dict(num_experts=8, hidden=64, intermediate=32, num_topk=2)


def make(**changes):
    return MoeEpConfig(**{**BASE, **changes})


# ============================================================================ valid configs


def test_defaults():
    c = make()
    assert (c.num_experts, c.hidden, c.intermediate, c.num_topk, c.num_ranks) == (8, 64, 32, 2, 1)
    assert c.max_tokens_per_rank is None
    assert c.output_format is MoeFormat.BF16 and c.combine_format is MoeFormat.BF16
    assert c.intermediate_format is None
    assert c.apply_topk_in_fc1 is True and c.generate_c is False
    assert c.gate_up_clamp is None and c.recv_capacity is None and c.expert_alignment == 1
    assert c.static_layout is False


def test_format_strings_are_parsed():
    c = make(output_format="mxfp8", combine_format="NVFP4", intermediate_format="Bf16")
    assert c.output_format is MoeFormat.MXFP8
    assert c.combine_format is MoeFormat.NVFP4
    assert c.intermediate_format is MoeFormat.BF16
    assert c == make(output_format=MoeFormat.MXFP8, combine_format=MoeFormat.NVFP4, intermediate_format=MoeFormat.BF16)


def test_numpy_integers_and_bools_are_normalised():
    c = make(num_experts=np.int64(8), hidden=np.int32(64), num_topk=np.uint8(2), apply_topk_in_fc1=np.bool_(False),
             max_tokens_per_rank=np.int16(5))
    assert type(c.num_experts) is int and type(c.hidden) is int and type(c.num_topk) is int
    assert type(c.max_tokens_per_rank) is int and c.max_tokens_per_rank == 5
    assert c.apply_topk_in_fc1 is False
    assert c == make(apply_topk_in_fc1=False, max_tokens_per_rank=5)


@pytest.mark.parametrize("k", [1, 8])
def test_top_k_bounds_inclusive(k):
    assert make(num_topk=k).num_topk == k


@pytest.mark.parametrize(
    "fmt_field,fmt,hidden",
    [("output_format", "mxfp8", 32), ("output_format", "nvfp4", 16), ("combine_format", "mxfp8", 96),
     ("combine_format", "nvfp4", 48), ("output_format", "bf16", 7)],
)
def test_hidden_multiples_accepted(fmt_field, fmt, hidden):
    assert make(**{fmt_field: fmt, "hidden": hidden}).hidden == hidden


def test_intermediate_multiples_accepted():
    assert make(intermediate_format="mxfp8", intermediate=64).intermediate == 64
    assert make(intermediate_format="nvfp4", intermediate=48).intermediate == 48
    assert make(intermediate_format="bf16", intermediate=3).intermediate == 3
    # intermediate is not constrained by the output/combine formats
    assert make(output_format="mxfp8", combine_format="nvfp4", intermediate=5).intermediate == 5
    # nor hidden by the intermediate format
    assert make(intermediate_format="mxfp8", hidden=5).hidden == 5


@pytest.mark.parametrize("given,stored", [(2.5, 2.5), (-2.5, 2.5), (7, 7.0), (-1e-30, 1e-30), (np.float32(-3.5), 3.5),
                                          (np.int64(-4), 4.0)])
def test_gate_up_clamp_stored_as_abs(given, stored):
    c = make(gate_up_clamp=given)
    assert c.gate_up_clamp == stored and type(c.gate_up_clamp) is float


def test_static_layout_fields():
    c = make(recv_capacity=128, expert_alignment=16)
    assert c.static_layout is True and c.recv_capacity == 128 and c.expert_alignment == 16
    assert make(recv_capacity=1).recv_capacity == 1


# ============================================================================ rejected configs

_INT_FIELDS = ["num_experts", "hidden", "intermediate", "num_topk", "num_ranks"]


@pytest.mark.parametrize("field", _INT_FIELDS)
@pytest.mark.parametrize("value", [0, -1])
def test_int_fields_below_one(field, value):
    with pytest.raises(ConfigError, match=re.escape(f"{field} must be an integer >= 1; got {value}")) as ei:
        make(**{field: value})
    assert ei.value.field == field and ei.value.value == value


@pytest.mark.parametrize("field", _INT_FIELDS + ["max_tokens_per_rank", "recv_capacity"])
@pytest.mark.parametrize(
    "value,shown",
    [(True, "bool True"), (False, "bool False"), (8.0, "float 8.0"), ("8", "str '8'"), (np.float64(8.0), f"float64 {np.float64(8.0)!r}")],
)
def test_int_fields_reject_bool_float_str(field, value, shown):
    with pytest.raises(ConfigError, match=re.escape(f"{field} must be an integer >= 1; got {shown}")) as ei:
        make(**{field: value})
    assert ei.value.field == field and ei.value.value is value


def test_int_field_rejects_none():
    with pytest.raises(ConfigError, match=re.escape("hidden must be an integer >= 1; got NoneType None")):
        make(hidden=None)


def test_expert_alignment_rejects_bool_and_zero():
    with pytest.raises(ConfigError, match=re.escape("expert_alignment must be an integer >= 1; got bool True")):
        make(expert_alignment=True, recv_capacity=8)
    with pytest.raises(ConfigError, match=re.escape("expert_alignment must be an integer >= 1; got 0")):
        make(expert_alignment=0, recv_capacity=8)
    with pytest.raises(ConfigError, match=re.escape("expert_alignment must be an integer >= 1; got float 2.0")):
        make(expert_alignment=2.0, recv_capacity=8)


@pytest.mark.parametrize("num_experts,num_ranks", [(8, 3), (6, 4), (1, 2)])
def test_num_experts_divisible_by_num_ranks(num_experts, num_ranks):
    with pytest.raises(ConfigError, match=re.escape(
        f"num_experts must be divisible by num_ranks = {num_ranks}; got num_experts = {num_experts}"
    )) as ei:
        make(num_experts=num_experts, num_ranks=num_ranks, num_topk=1)
    assert ei.value.field == "num_experts" and ei.value.value == num_experts


def test_top_k_above_num_experts():
    with pytest.raises(ConfigError, match=re.escape("num_topk must be in [1, num_experts] = [1, 8]; got 9")) as ei:
        make(num_topk=9)
    assert ei.value.field == "num_topk" and ei.value.value == 9
    with pytest.raises(ConfigError, match=re.escape("num_topk must be an integer >= 1; got 0")):
        make(num_topk=0)


@pytest.mark.parametrize(
    "field,fmt,block,hidden",
    [("output_format", "mxfp8", 32, 48), ("output_format", "mxfp8", 32, 16), ("output_format", "nvfp4", 16, 40),
     ("combine_format", "mxfp8", 32, 80), ("combine_format", "nvfp4", 16, 8), ("combine_format", "nvfp4", 16, 33)],
)
def test_hidden_must_be_multiple_of_block(field, fmt, block, hidden):
    with pytest.raises(ConfigError, match=re.escape(
        f"hidden must be a multiple of {block} when {field} is {fmt}; got hidden = {hidden}"
    )) as ei:
        make(**{field: fmt, "hidden": hidden})
    assert ei.value.field == "hidden" and ei.value.value == hidden


def test_hidden_multiple_of_16_is_not_enough_when_one_format_is_mxfp8():
    with pytest.raises(ConfigError, match=re.escape(
        "hidden must be a multiple of 32 when combine_format is mxfp8; got hidden = 48"
    )):
        make(output_format="nvfp4", combine_format="mxfp8", hidden=48)


@pytest.mark.parametrize("fmt,block,inter", [("mxfp8", 32, 48), ("nvfp4", 16, 40), ("nvfp4", 16, 1)])
def test_intermediate_must_be_multiple_of_block(fmt, block, inter):
    with pytest.raises(ConfigError, match=re.escape(
        f"intermediate must be a multiple of {block} when intermediate_format is {fmt}; got intermediate = {inter}"
    )) as ei:
        make(intermediate_format=fmt, intermediate=inter)
    assert ei.value.field == "intermediate" and ei.value.value == inter


@pytest.mark.parametrize("value", [0, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_gate_up_clamp_rejects_zero_and_non_finite(value):
    with pytest.raises(ConfigError, match=re.escape(
        f"gate_up_clamp must be a finite non-zero number or None; got {value!r}"
    )) as ei:
        make(gate_up_clamp=value)
    assert ei.value.field == "gate_up_clamp"


@pytest.mark.parametrize("value,shown", [(True, "bool True"), ("1.5", "str '1.5'"), ([1.0], "list [1.0]"),
                                         (1 + 2j, "complex (1+2j)")])
def test_gate_up_clamp_rejects_non_numbers(value, shown):
    with pytest.raises(ConfigError, match=re.escape(
        f"gate_up_clamp must be a finite non-zero number or None; got {shown}"
    )):
        make(gate_up_clamp=value)


def test_gate_up_clamp_huge_int_is_a_config_error():
    with pytest.raises(ConfigError, match="gate_up_clamp must be a finite non-zero number or None"):
        make(gate_up_clamp=10**400)


@pytest.mark.parametrize("field", ["apply_topk_in_fc1", "generate_c"])
@pytest.mark.parametrize("value,shown", [(1, "int 1"), (0, "int 0"), ("yes", "str 'yes'"), (None, "NoneType None")])
def test_bool_fields(field, value, shown):
    with pytest.raises(ConfigError, match=re.escape(f"{field} must be a bool; got {shown}")) as ei:
        make(**{field: value})
    assert ei.value.field == field


def test_expert_alignment_needs_recv_capacity():
    with pytest.raises(ConfigError, match=re.escape(
        "expert_alignment applies to the static layout only: set recv_capacity, or leave expert_alignment at 1; "
        "got expert_alignment = 4 with recv_capacity = None"
    )) as ei:
        make(expert_alignment=4)
    assert ei.value.field == "expert_alignment" and ei.value.value == 4


@pytest.mark.parametrize("field", ["recv_capacity", "max_tokens_per_rank"])
@pytest.mark.parametrize("value", [0, -3])
def test_capacities_at_least_one(field, value):
    with pytest.raises(ConfigError, match=re.escape(f"{field} must be an integer >= 1; got {value}")) as ei:
        make(**{field: value})
    assert ei.value.field == field


@pytest.mark.parametrize("field", ["output_format", "combine_format", "intermediate_format"])
@pytest.mark.parametrize("value,shown", [("fp8", "'fp8'"), ("e4m3", "'e4m3'"), (3, "3")])
def test_unknown_format_name(field, value, shown):
    # docs/spec.md section 12: an unknown format name in MoeEpConfig is a ConfigError
    with pytest.raises(ConfigError, match="^" + re.escape(
        f"{field} must be one of 'bf16', 'mxfp8', 'nvfp4'; got {shown}"
    ) + "$") as ei:
        make(**{field: value})
    assert ei.value.field == field and ei.value.value == value


@pytest.mark.parametrize("field", ["output_format", "combine_format"])
def test_none_is_not_a_format_for_output_or_combine(field):
    with pytest.raises(ConfigError, match=re.escape(f"{field} must be one of 'bf16', 'mxfp8', 'nvfp4'; got None")):
        make(**{field: None})


# Section 2 of docs/spec.md fixes the order of the checks: the first broken rule raises.
# Each case breaks two neighbouring rules; the earlier one must be reported.
_ORDER_CASES = [
    (dict(num_ranks=0, num_experts=0), "num_ranks", "num_ranks must be an integer >= 1"),
    (dict(num_experts=0, hidden=0), "num_experts", "num_experts must be an integer >= 1"),
    (dict(hidden=0, intermediate=0), "hidden", "hidden must be an integer >= 1"),
    (dict(intermediate=0, num_topk=0), "intermediate", "intermediate must be an integer >= 1"),
    (dict(num_topk=0, num_experts=7, num_ranks=2), "num_topk", "num_topk must be an integer >= 1"),
    (dict(num_experts=7, num_ranks=2, num_topk=9), "num_experts", "num_experts must be divisible by num_ranks"),
    (dict(num_topk=9, max_tokens_per_rank=0), "num_topk", "num_topk must be in [1, num_experts]"),
    (dict(max_tokens_per_rank=0, output_format="bad"), "max_tokens_per_rank", "max_tokens_per_rank must be"),
    (dict(output_format="bad", combine_format="bad"), "output_format", "output_format must be one of"),
    (dict(output_format="mxfp8", hidden=48, combine_format="bad"), "hidden", "hidden must be a multiple of 32 when output_format"),
    (dict(combine_format="bad", intermediate_format="bad"), "combine_format", "combine_format must be one of"),
    (dict(combine_format="nvfp4", hidden=40, intermediate_format="bad"), "hidden", "hidden must be a multiple of 16 when combine_format"),
    (dict(intermediate_format="bad", apply_topk_in_fc1=1), "intermediate_format", "intermediate_format must be one of"),
    (dict(intermediate_format="mxfp8", intermediate=48, apply_topk_in_fc1=1), "intermediate", "intermediate must be a multiple"),
    (dict(apply_topk_in_fc1=1, generate_c=1), "apply_topk_in_fc1", "apply_topk_in_fc1 must be a bool"),
    (dict(generate_c=1, gate_up_clamp=0), "generate_c", "generate_c must be a bool"),
    (dict(gate_up_clamp=0, expert_alignment=0), "gate_up_clamp", "gate_up_clamp must be a finite"),
    (dict(expert_alignment=0, recv_capacity=0), "expert_alignment", "expert_alignment must be an integer >= 1"),
    (dict(recv_capacity=0, backward_operand_format="mxfp8"), "recv_capacity", "recv_capacity must be an integer >= 1"),
    (dict(expert_alignment=2, backward_operand_format="mxfp8"), "expert_alignment", "expert_alignment applies to"),
    (dict(backward_operand_format="nvfp4"), "backward_operand_format", "backward_operand_format must be None"),
]


@pytest.mark.parametrize("changes,field,prefix", _ORDER_CASES, ids=[c[1] + str(i) for i, c in enumerate(_ORDER_CASES)])
def test_validation_order(changes, field, prefix):
    with pytest.raises(ConfigError, match="^" + re.escape(prefix)) as ei:
        make(**changes)
    assert ei.value.field == field


# ============================================================================ backward_operand_format


@pytest.mark.parametrize("value", ["bf16", "BF16", "Bf16", MoeFormat.BF16])
def test_backward_operand_format_bf16_is_normalised(value):
    c = make(backward_operand_format=value)
    assert c.backward_operand_format is MoeFormat.BF16
    assert c == make(backward_operand_format=MoeFormat.BF16) and hash(c) == hash(make(backward_operand_format="bf16"))
    assert c != make()  # the mode is part of the layer's identity


def test_backward_operand_format_default_is_exact():
    assert make().backward_operand_format is None
    assert make(backward_operand_format=None) == make()
    assert make(backward_operand_format="bf16").replace(backward_operand_format=None).backward_operand_format is None


@pytest.mark.parametrize(
    "value,shown",
    [("mxfp8", "'mxfp8'"), (MoeFormat.NVFP4, "<MoeFormat.NVFP4"), ("fp8", "'fp8'"), ("", "''"), ("float32", "'float32'"),
     (1, "1"), (True, "True"), (16, "16"), (np.float32(1.0), "1.0")],
)
def test_backward_operand_format_rejects_everything_else(value, shown):
    with pytest.raises(ConfigError) as ei:
        make(backward_operand_format=value)
    err = ei.value
    assert err.field == "backward_operand_format" and err.value is value
    text = str(err)
    assert text.startswith("backward_operand_format must be None (exact float32 operands) or 'bf16'; got "), text
    assert shown in text, text
    assert isinstance(err, ValueError) and isinstance(err, MoeEpError)


def test_backward_operand_format_replace_validates():
    c = make(backward_operand_format="bf16")
    with pytest.raises(ConfigError) as ei:
        c.replace(backward_operand_format="mxfp8")
    assert ei.value.field == "backward_operand_format"
    assert c.replace(num_topk=1).backward_operand_format is MoeFormat.BF16


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        make(num_topk=100)
    assert issubclass(ConfigError, MoeEpError)
    assert issubclass(FormatError, ValueError)


# ============================================================================ derived values


@pytest.mark.parametrize("num_experts,num_ranks", [(8, 1), (8, 2), (8, 8), (12, 3), (64, 16)])
def test_contiguous_placement(num_experts, num_ranks):
    c = make(num_experts=num_experts, num_ranks=num_ranks, num_topk=1)
    el = num_experts // num_ranks
    assert c.num_local_experts == el
    placement = c.expert_placement()
    assert placement.dtype == np.int64 and placement.shape == (num_experts,)
    np.testing.assert_array_equal(placement, np.repeat(np.arange(num_ranks), el))
    for e in range(num_experts):
        r, le = c.expert_rank(e), c.local_expert(e)
        assert (r, le) == (e // el, e % el)
        assert c.global_expert(r, le) == e
    assert [c.global_expert(r, el - 1) for r in range(num_ranks)] == [r * el + el - 1 for r in range(num_ranks)]


def test_placement_example():
    c = make(num_experts=12, num_ranks=3, num_topk=2)
    assert c.num_local_experts == 4
    assert (c.expert_rank(5), c.local_expert(5)) == (1, 1)
    assert (c.expert_rank(11), c.local_expert(11)) == (2, 3)
    assert c.global_expert(2, 0) == 8
    assert c.expert_placement().tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("expert", [-1, 8, 100])
def test_expert_out_of_range(expert):
    c = make(num_ranks=2)
    for fn in (c.expert_rank, c.local_expert):
        with pytest.raises(ConfigError, match=re.escape(f"expert must be in [0, num_experts) = [0, 8); got {expert}")):
            fn(expert)


def test_global_expert_out_of_range():
    c = make(num_ranks=2)
    with pytest.raises(ConfigError, match=re.escape("rank must be in [0, 2); got 2")) as ei:
        c.global_expert(2, 0)
    assert ei.value.field == "rank"
    with pytest.raises(ConfigError, match=re.escape("rank must be in [0, 2); got -1")):
        c.global_expert(-1, 0)
    with pytest.raises(ConfigError, match=re.escape("local_expert must be in [0, 4); got 4")) as ei:
        c.global_expert(1, 4)
    assert ei.value.field == "local_expert"


@pytest.mark.parametrize(
    "kw,want",
    [
        (dict(num_ranks=1, max_tokens_per_rank=10), 1 * 10 * 2),
        (dict(num_ranks=2, max_tokens_per_rank=7), 2 * 7 * 2),
        (dict(num_ranks=4, max_tokens_per_rank=3, num_topk=3, recv_capacity=1, expert_alignment=8), 4 * 3 * 3 + 2 * 7),
        (dict(num_ranks=1, max_tokens_per_rank=1, recv_capacity=64, expert_alignment=16), 2 + 8 * 15),
    ],
)
def test_worst_case_recv_rows(kw, want):
    assert make(**kw).worst_case_recv_rows() == want


def test_worst_case_recv_rows_needs_max_tokens():
    with pytest.raises(ConfigError, match=re.escape("worst_case_recv_rows needs max_tokens_per_rank; got None")) as ei:
        make().worst_case_recv_rows()
    assert ei.value.field == "max_tokens_per_rank"


# ============================================================================ frozen, hashable, replace


def test_frozen():
    c = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden = 128  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.output_format = "mxfp8"  # type: ignore[misc]
    assert c.hidden == 64


def test_hashable_and_equal_after_normalisation():
    a = make(output_format="mxfp8", gate_up_clamp=-2, num_experts=np.int64(8))
    b = make(output_format=MoeFormat.MXFP8, gate_up_clamp=2.0, num_experts=8)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, make()}) == 2
    assert {a: 1}[b] == 1
    assert make(num_topk=3) != make(num_topk=2)


def test_replace_returns_validated_copy():
    c = make(num_ranks=2, max_tokens_per_rank=16)
    d = c.replace(output_format="nvfp4", gate_up_clamp=-3)
    assert d is not c and d.output_format is MoeFormat.NVFP4 and d.gate_up_clamp == 3.0
    assert c.output_format is MoeFormat.BF16 and c.gate_up_clamp is None
    assert d.num_ranks == 2 and d.max_tokens_per_rank == 16
    assert c.replace() == c


@pytest.mark.parametrize(
    "changes,msg",
    [
        (dict(num_topk=9), "num_topk must be in [1, num_experts] = [1, 8]; got 9"),
        (dict(num_ranks=3), "num_experts must be divisible by num_ranks = 3; got num_experts = 8"),
        (dict(hidden=48, output_format="mxfp8"), "hidden must be a multiple of 32 when output_format is mxfp8; got hidden = 48"),
        (dict(expert_alignment=2), "expert_alignment applies to the static layout only"),
        (dict(gate_up_clamp=math.inf), "gate_up_clamp must be a finite non-zero number or None; got inf"),
        (dict(generate_c=1), "generate_c must be a bool; got int 1"),
    ],
)
def test_replace_validates_again(changes, msg):
    c = make()
    with pytest.raises(ConfigError, match=re.escape(msg)):
        c.replace(**changes)


def test_replace_of_recv_capacity_to_none_rechecks_alignment():
    c = make(recv_capacity=32, expert_alignment=4)
    with pytest.raises(ConfigError, match=re.escape("got expert_alignment = 4 with recv_capacity = None")):
        c.replace(recv_capacity=None)
