"""Per-backend expected failures and tolerance overrides, kept apart.

Both are plain text files, one entry per line, ``#`` starting a comment (the
comment on an entry's line is its reason). Patterns are shell-style globs
matched against the full test id, e.g. ``forward[torch-*-out_nvfp4-*]``.

Expected-failure file (``--xfail-file``)::

    # known: nvfp4 output rounds the scale from a float32 reciprocal
    forward[mybackend-*-out_nvfp4-*]    # issue 12

Tolerance file (``--tolerance-file``): a pattern and the factor its budgets are
multiplied by (> 0)::

    backward[mybackend-*]   4    # fp32 atomics in the weight gradients

An entry that matches no collected test is *stale*: it is reported (terminal
summary and reports) so that fixed bugs do not stay hidden behind old entries.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set

__all__ = ["Entry", "ExpectationError", "Expectations", "load_xfail_file", "load_tolerance_file"]


class ExpectationError(ValueError):
    """A malformed expectation file; the message names the file and the line."""


@dataclass(frozen=True)
class Entry:
    """One line of an expectation file."""

    pattern: str
    reason: str
    source: str  # "file:line"
    factor: float = 1.0

    def matches(self, test_id: str) -> bool:
        # fnmatch treats [..] as a character class; test ids contain brackets.
        return fnmatch.fnmatchcase(test_id, self.pattern.replace("[", "[[]"))


def _lines(path: Path) -> Iterable[tuple]:
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text, _, comment = raw.partition("#")
        text = text.strip()
        if text:
            yield number, text, comment.strip()


def load_xfail_file(path: str) -> List[Entry]:
    """Parse an expected-failure file."""
    p = Path(path)
    if not p.is_file():
        raise ExpectationError(f"expected-failure file {path!r} does not exist")
    entries = []
    for number, text, comment in _lines(p):
        if len(text.split()) != 1:
            raise ExpectationError(f"{path}:{number}: an expected-failure entry is one test-id pattern; got {text!r}")
        entries.append(Entry(text, comment or "expected failure", f"{path}:{number}"))
    return entries


def load_tolerance_file(path: str) -> List[Entry]:
    """Parse a tolerance-override file."""
    p = Path(path)
    if not p.is_file():
        raise ExpectationError(f"tolerance file {path!r} does not exist")
    entries = []
    for number, text, comment in _lines(p):
        parts = text.split()
        if len(parts) != 2:
            raise ExpectationError(f"{path}:{number}: a tolerance entry is 'PATTERN FACTOR'; got {text!r}")
        try:
            factor = float(parts[1])
        except ValueError:
            raise ExpectationError(f"{path}:{number}: FACTOR must be a finite number > 0; got {parts[1]!r}") from None
        if not (factor > 0 and factor != float("inf")):
            raise ExpectationError(f"{path}:{number}: FACTOR must be a finite number > 0; got {factor}")
        entries.append(Entry(parts[0], comment, f"{path}:{number}", factor))
    return entries


@dataclass
class Expectations:
    """The loaded files and which of their entries matched a collected test."""

    xfails: List[Entry] = field(default_factory=list)
    tolerances: List[Entry] = field(default_factory=list)
    _used: Set[str] = field(default_factory=set)

    @classmethod
    def load(cls, xfail_files: Sequence[str] = (), tolerance_files: Sequence[str] = ()) -> "Expectations":
        exp = cls()
        for f in xfail_files:
            exp.xfails += load_xfail_file(f)
        for f in tolerance_files:
            exp.tolerances += load_tolerance_file(f)
        return exp

    def xfail_for(self, test_id: str) -> Optional[Entry]:
        """The first expected-failure entry matching ``test_id`` (marked used)."""
        for e in self.xfails:
            if e.matches(test_id):
                self._used.add(e.source)
                return e
        return None

    def factor_for(self, test_id: str) -> float:
        """The product of the factors of every tolerance entry matching ``test_id``."""
        factor = 1.0
        for e in self.tolerances:
            if e.matches(test_id):
                self._used.add(e.source)
                factor *= e.factor
        return factor

    def stale(self) -> List[Entry]:
        """Entries that matched no test."""
        return [e for e in self.xfails + self.tolerances if e.source not in self._used]
