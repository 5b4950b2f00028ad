"""The docs' tutorial code runs as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tutorial_blocks(path: Path) -> str:
    text = path.read_text()
    blocks = re.findall(r"```python tutorial\n(.*?)```", text, flags=re.S)
    assert blocks, f"{path} has no ```python tutorial blocks"
    return "\n".join(blocks)


def test_backends_tutorial_runs() -> None:
    source = _tutorial_blocks(ROOT / "docs" / "backends.md")
    module = types.ModuleType("moe_ep_tutorial")
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, "docs/backends.md", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    backend = module.__dict__["backend"]
    assert backend.name == "echo"
    assert len(module.__dict__["results"]) == 2
