"""The house's figures: files over 300 lines, functions over 50, import
circles between modules, and `sleep` calls in the tests (STYLE.md's rules 1
and 14, and issue 25's before/after table).

    python devtools/house.py [--root .] [--list]

Reads the source with ast only: it imports nothing from mola, so it runs on
any checkout, including an old one (``--root`` another worktree).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 50


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, src: Path, tree: ast.Module) -> set[str]:
    """Every module under ``src`` that ``path`` imports, function-local imports
    included; ``from x import y`` counts ``x.y`` when ``x.y`` is a module."""
    here = module_name(path, src).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def import_graph(src: Path) -> dict[str, set[str]]:
    trees = {module_name(p, src): (p, ast.parse(p.read_text())) for p in sorted(src.rglob("*.py"))}
    graph = {}
    for name, (path, tree) in trees.items():
        edges = {m for m in imports_of(path, src, tree) if m in trees and m != name}
        # importing a package's submodule runs the package's __init__ too, but an
        # __init__ that only documents the package adds no edge worth a circle
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def long_files(src: Path) -> list[tuple[int, str]]:
    rows = [(len(p.read_text().splitlines()), str(p.relative_to(src))) for p in src.rglob("*.py")]
    return sorted((r for r in rows if r[0] > MAX_FILE_LINES), reverse=True)


def long_functions(src: Path) -> list[tuple[int, str]]:
    rows = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    rows.append((length, f"{path.relative_to(src)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)


def sleeps(tests: Path) -> list[str]:
    rows = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "sleep":
                    rows.append(f"{path.relative_to(tests)}:{node.lineno}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=Path(__file__).resolve().parents[1], type=Path)
    parser.add_argument("--list", action="store_true", help="list each file, function, circle and sleep")
    args = parser.parse_args(argv)
    src, tests = args.root / "src", args.root / "tests"
    figures = {
        f"files over {MAX_FILE_LINES} lines": long_files(src),
        f"functions over {MAX_FUNCTION_LINES} lines": long_functions(src),
        "import circles between modules": circles(import_graph(src)),
        "sleep calls in tests": sleeps(tests),
    }
    for label, rows in figures.items():
        print(f"{len(rows):4d}  {label}")
        if args.list:
            for row in rows:
                print(f"        {row}")


if __name__ == "__main__":
    main()
