"""The conformance suite tests itself: it must pass the reference and fail every
deliberately wrong backend of ``tests/mutants.py``.

Each mutant breaks exactly one rule of ``docs/spec.md``. Every mutant must fail
at least one case of the quick subset (``moe-ep conformance --quick``), and in
the operation(s) listed in :data:`CAUGHT_BY`; the few that the quick subset
cannot catch are checked against the full table instead (:data:`FULL_ONLY`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Tuple

import numpy as np
import pytest

import moe_ep_conformance as mc
import moe_ep_spec
import moe_ep_reference.world as W
from moe_ep_spec.formats import BF16
from moe_ep_spec.inputs import random_world
from moe_ep_spec.tolerance import compare

try:  # tests/ may or may not be a package
    from . import mutants
except ImportError:
    import mutants

QUICK = mc.quick_cases()
FULL = mc.full_cases()

#: Every patchable attribute as it was before any mutant ran.
ORIGINALS = {(module, attr): getattr(module, attr) for module, attr in mutants.PATCH_TARGETS}

#: For every mutant, the operations whose quick case(s) must catch it (each of
#: them must have at least one failed case; other operations may fail too).
CAUGHT_BY: Dict[str, Tuple[str, ...]] = {
    "mutant-gate-up-swapped": ("forward", "forward_stash", "backward", "nan_isolation"),
    "mutant-clamp-gate-both-sides": ("forward",),
    "mutant-router-weight-twice": ("forward", "forward_stash", "nan_isolation"),
    "mutant-router-weight-ignored": ("forward", "backward"),
    "mutant-unused-slot-as-expert-0": ("forward",),
    "mutant-round-robin-placement": ("forward", "dispatch", "combine_backward"),
    "mutant-combine-round-trip-skipped": ("forward", "combine"),
    "mutant-mxfp8-scale-nearest": ("forward", "combine"),
    "mutant-nvfp4-nibbles-swapped": ("forward", "nan_isolation"),
    "mutant-source-major-rows": ("forward_stash", "backward", "dispatch", "combine_backward"),
    "mutant-backward-no-clamp-mask": ("backward",),
    "mutant-padding-nan-leak": ("forward_stash", "dispatch", "combine", "dispatch_backward", "combine_backward"),
    "mutant-combine-reads-padding": ("combine", "dispatch_backward"),
    "mutant-no-topk-range-check": ("bad_input",),
    "mutant-bf16-output-truncated": ("forward", "forward_stash"),
    "mutant-slot-sum-bf16": ("backward", "dispatch_backward"),
    "mutant-topk-placement-ignored": ("forward",),
    "mutant-stash-after-clamp": ("forward_stash",),
    "mutant-modifies-inputs": ("forward",),
    "mutant-bf16-router-weight-bits": ("forward",),
    "mutant-unused-slot-weight-product": ("nan_isolation",),
    "mutant-mxfp8-scale-float32-log2": ("combine",),
    # Format classes: caught code for code by the format cases (issue 17).
    "mutant-bf16-ties-away": ("formats",),
    "mutant-e4m3-ties-up": ("formats",),
    "mutant-e2m1-ties-up": ("formats",),
    "mutant-nvfp4-scale-ties-up": ("formats",),
    "mutant-mxfp8-scale-off-at-448": ("formats",),
    "mutant-negative-zero-lost": ("formats",),
    "mutant-slot-sum-from-first-slot": ("formats",),
    "mutant-mxfp8-nan-block-data-zero": ("formats",),
    "mutant-slot-sum-one-ulp-high": ("formats",),
    "mutant-decode-nan-scale-as-zero": ("formats",),
    "mutant-decode-mxfp8-finite-beyond-float32": ("formats",),
    "mutant-combine-expert-slabs-swapped": ("combine",),
}

#: Mutants the quick subset cannot catch, checked against full_cases() instead
#: (none since the quick subset holds a clamped forward_stash case, which catches
#: mutant-stash-after-clamp). _results runs the full cases of the operations in CAUGHT_BY.
FULL_ONLY: set = set()


@functools.lru_cache(maxsize=None)
def _results(name: str, full: bool) -> Tuple[mc.CaseResult, ...]:
    if name == "reference":
        return tuple(mc.run_cases(moe_ep_spec.get_backend("reference"), FULL if full else QUICK))
    backend = {cls.name: cls for cls in mutants.ALL_MUTANTS}[name]()
    if not full:
        return tuple(mc.run_cases(backend, QUICK))
    # Full table, restricted to the operations the mutant changes (the others
    # pass by construction) to keep this file fast.
    return tuple(mc.run_cases(backend, [c for c in FULL if c.op in CAUGHT_BY[name]]))


def _failed(results) -> List[mc.CaseResult]:
    return [r for r in results if r.outcome == "failed"]


def _assert_restored() -> None:
    changed = [f"{m.__name__}.{a}" for (m, a), orig in ORIGINALS.items() if getattr(m, a) is not orig]
    assert not changed, f"mutant patches leaked out of the mutant's call: {changed}"


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("full", [False, True], ids=["quick", "full"])
def test_reference_passes(full):
    results = _results("reference", full)
    assert len(results) == len(FULL if full else QUICK)
    bad = [r.describe() for r in results if r.outcome != "passed"]
    assert not bad, "the reference must pass (and not skip) every case:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the mutants


def test_mutant_table():
    names = [cls.name for cls in mutants.ALL_MUTANTS]
    assert len(set(names)) == len(names)
    assert len(mutants.MUTANTS) >= 12
    assert set(CAUGHT_BY) == {cls.name for cls in mutants.MUTANTS}
    for cls in mutants.ALL_MUTANTS:
        assert issubclass(cls, mutants.ReferenceBackend) and cls.name != "reference"
        assert "Section" in (cls.__doc__ or ""), f"{cls.name}: the docstring must name the spec rule it breaks"


@pytest.mark.parametrize("name", [cls.name for cls in mutants.MUTANTS])
def test_mutant_is_caught(name):
    full = name in FULL_ONLY
    results = _results(name, full)
    failed = _failed(results)
    subset = "full_cases()" if full else "quick_cases()"
    assert failed, f"{name}: the conformance suite ({subset}) passed this wrong backend"
    failed_ops = {r.case.op for r in failed}
    missing = [op for op in CAUGHT_BY[name] if op not in failed_ops]
    assert not missing, (
        f"{name}: expected {subset} to catch it in {missing}; it failed only "
        + ", ".join(r.test_id for r in failed)
    )
    for r in failed:
        assert r.test_id.startswith(f"{r.case.op}[{name}-"), r.test_id
        assert r.reason.strip() and r.describe().startswith(f"{r.test_id}: failed"), r.describe()
    _assert_restored()


def _decoded(outputs) -> np.ndarray:
    return np.concatenate([W.decode(o) for o in outputs])


def test_former_gap_mutants_are_really_wrong():
    """Three mutants once passed the whole table; each is wrong on the inputs
    below (the reproducers of those gaps, which the table now builds)."""
    reference = moe_ep_spec.get_backend("reference")
    cfg = moe_ep_spec.MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=2)

    # bf16 router weights (section 3): the suite only ever passes float32 ones.
    world = random_world(cfg, num_tokens=6, seed=1)
    world = [dataclasses.replace(w, topk_weights=w.topk_weights.astype(BF16)) for w in world]
    ref = _decoded(r.output for r in reference.forward(cfg, world))
    got = _decoded(r.output for r in mutants.Bf16RouterWeightAsBits().forward(cfg, world))
    assert np.abs(got - ref).max() > 0.01

    # A NaN router weight in a -1 slot (section 4.4): the suite never makes one.
    world = random_world(cfg, num_tokens=6, routing="unused_mixed", seed=2)
    world = [
        dataclasses.replace(w, topk_weights=np.where(w.topk_idx < 0, np.float32(np.nan), w.topk_weights))
        for w in world
    ]
    assert any((w.topk_idx < 0).any() for w in world)
    assert np.isfinite(_decoded(r.output for r in reference.forward(cfg, world))).all()
    assert np.isnan(_decoded(r.output for r in mutants.UnusedSlotWeightProduct().forward(cfg, world))).any()

    # A block maximum one float32 ulp above 448 * 2^5 (section 8.3), through the
    # combine round trip, which must be exact: the suite's random rows never land there.
    mx = cfg.replace(combine_format="mxfp8")
    world = random_world(mx, num_tokens=6, seed=3)
    dispatched = reference.dispatch(mx, [moe_ep_spec.DispatchInputs(w.activation, w.topk_idx, w.topk_weights) for w in world])
    rng = np.random.default_rng(4)
    rows = []
    for d in dispatched:
        y = (rng.standard_normal((d.handle.num_recv_rows, mx.hidden)) * 100).astype(np.float32)
        y[:, 0] = np.nextafter(np.float32(448 * 2.0**5), np.float32(np.inf))  # scale 2^6; float32 log2: 2^5
        y[:, 1] = 1.25 * 2.0**-4  # E4M3 subnormal: 2^-3 at scale 2^6, 2^-4 at scale 2^5
        rows.append(y)
    handles = [d.handle for d in dispatched]
    ref = _decoded(reference.combine(mx, handles, rows))
    got = _decoded(mutants.Mxfp8ScaleFloat32Log2().combine(mx, handles, rows))
    assert not np.array_equal(got, ref)
    _assert_restored()


# ----------------------------------------------------------------------------- the bf16-operand backward

#: For every mutant of the bf16-operand backward, the gradients its wrong rounding
#: must push beyond that mode's budgets (section 13.3) in every world below.
BF16_CAUGHT_IN: Dict[str, Tuple[str, ...]] = {
    # and grad_topk_weights where the cotangent is not bf16 already (the rounded dY_b)
    "mutant-bf16-backward-not-rounded": ("grad_activation", "grad_fc1_weight", "grad_fc2_weight"),
    "mutant-bf16-backward-dc-unrounded-in-dw1": ("grad_fc1_weight",),
    "mutant-bf16-backward-wh-unrounded": ("grad_fc2_weight",),
    "mutant-bf16-backward-rounds-dh": ("grad_activation", "grad_fc1_weight"),
}
_GRADS = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")


def _bf16_worlds():
    """Backward worlds in the bf16 mode: both router-weight placements, a clamp,
    EP 1 and 2, float32 and bf16 cotangents."""
    base = dict(num_experts=8, hidden=64, intermediate=32, num_topk=2, generate_c=True, backward_operand_format="bf16")
    for ranks, fc1, clamp, cot in ((1, True, None, np.float32), (2, False, 2.0, np.float32), (2, True, 1.5, BF16)):
        cfg = moe_ep_spec.MoeEpConfig(num_ranks=ranks, apply_topk_in_fc1=fc1, gate_up_clamp=clamp, **base)
        world = random_world(cfg, num_tokens=[7, 4][:ranks], seed=40 + ranks)
        rng = np.random.default_rng(ranks)
        grad = [rng.normal(size=(w.topk_idx.shape[0], cfg.hidden)).astype(cot) for w in world]
        yield f"ep{ranks}-{'fc1' if fc1 else 'fc2'}-{np.dtype(cot).name}", cfg, world, grad


def _failed_grads(backend, cfg, world, grad) -> List[str]:
    reference = moe_ep_spec.get_backend("reference")
    stash = [f.stash for f in reference.forward(cfg, world)]
    want, budget = reference.backward_and_budget(cfg, world, grad, stash)
    got = backend.backward(cfg, world, grad, stash)
    failed = []
    for r in range(cfg.num_ranks):
        for name in _GRADS:
            c = compare(name, getattr(got[r], name), getattr(want[r], name), getattr(budget[r], name))
            if not c.ok:
                failed.append(name)
    return sorted(set(failed))


def test_bf16_backward_mutant_table():
    names = [cls.name for cls in mutants.BF16_BACKWARD_MUTANTS]
    assert set(names) == set(BF16_CAUGHT_IN) and not set(names) & {cls.name for cls in mutants.ALL_MUTANTS}
    for cls in mutants.BF16_BACKWARD_MUTANTS:
        assert "Section 9.2" in (cls.__doc__ or ""), cls.name


@pytest.mark.parametrize("name", sorted(BF16_CAUGHT_IN))
def test_bf16_backward_mutant_fails_the_budgets(name):
    backend = {cls.name: cls for cls in mutants.BF16_BACKWARD_MUTANTS}[name]()
    reference = moe_ep_spec.get_backend("reference")
    for wid, cfg, world, grad in _bf16_worlds():
        assert _failed_grads(reference, cfg, world, grad) == [], wid
        failed = _failed_grads(backend, cfg, world, grad)
        missing = [g for g in BF16_CAUGHT_IN[name] if g not in failed]
        assert not missing, f"{name} in {wid}: {missing} within the bf16 mode's budgets (failed only {failed})"
        if name == "mutant-bf16-backward-not-rounded" and wid.endswith("float32"):
            assert "grad_topk_weights" in failed, wid
        # The same backend is right in the exact mode: only the bf16 rounding points differ.
        exact = cfg.replace(backward_operand_format=None)
        assert _failed_grads(backend, exact, world, grad) == [], wid
    _assert_restored()


def test_exact_mode_results_fail_the_bf16_budgets_and_back():
    """The two modes' results are each outside the other's budgets."""
    reference = moe_ep_spec.get_backend("reference")
    for wid, cfg, world, grad in _bf16_worlds():
        stash = [f.stash for f in reference.forward(cfg, world)]
        exact = cfg.replace(backward_operand_format=None)
        for judged, produced in ((cfg, exact), (exact, cfg)):
            want, budget = reference.backward_and_budget(judged, world, grad, stash)
            got = reference.backward(produced, world, grad, stash)
            ratios = [
                compare(n, getattr(got[r], n), getattr(want[r], n), getattr(budget[r], n)).ratio
                for r in range(cfg.num_ranks)
                for n in ("grad_activation", "grad_fc2_weight")
            ]
            assert max(ratios) > 2.0, (wid, judged.backward_operand_format, ratios)


# ----------------------------------------------------------------------------- failure reports


def _first_failure(name: str, op: str, id_part: str = "") -> mc.CaseResult:
    for r in _failed(_results(name, name in FULL_ONLY)):
        if r.case.op == op and id_part in r.case.id:
            return r
    raise AssertionError(f"{name}: no failed {op} case with {id_part!r} in its id")


def test_report_gate_up_swapped():
    r = _first_failure("mutant-gate-up-swapped", "forward", "out_bf16-comb_bf16-in_bf16")
    text = r.describe()
    for needle in ("worst element", "x budget", "got ", "reference ", "rank 0 output", r.test_id):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    assert r.ratio > 1.0
    # The backward report names the gradient and the element.
    text = _first_failure("mutant-gate-up-swapped", "backward").describe()
    assert "grad_activation: worst element" in text and "x budget" in text, text


def test_report_bad_input_accepted():
    r = _first_failure("mutant-no-topk-range-check", "bad_input", "bad_expert_id_too_high")
    text = r.describe()
    assert "expert_id_too_high" in text and "was accepted" in text and "RoutingIndexError" in text, text


def test_report_route_metadata_order():
    text = _first_failure("mutant-source-major-rows", "forward_stash").describe()
    assert "route_metadata" in text and "differ, first at" in text and "integers must be exact" in text, text
    text = _first_failure("mutant-source-major-rows", "backward").describe()
    assert "StashError" in text, text


def test_report_scale_codes():
    text = _first_failure("mutant-mxfp8-scale-nearest", "combine").describe()
    assert "scale codes" in text and "outside the allowed range" in text and "allowed [" in text, text


def test_report_nan_leak():
    text = _first_failure("mutant-padding-nan-leak", "combine").describe()
    assert "NaN/inf where the reference differs" in text, text
    text = _first_failure("mutant-padding-nan-leak", "dispatch").describe()
    assert "code(s) differ" in text and "codes must move unchanged" in text, text


def test_report_format_codes():
    """A format case names the codes, the element and what it checks."""
    text = _first_failure("mutant-bf16-ties-away", "formats", "output-bf16-ties").describe()
    assert "bf16 code(s) differ" in text and "got 0x3f81" in text and "reference 0x3f80" in text, text
    text = _first_failure("mutant-mxfp8-nan-block-data-zero", "formats").describe()
    assert "data codes" in text and "0x7f" in text and "0x7F" in text, text
    text = _first_failure("mutant-negative-zero-lost", "formats").describe()
    assert "+0 and -0 differ" in text and "0x8000" in text, text


def test_format_cases_pass_only_with_zero_budgets():
    """Every format case's reference budget is 0 wherever the result is finite
    (the case checks this itself and fails as a suite bug otherwise)."""
    fmt = [c for c in FULL if c.op == "formats"]
    assert len(fmt) >= 12 and any(c.quick for c in fmt)
    assert len({c.id for c in fmt}) == len(fmt)
    for r in mc.run_cases(moe_ep_spec.get_backend("reference"), fmt):
        assert r.outcome == "passed" and not any("construction" in c.name for c in r.checks), r.describe()


def test_report_inputs_modified():
    text = _first_failure("mutant-modifies-inputs", "forward").describe()
    assert "modified its inputs" in text, text


# ----------------------------------------------------------------------------- patch hygiene


def test_patches_are_scoped():
    _assert_restored()
    sentinel = object()
    with pytest.raises(RuntimeError):
        with mutants.patched([(W, "plan", lambda orig: sentinel)]):
            assert W.plan is sentinel
            raise RuntimeError("a mutant that raises mid-call")
    _assert_restored()
    # A mutant that raises inside its own call leaves nothing behind either.
    mutant = mutants.SourceMajorRows()
    case = next(c for c in QUICK if c.op == "backward")
    world = random_world(case.config(), num_tokens=case.tokens_per_rank(), seed=case.seed)
    reference = moe_ep_spec.get_backend("reference")
    stash = [f.stash for f in reference.forward(case.config(), world)]
    grads = [np.zeros((w.topk_idx.shape[0], case.hidden), np.float32) for w in world]
    with pytest.raises(moe_ep_spec.StashError):
        mutant.backward(case.config(), world, grads, stash)
    _assert_restored()


def test_reference_unaffected_after_mutants():
    """Run last: the reference judged after every mutant ran in this process."""
    for cls in mutants.MUTANTS:
        _results(cls.name, cls.name in FULL_ONLY)
    _assert_restored()
    results = mc.run_cases(moe_ep_spec.get_backend("reference"), QUICK)
    bad = [r.describe() for r in results if r.outcome != "passed"]
    assert not bad, "\n".join(bad)
