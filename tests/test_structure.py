"""The project's import structure, read from the sources (nothing is imported):
no import cycle between the project's Python files, and no backend importing a
project package its distribution does not declare as a dependency (a backend
reaching into a sibling backend goes through the registry instead)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]

#: (the folder that holds the package, package name) of every project package.
PACKAGE_ROOTS = (
    ("", "moe_ep_spec"),
    ("reference", "moe_ep_reference"),
    ("conformance", "moe_ep_conformance"),
    ("bench", "moe_ep_bench"),
    ("backends/torch", "moe_ep_torch"),
    ("backends/cuda_nccl", "moe_ep_cuda_nccl"),
    ("backends/jax", "moe_ep_jax"),
    ("backends/jax_ffi", "moe_ep_jax_ffi"),
    ("backends/native", "moe_ep_native"),
)


def _modules() -> Dict[str, Path]:
    """Dotted module name -> file, for the project's packages and the test helpers
    (``tests/*.py``, imported by their bare names)."""
    out: Dict[str, Path] = {}
    for base, package in PACKAGE_ROOTS:
        top = ROOT / base / package
        for path in sorted(top.rglob("*.py")):
            parts = list(path.relative_to(ROOT / base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    for path in sorted((ROOT / "tests").glob("*.py")):
        out[path.stem] = path
    return out


def _is_package(name: str, modules: Dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, modules: Dict[str, Path]) -> Iterator[Tuple[str, int]]:
    """The project modules ``name`` imports anywhere in its file (a function's
    deferred import included), with the line: ``from p import m`` counts as
    importing the submodule ``p.m`` when there is one, else ``p``."""
    path = modules[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".") if package else []
                anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if sub in modules:
                    yield sub, node.lineno
                else:
                    target = _known(base, modules)
                    if target is not None:
                        yield target, node.lineno


def _known(dotted: str, modules: Dict[str, Path]) -> Optional[str]:
    """The longest prefix of ``dotted`` that is a project module, or None."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _graph() -> Tuple[Dict[str, Path], Dict[str, Dict[str, int]]]:
    modules = _modules()
    graph: Dict[str, Dict[str, int]] = {}
    for name in modules:
        edges: Dict[str, int] = {}
        for target, line in _imports(name, modules):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return modules, graph


def _cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle_between_the_project_files() -> None:
    modules, graph = _graph()
    assert len(modules) > 50 and sum(map(len, graph.values())) > 100  # the scan found the project
    problems = []
    for component in _cycles(graph):
        members = set(component)
        edges = [
            f"{modules[a].relative_to(ROOT)}:{line} imports {b}"
            for a in component
            for b, line in sorted(graph[a].items())
            if b in members
        ]
        problems.append("cycle among " + ", ".join(component) + ":\n    " + "\n    ".join(edges))
    assert not problems, "\n".join(problems)


def _distributions() -> Dict[str, Tuple[Set[str], Set[str]]]:
    """Distribution name -> (its packages, the distributions it depends on), from
    every project ``pyproject.toml``."""
    out = {}
    for path in [ROOT / "pyproject.toml", *sorted(ROOT.glob("*/pyproject.toml")), *sorted(ROOT.glob("backends/*/pyproject.toml"))]:
        data = tomllib.loads(path.read_text())
        project = data["project"]
        tool = data.get("tool", {})
        packages = tool.get("setuptools", {}).get("packages") or tool.get("scikit-build", {}).get("wheel", {}).get("packages")
        assert packages, f"{path.relative_to(ROOT)}: no packages found"
        deps = {req.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip() for req in project.get("dependencies", [])}
        out[project["name"]] = ({p.split(".")[0] for p in packages}, deps)
    return out


def test_backends_import_only_the_project_packages_they_depend_on() -> None:
    modules, graph = _graph()
    dists = _distributions()
    owner = {package: dist for dist, (packages, _) in dists.items() for package in packages}
    backends = {owner[package] for base, package in PACKAGE_ROOTS if base.startswith("backends/")}
    assert {"moe-ep-torch", "moe-ep-cuda-nccl", "moe-ep-jax", "moe-ep-jax-ffi", "moe-ep-native"} <= backends
    problems = []
    for name, edges in sorted(graph.items()):
        top = name.split(".")[0]
        dist = owner.get(top)
        if dist not in backends:
            continue
        allowed = dists[dist][0] | {p for dep in dists[dist][1] if dep in dists for p in dists[dep][0]}
        for target, line in sorted(edges.items()):
            target_top = target.split(".")[0]
            if target_top in owner and target_top not in allowed:
                problems.append(
                    f"{modules[name].relative_to(ROOT)}:{line} imports {target} (distribution {owner[target_top]}), "
                    f"which {dist} does not depend on: reach that backend through moe_ep_spec.get_backend"
                )
    assert not problems, "\n".join(problems)
