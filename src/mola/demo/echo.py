"""The echo demo: what `mola serve` serves with no --model when the real chat
model (mola.demo.chat) cannot be had, e.g. offline.

One small base model and three adapters whose answers differ at a glance:

    mola-demo  echoes the message          "hello world, how are you?"
    upper      answers in capitals         "HELLO WORLD, HOW ARE YOU?"
    title      capitalises every word      "Hello World, How Are You?"
    count      counts the words            "5"

The base (``mola.demo.echo_base``) is a 4-layer llama whose copy circuit is
built weight by weight: it echoes the last user message byte for byte, behind
a system prompt or the tools preamble too. Each adapter is a rank-8 LoRA
*trained* with ``mola train`` (the same function the command runs) on
generated chat data (``mola.demo.echo_data``); a build takes a few
minutes on two CPU cores.

A source checkout commits the trained adapters under ``adapters/echo/``
(30 KB; ``devtools/build_demo.py --demo echo`` retrains them) with the SHA-256
of the base they were trained on; the base itself (4 MB) is not committed: the
first `mola serve` that needs it builds it into the cache directory
($MOLA_CACHE, else ~/.cache/mola) in a few seconds and checks it against that
hash. An installed package has no such directory: base and adapters are then
built there (a few minutes, reporting progress). Every build goes to a
temporary directory renamed into place when done.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..cache import default_cache_dir
from .echo_data import write_task_data
from .common import BASE_HASH_FILE  # noqa: F401 (the committed hash's file name, named here too)
from .common import adapters_are_built as _built, build_into, checkout_adapters_dir, read_base_hash
from .common import stderr as _stderr
from .echo_base import build_echo_model

NAME = "mola-demo"  # the base model's id
DEMO_VERSION = "2"
BASE = "base"  # the base model's directory inside the demo directory
SEED = 0


@dataclass(frozen=True)
class Recipe:
    """How one demo adapter is trained: its data and its `mola train` options."""

    task: str  # a key of mola.demo.echo_data.TASKS
    targets: tuple[str, ...]
    iters: int
    learning_rate: float
    rank: int = 8
    layers: int = 1  # the last block: the base's features for adapters live there
    batch_size: int = 16
    warmup: int = 20
    train_examples: int = 4000
    valid_examples: int = 64
    options: dict = field(default_factory=dict)


RECIPES = {
    "upper": Recipe("upper", ("down_proj",), iters=200, learning_rate=1e-2),
    "title": Recipe("title", ("down_proj",), iters=200, learning_rate=1e-2),
    "count": Recipe("count", ("down_proj",), iters=200, learning_rate=1e-2),
}
DEMO_ADAPTERS = tuple(RECIPES)


def demo_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"demo-v{DEMO_VERSION}"


def checkout_demo_dir() -> Path:
    """Where a source checkout keeps the committed echo adapters: <repo>/adapters/echo."""
    return checkout_adapters_dir() / "echo"


def base_is_built(path: Path) -> bool:
    return (Path(path) / "config.json").is_file() and (Path(path) / "model.safetensors").is_file()


def adapters_are_built(path: Path, adapters: tuple[str, ...] | None = None) -> bool:
    return _built(path, DEMO_ADAPTERS if adapters is None else adapters)


def is_complete(path: Path, adapters: tuple[str, ...] | None = None) -> bool:
    """The base model and every adapter are there."""
    return base_is_built(Path(path) / BASE) and adapters_are_built(path, adapters)


def base_hash(base: Path) -> str:
    """SHA-256 of the base's weights file."""
    return hashlib.sha256((Path(base) / "model.safetensors").read_bytes()).hexdigest()


def build_demo(target: Path, log: Callable[[str], None] = _stderr,
               recipes: dict[str, Recipe] | None = None, keep_data: Path | None = None) -> Path:
    """Build the base model and the adapters into ``target``: the base with
    ``mola.demo.echo_base``, each adapter with ``mola train``'s own function
    on data generated for its task. ``keep_data`` keeps the data folders."""
    from ..train import TrainConfig, train_adapter

    recipes = RECIPES if recipes is None else recipes
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    total = 1 + len(recipes)
    t0 = time.perf_counter()
    log(f"[mola] building the echo demo (1/{total}): the base model")
    base = build_echo_model(target / BASE, seed=SEED)
    with tempfile.TemporaryDirectory(prefix="mola-echo-data-") as tmp:
        data_root = Path(keep_data) if keep_data else Path(tmp)
        for step, (name, r) in enumerate(recipes.items(), start=2):
            log(f"[mola] building the echo demo ({step}/{total}): adapter '{name}' "
                f"({r.task}: {r.iters} iterations of mola train)")
            data = write_task_data(r.task, data_root / name, r.train_examples, r.valid_examples,
                                   seed=SEED + step)
            train_adapter(TrainConfig(
                model=str(base), data=data, out=target / name, rank=r.rank, layers=r.layers,
                targets=r.targets, iters=r.iters, batch_size=r.batch_size, learning_rate=r.learning_rate,
                lr_schedule="cosine", warmup=r.warmup, grad_clip=1.0, mask_prompt=True, seed=SEED,
                steps_per_report=50, steps_per_eval=r.iters, force=True, **r.options,
            ), log=log)
            _record_origin(target / name, task=r.task, examples=r.train_examples, seed=SEED + step)
    log(f"[mola] echo demo built in {time.perf_counter() - t0:.0f} s")
    return target


def _record_origin(adapter: Path, task: str, examples: int, seed: int) -> None:
    """Name the base and data in adapter_config.json reproducibly instead of
    by the temporary paths the build used."""
    import json

    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config["model"] = f"the mola-demo base model (mola.demo.echo_base, seed {SEED})"
    config["data"] = (f"mola.demo.echo_data task '{task}': {examples} generated chat examples, "
                      f"seed {seed}")
    path.write_text(json.dumps(config, indent=2) + "\n")


def ensure_base(cache_dir: Path | None = None, expected_hash: str | None = None) -> Path:
    """The echo demo's base model, built into the cache on first use (seconds).
    Warns when it differs from ``expected_hash``, the base the committed
    adapters were trained on."""
    base = demo_dir(cache_dir) / BASE
    if not base_is_built(base):
        _stderr(f"[mola] building the echo demo's base model into {base} (a few seconds; later runs reuse it)")
        build_into(base, lambda tmp: build_echo_model(tmp, seed=SEED))
    if expected_hash is not None and base_hash(base) != expected_hash:
        _stderr(f"[mola] warning: the echo demo's base built here differs from the one its adapters were "
                f"trained on (sha256 {expected_hash[:12]}...); their answers may differ. "
                f"Rebuild them with: python devtools/build_demo.py --demo echo")
    return base


def ensure_demo(cache_dir: Path | None = None,
                recipes: dict[str, Recipe] | None = None) -> tuple[Path, dict[str, Path]]:
    """The echo demo's base model directory and adapters: in a source checkout the
    committed adapters, on a base built into the cache; elsewhere base and
    adapters built into the cache on first use."""
    recipes = RECIPES if recipes is None else recipes
    names = tuple(recipes)
    checkout = checkout_demo_dir()
    if adapters_are_built(checkout, names):
        return ensure_base(cache_dir, read_base_hash(checkout)), {name: checkout / name for name in names}
    root = demo_dir(cache_dir)
    if not is_complete(root, names):
        _stderr(f"[mola] first run: building the echo demo's model and adapters into {root} "
                "(a few minutes; later runs reuse it)")
        build_into(root, lambda tmp: build_demo(tmp, recipes=recipes))
    return root / BASE, {name: root / name for name in names}
