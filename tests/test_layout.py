"""The floors of the package: imports run one way down (between folders, and
between the modules of the adapter packages), and nothing outside the engine
reads its thread-owned internals (a check of the source itself)."""

from __future__ import annotations

import ast
from pathlib import Path

import mola

SRC = Path(mola.__file__).parent
# Each folder, with the folders it must never import from (they sit above it).
ABOVE = {
    # the device math (layers, packs): nothing of mola's sits below it
    "lora": ("adapters", "registry", "models", "structured", "engine", "server", "serve", "cli", "train", "demo",
             "validate", "chat", "config", "testing"),
    # reading adapters: on lora; below the models (GGUF bases share its tensor names) and the registry
    "adapters": ("registry", "models", "structured", "engine", "server", "serve", "cli", "train", "demo",
                 "validate", "chat", "config", "testing"),
    # who holds which slot: on adapters; below the server that drives it and the config that names adapters
    "registry": ("models", "structured", "engine", "server", "serve", "cli", "train", "demo", "validate", "chat",
                 "config", "testing"),
    # mola chat is a client: it speaks HTTP to a server, never to the model
    "chat": ("engine", "server", "lora", "adapters", "registry", "models", "structured", "train", "validate", "serve",
             "cli"),
    "validate": ("server", "serve", "cli", "train", "chat"),
    "engine": ("structured", "server", "serve", "cli", "train", "demo"),
    "structured": ("server", "serve", "cli", "train", "demo"),
    "server": ("serve", "cli", "train", "demo"),
    "models": ("structured", "server", "serve", "cli", "train", "demo"),
    "train": ("server", "serve", "cli", "demo"),
    "demo": ("server", "serve", "cli", "testing"),
    # test fixtures: they build models and adapters, never serve them
    "testing": ("server", "serve", "cli", "chat"),
}
# Packages whose modules must not import each other in a circle either.
NO_CIRCLES = ("lora", "adapters", "registry")
ENGINE_INTERNALS = {"scheduler", "runner", "packs", "_commands"}
THREAD_OWNED = {"scheduler", "runner", "packs"}  # what only the engine thread may read


def modules(folder: str):
    for path in sorted((SRC / folder).rglob("*.py")):
        yield path, ast.parse(path.read_text())


def imported(path: Path, tree: ast.Module) -> list[str]:
    """Every module ``path`` imports, as a dotted name under mola."""
    package = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names.append(".".join([*base, node.module or ""]).rstrip("."))
            elif node.module:
                names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_imports_run_one_way_down():
    upward = []
    for folder, above in ABOVE.items():
        for path, tree in modules(folder):
            for name in imported(path, tree):
                parts = name.split(".")
                if parts[0] == "mola" and len(parts) > 1 and parts[1] in above:
                    upward.append(f"{path.relative_to(SRC)} imports {name}")
    assert not upward, upward


def module_graph(folders) -> dict[str, set[str]]:
    """Module -> the modules of ``folders`` it imports, function-local imports
    included (``from . import x`` names the module ``x``; a package is its
    ``__init__``)."""
    trees = {}
    for folder in folders:
        for path, tree in modules(folder):
            parts = path.relative_to(SRC.parent).with_suffix("").parts
            trees[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (path, tree)
    graph = {}
    for name, (path, tree) in trees.items():
        found = set()
        for stem in imported(path, tree):
            found.add(stem)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = imported(path, ast.Module(body=[node], type_ignores=[]))[0]
                found.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in trees and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import path that leads from a module back to itself."""
    found, done = [], set()

    def visit(node, trail):
        if node in trail:
            found.append(trail[trail.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, trail + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_import_circle_between_the_modules_of_the_adapter_packages():
    assert not circles(module_graph(NO_CIRCLES))


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_server_reads_no_engine_internals():
    """The event loop reads the engine's published snapshot, never the
    scheduler, runner or packs that the engine thread mutates."""
    reads = []
    for path, tree in modules("server"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                reads.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}")
    assert not reads, reads


def test_tests_read_engine_internals_only_on_the_engine_thread():
    """Tests hold to the same rule: a test reads the scheduler, runner or
    packs only inside a function it hands the engine thread (engine.call),
    else it reads the snapshot. (Putting a command on the engine's queue, as
    the dying-engine test does, is not a read.)"""
    reads = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        on_engine = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.Lambda) for sub in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in THREAD_OWNED and id(node) not in on_engine:
                owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
                if owner == "engine":
                    reads.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not reads, reads


def test_only_the_tests_import_the_testing_package():
    """mola.testing (the fixtures) ships for the tests, benchmarks and devtools;
    nothing else in the package imports it."""
    users = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "testing":
            continue
        for name in imported(path, ast.parse(path.read_text())):
            if name == "mola.testing" or name.startswith("mola.testing."):
                users.append(f"{path.relative_to(SRC)} imports {name}")
    assert not users, users
