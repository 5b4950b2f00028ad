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


def test_backends_pyproject_builds_as_written(tmp_path: Path) -> None:
    """The guide's pyproject.toml, with the tutorial's code as moe_ep_echo/plugin.py and
    a sibling folder beside the package, builds a wheel holding the package and the
    entry point; and the guide's `moe-ep backends` line is what the CLI prints."""
    import subprocess
    import zipfile

    text = (ROOT / "docs" / "backends.md").read_text()
    (toml,) = [b for b in re.findall(r"```toml\n(.*?)```", text, flags=re.S) if "[build-system]" in b]
    blocks = re.findall(r"```python tutorial\n(.*?)```", text, flags=re.S)
    project = tmp_path / "moe-ep-echo"
    (project / "moe_ep_echo").mkdir(parents=True)
    (project / "tests").mkdir()  # a sibling folder: automatic discovery would refuse to build
    (project / "tests" / "test_echo.py").write_text("")
    (project / "pyproject.toml").write_text(toml)
    (project / "moe_ep_echo" / "__init__.py").write_text("")
    (project / "moe_ep_echo" / "plugin.py").write_text("\n".join(blocks[:2]))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
         str(project)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("moe_ep_echo-1.0-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "moe_ep_echo/plugin.py" in names and not any(n.startswith("tests/") for n in names)
    assert "[moe_ep_spec.backends]" in entry_points and "echo = moe_ep_echo.plugin" in entry_points

    from moe_ep_spec.cli import _capability_summary

    module = types.ModuleType("moe_ep_echo_doc")
    exec(compile(blocks[0], "docs/backends.md", "exec"), module.__dict__)
    line = next(row for row in text.splitlines() if row.startswith("echo ") and "moe-ep-echo" in row)
    assert line.split("moe-ep-echo")[1].strip() == _capability_summary(module.EchoBackend())


def test_readme_python_example_prints_what_it_says(capsys) -> None:
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Using it from Python\n\n```python\n(.*?)```", text, flags=re.S).group(1)
    printed = re.search(r"It prints:\n\n```text\n(.*?)```", text, flags=re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out == printed


def test_backends_bench_driver_times_the_tutorial_backend() -> None:
    """docs/backends.md's bench driver, as written, on the tutorial's backend; its entry-point group is the bench's."""
    text = (ROOT / "docs" / "backends.md").read_text()
    (driver,) = re.findall(r"```python bench-driver\n(.*?)```", text, flags=re.S)
    blocks = re.findall(r"```python tutorial\n(.*?)```", text, flags=re.S)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from moe_ep_bench.drivers import ENTRY_POINT_GROUP
        from moe_ep_bench.model import BenchSettings
        from moe_ep_bench.progress import make_progress
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert f'[project.entry-points."{ENTRY_POINT_GROUP}"]' in text
    plugin: dict = {}
    exec(compile(blocks[0], "docs/backends.md", "exec"), plugin)
    module: dict = {}
    exec(compile(driver, "docs/backends.md", "exec"), module)
    settings = BenchSettings(device="cpu", ep_size=2, hidden=32, intermediate=16, experts=4, topk=2, tokens=(4, 8),
                             formats=("bf16", "mxfp8"), ops=("dispatch", "forward"), repeats=2, warmup=1)
    rows = module["drive"](plugin["EchoBackend"](), settings, {}, make_progress(0, "none"))
    status = {(r.op, r.format, r.tokens): r.status for r in rows}
    assert len(status) == len(rows) == 8
    assert {k for k, v in status.items() if v == "ok"} == {("forward", "bf16", 4), ("forward", "bf16", 8)}
    assert all(len(r.samples_ms) == 2 and r.median_ms > 0 for r in rows if r.ok)


def test_backends_tutorial_declares_bf16_inputs_only() -> None:
    """The tutorial's bf16 backend declares bf16 inputs, so the suite never feeds it block-scaled ones."""
    from moe_ep_spec import MoeFormat

    text = (ROOT / "docs" / "backends.md").read_text()
    blocks = re.findall(r"```python tutorial\n(.*?)```", text, flags=re.S)
    plugin: dict = {}
    exec(compile(blocks[0], "docs/backends.md", "exec"), plugin)
    caps = plugin["EchoBackend"].capabilities
    assert caps.formats == caps.input_formats == frozenset({MoeFormat.BF16})


def test_torch_module_snippet_runs_in_one_process(tmp_path: Path) -> None:
    """docs/torch.md's MoeEpLayer snippet, group set-up included, runs as written in a fresh process."""
    import importlib.util
    import subprocess

    import pytest

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("moe_ep_torch") is None:
        pytest.skip("torch or moe-ep-torch is not installed")
    from moe_ep_spec.launch import free_loopback_port

    text = (ROOT / "docs" / "torch.md").read_text()
    section = text.split("## A module: `moe_ep_torch.module.MoeEpLayer`", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert "init_process_group" in code
    script = tmp_path / "snippet.py"
    script.write_text(code + "\nassert y.shape == (16, 64) and layer.fc1_weight.grad is not None\nprint('ok')\n")
    env = dict(__import__("os").environ, MASTER_PORT=str(free_loopback_port()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_conformance_doc_matches_the_cli() -> None:
    """docs/conformance.md's plain-pytest command collects the operations `moe-ep conformance` passes
    (so both run the same quick cases); the command's help, which the page points at, gives the tables'
    EP sizes and --timeout's meaning and default."""
    from moe_ep_conformance.cases import OPERATIONS, all_cases
    from moe_ep_conformance.cli import pytest_args

    from moe_ep_spec.cli import build_parser

    text = (ROOT / "docs" / "conformance.md").read_text()
    listed = re.search(r'-o python_functions="([^"]+)"', text).group(1).split()
    args = build_parser().parse_args(["conformance", "--quick"])
    passed = next(a for a in pytest_args(args) if a.startswith("python_functions="))
    assert listed == list(OPERATIONS) == passed.split("=", 1)[1].split()
    for quick in (False, True):
        assert sorted({c.num_ranks for c in all_cases(quick=quick)}) == [1, 2, 3, 4]
    # The options are described once, in the command's help, which the page points at.
    assert "`moe-ep conformance --help` describes every option" in text
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["conformance"]
    helps = {o: a.help for a in sub._actions for o in a.option_strings}
    assert "EP sizes 1 to 4" in helps["--ep-size"]
    for words in ("process-per-rank", "--isolate", "120"):
        assert words in helps["--timeout"], words
    assert next(a for a in sub._actions if "--timeout" in a.option_strings).default == 120.0


def _anchors(path: Path) -> set:
    """The GitHub anchors of a markdown file's headings."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    heads = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_links_in_the_readme_and_docs_point_at_existing_files_and_headings() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_xdist_summary_counts_the_deselected_tests(tmp_path: Path) -> None:
    """README, Tests: under pytest-xdist the summary says how many tests `-m "not slow"` left out."""
    import subprocess

    assert "deselected by -m 'not slow'" in (ROOT / "README.md").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-m", "not slow", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "test_native_build.py")],  # every test of it is slow
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert re.search(r"^\d+ deselected by -m 'not slow'$", proc.stdout, flags=re.M), proc.stdout + proc.stderr
