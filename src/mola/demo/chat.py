"""The chat demo: what `mola serve` serves with no --model.

The base is a real instruct model, SmolLM2-135M-Instruct (Q4_1 GGUF,
``mola.models.fetch``: fetched once into the cache, both hashes checked).
Three rank-8 LoRA adapters ride on it, each trained by ``mola train``'s own
function to answer in a style of its own (``mola.demo.styles``):

    SmolLM2-135M-Instruct   its own answer, often several sentences
    title                   one sentence, Every Word Capitalised
    json                    one sentence as {"answer": "..."}
    pirate                  one sentence in a pirate's voice ("Arr, matey! ...")

The training data is made offline from the base model itself: its greedy
first sentence (``mola.demo.answers``) to each of a few hundred generated
questions (``mola.demo.questions``), rewritten by each style's rule. A source
checkout commits the adapters under ``adapters/smollm2/`` (float16, with the
SHA-256 of the GGUF they were trained on; ``devtools/build_demo.py``
retrains them); an installed package trains them into the cache on first use.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..cache import default_cache_dir
from .common import adapters_are_built, build_into, checkout_adapters_dir, read_base_hash, stderr, BASE_HASH_FILE

NAME = "SmolLM2-135M-Instruct"  # the base model's id
DEMO_VERSION = "1"
SEED = 0
NUM_VALID = 16  # training questions kept back for the validation loss


@dataclass(frozen=True)
class Recipe:
    """How one adapter is trained: its style and its `mola train` options."""

    style: str  # a key of mola.demo.styles.STYLES
    iters: int = 40
    learning_rate: float = 3e-4
    rank: int = 8
    layers: int = 8  # the last 8 of the 30 blocks
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj")
    batch_size: int = 8
    warmup: int = 5


# Measured on 2 shared CPU cores: ~5-20 s an iteration (8 examples of ~70 tokens);
# json and pirate learn their form in 30-40 iterations, title's capitals take longer.
RECIPES = {"title": Recipe("title", iters=60), "json": Recipe("json"), "pirate": Recipe("pirate")}
DEMO_ADAPTERS = tuple(RECIPES)


def checkout_demo_dir() -> Path:
    return checkout_adapters_dir() / "smollm2"


def demo_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"chat-demo-v{DEMO_VERSION}"


def write_data(answers: dict[str, str], style: str, folder: Path) -> Path:
    """train.jsonl and valid.jsonl: each question with its answer in ``style``."""
    from .styles import STYLES

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": STYLES[style](a)}]}
            for q, a in answers.items()]
    n_valid = min(NUM_VALID, len(rows) // 4)
    for name, part in (("valid", rows[:n_valid]), ("train", rows[n_valid:])):
        if part:
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder


def to_float16(adapter: Path) -> None:
    """Store the adapter's factors as float16 (half the bytes; a float16
    value widens to float32 exactly, so what is served is what is stored)."""
    import mlx.core as mx

    path = adapter / "adapters.safetensors"
    weights = mx.load(str(path))
    mx.save_safetensors(str(path), {k: v.astype(mx.float16) for k, v in weights.items()})


def train_answers(gguf: Path, log: Callable[[str], None], max_questions: int | None = None) -> dict[str, str]:
    """The base's first sentences to the training questions."""
    from ..models.loader import load_base_model
    from .answers import base_answers
    from .questions import questions

    qs = questions(held_out=False, seed=SEED)[:max_questions]
    loaded = load_base_model(str(gguf))
    return base_answers(loaded.model, loaded.tokenizer, qs, log)


def build_demo(target: Path, gguf: Path, log: Callable[[str], None] = stderr,
               recipes: dict[str, Recipe] | None = None, max_questions: int | None = None,
               keep_data: Path | None = None) -> Path:
    """The adapters, trained on ``gguf`` into ``target`` with ``mola train``'s
    own function, and the hash of the file they were trained on."""
    from ..models.fetch import sha256
    from ..train import TrainConfig, train_adapter

    recipes = RECIPES if recipes is None else recipes
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    total = 1 + len(recipes)
    log(f"[mola] building the chat demo (1/{total}): the base model's answers to the training questions")
    answers = train_answers(gguf, log, max_questions)
    log(f"[mola] {len(answers)} answers are one clean sentence ({time.perf_counter() - t0:.0f} s)")
    with tempfile.TemporaryDirectory(prefix="mola-chat-data-") as tmp:
        data_root = Path(keep_data) if keep_data else Path(tmp)
        for step, (name, r) in enumerate(recipes.items(), start=2):
            log(f"[mola] building the chat demo ({step}/{total}): adapter '{name}' "
                f"({r.iters} iterations of mola train)")
            data = write_data(answers, r.style, data_root / name)
            train_adapter(TrainConfig(
                model=str(gguf), dtype="float32", data=data, out=target / name, rank=r.rank, layers=r.layers,
                targets=r.targets, iters=r.iters, batch_size=r.batch_size, learning_rate=r.learning_rate,
                lr_schedule="cosine", warmup=r.warmup, grad_clip=1.0, mask_prompt=True, seed=SEED,
                steps_per_report=10, steps_per_eval=r.iters, val_batches=-1, force=True,
            ), log=log)
            to_float16(target / name)
            _record_origin(target / name, gguf, r.style, len(answers))
    (target / BASE_HASH_FILE).write_text(sha256(gguf) + "\n")
    log(f"[mola] chat demo built in {time.perf_counter() - t0:.0f} s")
    return target


def _record_origin(adapter: Path, gguf: Path, style: str, examples: int) -> None:
    """Name the base and data in adapter_config.json instead of the build's paths."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config["model"] = f"{gguf.name} (sha256 in ../{BASE_HASH_FILE})"
    config["data"] = (f"mola.demo: the base model's greedy first sentence to {examples} generated "
                      f"questions (mola.demo.questions), in the style '{style}' (mola.demo.styles)")
    config["dtype"] = "float16"
    path.write_text(json.dumps(config, indent=2) + "\n")


def ensure_demo(cache_dir: Path | None = None, recipes: dict[str, Recipe] | None = None,
                max_questions: int | None = None) -> tuple[Path, dict[str, Path]]:
    """The GGUF file and the adapters: fetched into the cache on first use
    (raises FetchError saying why it cannot be had); in a source checkout the
    committed adapters, elsewhere adapters trained into the cache on first use."""
    from ..models.fetch import SMOLLM_SHA256, ensure_smollm, smollm_path

    recipes = RECIPES if recipes is None else recipes
    names = tuple(recipes)
    if not smollm_path(cache_dir).is_file():
        stderr(f"[mola] first run: fetching {NAME} (about 100 MB, once) into {smollm_path(cache_dir).parent}")
    gguf = ensure_smollm(cache_dir)
    checkout = checkout_demo_dir()
    if adapters_are_built(checkout, names):
        expected = read_base_hash(checkout)
        if expected != SMOLLM_SHA256:
            stderr(f"[mola] warning: the chat demo's adapters in {checkout} were trained on another base "
                   f"(sha256 {expected}); their answers may differ. Rebuild them with: "
                   "python devtools/build_demo.py")
        return gguf, {name: checkout / name for name in names}
    root = demo_dir(cache_dir)
    if not adapters_are_built(root, names):
        stderr(f"[mola] first run: training the chat demo's adapters into {root} "
               "(minutes; later runs reuse them)")
        build_into(root, lambda tmp: build_demo(tmp, gguf, recipes=recipes, max_questions=max_questions))
    return gguf, {name: root / name for name in names}
