"""The conformance tests: one function per operation, parametrised by the plugin
over (backend, case). Run with ``moe-ep conformance`` (or pytest with
``-p moe_ep_conformance.plugin``, see :mod:`moe_ep_conformance.plugin`)."""

from __future__ import annotations

from typing import Any, Tuple

import pytest

from .plugin import run

Param = Tuple[Any, Any]


def forward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Fused forward. Given: random inputs of every rank. Checked: ``output``
    within ``B_output`` (and its scale codes); ``fc1_c`` and ``route_metadata``
    None (no ``generate_c``)."""
    run(request, *moe_ep_case)


def forward_stash(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Forward with ``generate_c=True``. Checked: ``output`` as :func:`forward`;
    ``fc1_c`` ``bfloat16`` ``[R, 2I]`` within ``B_fc1_c``; ``route_metadata``
    ``int32``, exact."""
    run(request, *moe_ep_case)


def backward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Spec backward. Given: the inputs, a random ``[T, H]`` cotangent per rank
    and the reference's stash, so the backward is judged on its own, not on the
    backend's forward. Checked: ``grad_activation``, ``grad_fc1_weight``,
    ``grad_fc2_weight``, ``grad_topk_weights``: float32, each within its budget."""
    run(request, *moe_ep_case)


def dispatch(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Layered dispatch. Given: ``DispatchInputs`` of every rank. Checked: the
    received row count is the spec's plan; ``tokens`` moved exactly (same encoding
    and codes); ``topk_weights`` float32, ``route_metadata`` (int32),
    ``tokens_per_expert`` and ``expert_offsets`` (int64) exact."""
    run(request, *moe_ep_case)


def combine(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Layered combine. Given: the handles of the backend's own dispatch and, per
    rank, an ``[R, H]`` ``expert_out`` made by the suite's expert MLP from the
    spec's dispatched rows, with NaN in every padding row (which must not be
    read). Checked: output within the combine budget (and its scale codes)."""
    run(request, *moe_ep_case)


def dispatch_backward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Backward of dispatch. Given: the backend's own handles, ``[R, H]`` token
    cotangents made like combine's ``expert_out`` and random ``[R]`` weight
    cotangents, NaN in every padding row. Checked: ``grad_tokens`` within
    ``gamma(K) * sum_k abs(g_k)``; ``grad_topk_weights`` exact."""
    run(request, *moe_ep_case)


def combine_backward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Backward of combine. Given: the backend's own handles and a random
    ``[T, H]`` cotangent. Checked: the ``[R, H]`` float32 rows exact, padding
    rows zero."""
    run(request, *moe_ep_case)


def bad_input(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """One broken input (:data:`~moe_ep_conformance.cases.BAD_INPUTS`) raises the
    spec's error class with a non-empty message and changes no input."""
    run(request, *moe_ep_case)


def nan_isolation(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """NaN in one token of rank 0, +inf in one token of the last rank, NaN router
    weights in every -1 slot; then, if the backend declares the backward, a
    backward with NaN in those tokens' cotangents. Checked: every other token's
    output, ``grad_activation`` and ``grad_topk_weights`` finite and within budget."""
    run(request, *moe_ep_case)


def formats(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Format conformance: every encode point and decode on inputs built through
    the public forward API (one-hot activations, router weights 1, K = 1, a bf16
    intermediate) whose exact result is known (format_cases.py). Checked: the codes
    exactly, bf16 bits with +0 and -0 distinct, block scale codes and data codes
    (an mxfp8 NaN-scale block's data all 0x7F); the reference's budget there is 0."""
    run(request, *moe_ep_case)
