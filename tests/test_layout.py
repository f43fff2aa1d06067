"""The floors of the package, a check of the source itself: every part of
mola (package or top-level module) imports only the parts it stands on; no
module imports another in a circle, anywhere in the package (the import graph
is devtools/house.py's, function-local imports included); no module reaches
into another's private names; nothing but the tests imports mola.testing; and
nothing outside the engine reads its thread-owned internals."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import mola

SRC = Path(mola.__file__).parent
ROOT = Path(__file__).resolve().parents[1]


def _load_house():
    """devtools/house.py (a script, not a package): its import graph and circles."""
    spec = importlib.util.spec_from_file_location("house", ROOT / "devtools" / "house.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


house = _load_house()

# Each part of the package, with the parts it may import from (they sit below
# it). A part not named here may not be imported; a new part must be added.
BASE = ("errors", "cache")  # plain helpers every part may use
BELOW = {
    "errors": (),  # domain errors, no HTTP in them
    "cache": (),  # where mola keeps what it fetches and builds
    "blas": (),  # which BLAS the CPU's matmuls run on
    # the device math (layers, packs)
    "lora": BASE,
    # reading adapters, on the math; below the models (GGUF bases share its tensor names)
    "adapters": (*BASE, "lora"),
    # who holds which slot: on adapters; below the server that drives it and the config that names adapters
    "registry": (*BASE, "lora", "adapters"),
    "models": (*BASE, "lora", "adapters"),
    "engine": (*BASE, "lora", "adapters", "models"),
    "structured": (*BASE, "lora", "adapters", "models", "engine"),
    # images on a resident diffusion base (mflux): the LoRA layer and the adapter path policy
    "images": (*BASE, "lora", "registry"),
    "config": (*BASE, "lora", "adapters", "registry", "models", "engine"),
    "train": (*BASE, "blas", "lora", "adapters", "registry", "models"),
    "validate": (*BASE, "lora", "adapters", "registry", "models", "engine"),
    # everything the first command serves: built with mola train, never served from here
    "demo": (*BASE, "lora", "adapters", "models", "train"),
    # test fixtures: they build models and adapters, never serve them
    "testing": (*BASE, "lora", "adapters", "models", "demo", "images"),
    "distill": (*BASE, "blas", "lora", "adapters", "registry", "models", "train", "demo"),
    # mola chat is a client: it speaks HTTP to a server, never to the model
    "chat": BASE,
    # what a training loop imports to push its adapter to a server: HTTP only
    "client": (),
    # the request pipeline, with no HTTP in it: spec -> admission -> one tokenizer trip -> engine
    "frontend": (*BASE, "lora", "adapters", "registry", "models", "engine", "structured", "config"),
    # the control plane of base models (load, unload, keep-alive, leases): no HTTP, nothing of the server's
    "bases": (*BASE, "lora", "adapters", "registry", "models", "engine", "structured", "config", "frontend"),
    "server": (*BASE, "blas", "lora", "adapters", "registry", "models", "engine", "structured", "config",
               "images", "frontend", "bases"),
    "serve": (*BASE, "blas", "lora", "adapters", "registry", "models", "engine", "structured", "config", "server",
              "frontend", "demo", "bases"),
    # replicas on Ray Serve: mola's app in each replica, behind an ingress
    "ray": (*BASE, "blas", "lora", "adapters", "registry", "models", "engine", "structured", "config", "server",
            "frontend", "demo", "bases", "serve"),
    "cli": (*BASE, "blas", "adapters", "registry", "models", "engine", "config", "serve", "train", "validate",
            "chat", "distill", "demo", "ray"),
    "__main__": ("cli",),
}
ENGINE_INTERNALS = {"scheduler", "runner", "packs", "_commands"}
THREAD_OWNED = {"scheduler", "runner", "packs"}  # what only the engine thread may read
# Private names used across modules on purpose: (module, name), each with why.
PRIVATE_ALLOWED = {
    # server/protocol.py's base request bodies, private to the server package: the
    # Anthropic and Responses bodies extend them (a public name, such as SamplingBody,
    # would let these go)
    ("server.anthropic.protocol", "_Body"), ("server.anthropic.protocol", "_Sampling"),
    ("server.responses_api.protocol", "_Sampling"),
    # mlx-lm's BatchRotatingKVCache keeps its write index in ``_idx`` and has no public
    # accessor; cutting a window back after a verification must read and bound it
    # (engine/quantized_cache.py's own ``_idx`` mirrors mlx-lm's BatchKVCache)
    ("engine.verify", "_idx"),
}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """mola's modules -> the modules of mola each imports (house.py's graph)."""
    return house.import_graph(SRC.parent)


def part(module: str) -> str:
    """The part of the package a dotted module name lies in ("" for mola itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_part_of_the_package_is_in_the_table(graph):
    found = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert found == set(BELOW), (found - set(BELOW), set(BELOW) - found)
    assert not graph["mola"], "mola/__init__.py imports nothing of mola's (every part imports it)"


def test_imports_run_one_way_down(graph):
    upward = [f"{module} imports {name}" for module, names in sorted(graph.items()) for name in sorted(names)
              if part(name) not in ("", part(module), *BELOW.get(part(module), ()))]
    assert not upward, upward


def test_the_table_runs_one_way():
    assert not house.circles({p: set(below) for p, below in BELOW.items()})


def test_no_import_circle_between_any_two_modules(graph):
    circles = house.circles(graph)
    assert not circles, circles


def test_the_circle_check_sees_circles_and_every_import_form():
    assert house.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert house.circles({"a": {"b"}, "b": set()}) == []
    path = SRC / "demo" / "x.py"
    source = "def f():\n    from .. import testing\n    from ..registry.slots import SlotTable\n    import mola.lora\n"
    found = house.imports_of(path, SRC.parent, ast.parse(source))
    assert {"mola.testing", "mola.registry.slots", "mola.lora"} <= found


def private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, attributes,
    variables, parameters and import aliases that start with one underscore."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return {n for n in names if is_private(n)}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(trees: dict[str, ast.Module]) -> list[str]:
    """``x._name`` (x not self or cls) and ``from m import _name`` in a module
    of ``trees``, where ``_name`` is another module's of ``trees``, not its own."""
    defined = {name: private_names(tree) for name, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        others = set().union(*(names for other, names in defined.items() if other != module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                if getattr(node.value, "id", None) in ("self", "cls") or node.attr in defined[module]:
                    continue
                if node.attr in others and (module, node.attr) not in PRIVATE_ALLOWED:
                    found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mola")):
                found += [f"{module}:{node.lineno} imports {a.name}" for a in node.names
                          if is_private(a.name) and (module, a.name) not in PRIVATE_ALLOWED]
    return found


def test_no_module_reaches_into_another_modules_private_names():
    trees = {house.module_name(p, SRC): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}
    reaches = private_reaches(trees)
    assert not reaches, reaches


def test_the_private_check_sees_a_reach():
    trees = {"a": ast.parse("class L:\n    def _release(self): ...\n    def ok(self): self._release()\n"),
             "b": ast.parse("from .a import _helper\ndef f(lease): lease._release()\n"),
             "c": ast.parse("def g(x): return x._own\nclass C:\n    _own = 1\n")}
    assert sorted(private_reaches(trees)) == ["b:1 imports _helper", "b:2 lease._release"]


def test_the_frontend_has_no_http_in_it(graph):
    """The request pipeline imports neither FastAPI nor Starlette, nor the
    server: the server's dialects make its specs and send its generations."""
    found = []
    for path in sorted((SRC / "frontend").rglob("*.py")):
        module = house.module_name(path, SRC.parent)
        for name in house.imports_of(path, SRC.parent, ast.parse(path.read_text())):
            if name.split(".")[0] in ("fastapi", "starlette") or name.startswith("mola.server"):
                found.append(f"{module} imports {name}")
    assert not found, found


def test_the_bases_control_plane_knows_no_asgi():
    """Bases load, unload and lease base models with no HTTP in them: no
    FastAPI, Starlette or server import, no ASGI scope, and nothing written
    to the app."""
    found = []
    for path in sorted((SRC / "bases").rglob("*.py")):
        source = path.read_text()
        for name in house.imports_of(path, SRC.parent, ast.parse(source)):
            if name.split(".")[0] in ("fastapi", "starlette", "uvicorn") or name.startswith("mola.server"):
                found.append(f"{path.name} imports {name}")
        found += [f"{path.name} reads {word}" for word in ("scope", "app.state", "app_state") if word in source]
    assert not found, found


def test_the_server_reads_no_engine_internals():
    """The event loop reads the engine's published snapshot, never the
    scheduler, runner or packs that the engine thread mutates."""
    reads = []
    for path in sorted((SRC / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
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


def test_only_the_tests_import_the_testing_package(graph):
    """mola.testing (the fixtures) ships for the tests, benchmarks and devtools;
    nothing else in the package imports it, in any form (``from .. import
    testing`` included)."""
    users = [f"{module} imports {name}" for module, names in sorted(graph.items()) if part(module) != "testing"
             for name in sorted(names) if part(name) == "testing"]
    assert not users, users
