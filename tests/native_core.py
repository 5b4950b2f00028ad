"""The native core for the CPU tests of its entry points: imported and its
library loaded, or the calling test module skipped."""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["native_or_skip"]


def native_or_skip() -> Any:
    """:mod:`moe_ep_native` with its library loaded; skips the calling test module
    when the distribution is not installed or its library was not built."""
    moe_ep_native = pytest.importorskip("moe_ep_native", reason="moe-ep-native is not installed")
    try:
        moe_ep_native.load()
    except FileNotFoundError as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"native library not built: {exc}", allow_module_level=True)
    return moe_ep_native
