"""The import graph: the runtime's floors call downward only, and no module anywhere in the
repository imports itself back through others (docs/architecture.md draws the floors)."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A floor may import the floors below it (a smaller number), never one above or beside it.
FLOORS = {
    "errors": 0,
    "util": 1,
    "adapters": 2,
    "components": 3,
    "executor": 3,
    "framework": 4,
    "engine": 5,
    "runtime": 6,  # the package's public face: runtime/__init__.py, demo, bench
    "serve": 7,
    "cli": 8,
    "__main__": 9,
}
EXPORT_MAY_IMPORT = {"errors", "util", "adapters", "export"}  # export/ builds models; it never runs them
HEAVY = ("torch", "litert_torch", "transformers", "peft", "accelerate")
RUNNERS = ("ai_edge_litert.interpreter", "ai_edge_litert.compiled_model")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(folder: str) -> Iterator[Path]:
    """The project's Python files under ``folder``: not those git ignores (in a checkout), such
    as the virtual environment and the sources the llama.cpp benchmark's setup.sh fetches."""
    ignored: list[Path] = []
    if (ROOT / ".git").exists():
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others", "--ignored", "--exclude-standard",
                                 "--directory", "--", folder], capture_output=True, text=True, timeout=60)
        ignored = [ROOT / line.rstrip("/") for line in listed.stdout.splitlines()] if listed.returncode == 0 else []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if not any(path.is_relative_to(place) for place in ignored):
            yield path


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` counts as ``a.b`` and ``a.b.c``),
    relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def floor(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("bench", "demo"):
        return "runtime"
    return parts[1]


def graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    modules = {module_name(path): path for folder in folders for path in python_files(folder)}
    return {name: {target for target in imports(path) if target in modules and target != name}
            for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(edges[start])))]
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_floors_call_downward_only():
    wrong = []
    for source, targets in graph(("runtime",)).items():
        for target in targets:
            here, there = floor(source), floor(target)
            if here == there:
                continue
            if here == "export":
                allowed = there in EXPORT_MAY_IMPORT
            elif there == "export":
                allowed = here == "cli"
            else:
                allowed = FLOORS[there] < FLOORS[here]
            if not allowed:
                wrong.append(f"{source} -> {target}")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(sorted(wrong))


def test_only_export_imports_torch_and_only_the_executor_runs_models():
    wrong = []
    for path in python_files("runtime"):
        name = module_name(path)
        for target in imports(path):
            if target.split(".")[0] in HEAVY and floor(name) != "export":
                wrong.append(f"{name} -> {target}")
            if target.startswith(RUNNERS) and floor(name) not in ("executor", "export"):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("folders", [("runtime",), ("runtime", "tools", "benchmarks", "examples")])
def test_no_import_circle(folders):
    present = tuple(folder for folder in folders if (ROOT / folder).is_dir())
    assert cycles(graph(present)) == []


def test_the_checks_see_a_circle_and_a_wrong_floor():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor("runtime.adapters.lora_data") == "adapters" and floor("runtime.demo") == "runtime"
    assert "runtime.util.scoped_file" in imports(ROOT / "runtime" / "adapters" / "lora_data.py")
