"""Progress on stderr: tqdm's bar on a terminal, a line per measurement on
request, and otherwise (a log, a pipe, CI) a quiet count every half minute."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["PROGRESS_MODES", "Progress", "make_progress"]

#: ``--progress`` values: ``auto`` (bar when stdout and stderr are terminals, else ``quiet``), ``bar``
#: (tqdm's bar, or ``lines`` without tqdm), ``lines`` (one line per
#: measurement), ``quiet`` (a line at the start, then at most one every
#: ``QUIET_EVERY_S`` seconds), ``none``.
PROGRESS_MODES = ("auto", "bar", "lines", "quiet", "none")

#: Seconds between two lines of the ``quiet`` progress.
QUIET_EVERY_S = 30.0


class Progress:
    """The plain counter: ``[i/N] what (s)`` per finished measurement, or every
    ``every_s`` seconds only (the quiet mode); silent when not ``enabled``."""

    def __init__(
        self, total: int, stream: Optional[TextIO] = None, enabled: bool = True, every_s: float = 0.0
    ) -> None:
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self._t0 = time.perf_counter()
        self._last = self._t0
        if enabled and every_s > 0:
            print(f"moe-ep bench: {total} measurements; progress every {every_s:g} s (--progress lines: every one)",
                  file=self.stream, flush=True)

    def update(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.every_s > 0 and now - self._last < self.every_s and self.done < self.total:
            return
        self._last = now
        print(f"[{self.done}/{self.total}] {what} ({now - self._t0:.1f} s)", file=self.stream, flush=True)

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


def make_progress(total: int, mode: str = "auto") -> Progress:
    """The progress of a run of ``total`` measurements in ``mode`` (:data:`PROGRESS_MODES`)."""
    if mode == "none":
        return Progress(total, enabled=False)
    if mode == "auto":
        # a bar only where a person watches: both streams on a terminal (not `| tee log`, not CI)
        mode = "bar" if sys.stderr.isatty() and sys.stdout.isatty() else "quiet"
    if mode == "quiet":
        return Progress(total, every_s=QUIET_EVERY_S)
    if mode == "lines":
        return Progress(total)
    try:
        from tqdm import tqdm
    except Exception:  # noqa: BLE001 - tqdm is optional
        return Progress(total)
    return _Tqdm(total, tqdm)
