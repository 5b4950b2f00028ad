"""A progress bar on stderr: tqdm when it is installed, a plain counter otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["Progress", "make_progress"]


class Progress:
    """The plain counter: one line per finished measurement, ``[i/N] what (s)``."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, enabled: bool = True) -> None:
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._t0 = time.perf_counter()

    def update(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            elapsed = time.perf_counter() - self._t0
            print(f"[{self.done}/{self.total}] {what} ({elapsed:.1f} s)", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class _Tqdm(Progress):
    def __init__(self, total: int, tqdm_cls: Any) -> None:
        super().__init__(total)
        self._bar = tqdm_cls(total=total, desc="moe-ep bench", unit="case", file=sys.stderr, dynamic_ncols=True)

    def update(self, what: str) -> None:
        self.done += 1
        self._bar.set_postfix_str(what, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def make_progress(total: int, enabled: bool = True) -> Progress:
    """tqdm's bar when tqdm imports and stderr is a terminal, else the plain
    counter (one line per measurement: readable in logs); silent when not ``enabled``."""
    if not enabled:
        return Progress(total, enabled=False)
    if not sys.stderr.isatty():
        return Progress(total)
    try:
        from tqdm import tqdm
    except Exception:  # noqa: BLE001 - tqdm is optional
        return Progress(total)
    return _Tqdm(total, tqdm)
