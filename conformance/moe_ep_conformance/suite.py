"""The conformance tests: one function per operation, parametrised by the plugin
over (backend, case). Run with ``moe-ep conformance`` (or pytest with
``-p moe_ep_conformance.plugin``, see :mod:`moe_ep_conformance.plugin`)."""

from __future__ import annotations

from typing import Any, Tuple

import pytest

from .plugin import run

Param = Tuple[Any, Any]


def forward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Fused forward: outputs within budget, scale codes in range, no stash."""
    run(request, *moe_ep_case)


def forward_stash(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Forward with generate_c: output, fc1_c within budget, route_metadata exact."""
    run(request, *moe_ep_case)


def backward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Spec backward from the reference's stash: four gradients within budget."""
    run(request, *moe_ep_case)


def dispatch(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Layered dispatch: rows, weights, metadata, counts and offsets exact."""
    run(request, *moe_ep_case)


def combine(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Layered combine (NaN in padding rows must not be read): output within budget."""
    run(request, *moe_ep_case)


def dispatch_backward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Backward of dispatch: token gradients within budget, weight gradients exact."""
    run(request, *moe_ep_case)


def combine_backward(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Backward of combine: rows exact, padding rows zero."""
    run(request, *moe_ep_case)


def bad_input(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Bad input raises the spec's error type and changes nothing."""
    run(request, *moe_ep_case)


def nan_isolation(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """A NaN/Inf in one token leaves every other token finite and within budget."""
    run(request, *moe_ep_case)


def formats(request: pytest.FixtureRequest, moe_ep_case: Param) -> None:
    """Format conformance: every encode point and decode on inputs whose exact
    result is known, compared code for code (format_cases.py)."""
    run(request, *moe_ep_case)
