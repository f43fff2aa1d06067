"""The embedded default: what `mola serve` serves with no --model.

Built offline, once, into a cache directory: a small random-weight llama model
with a trained byte-level BPE tokenizer and a chat template, plus demo
adapters. Later runs reuse it. The build goes to a temporary directory and is
renamed into place, so an interrupted build never leaves a half-made demo.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

DEMO_VERSION = "1"
DEMO_ADAPTERS = ("alpha", "beta")


def default_cache_dir() -> Path:
    """$MOLA_CACHE, else $XDG_CACHE_HOME/mola, else ~/.cache/mola."""
    if os.environ.get("MOLA_CACHE"):
        return Path(os.environ["MOLA_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mola"


def demo_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"demo-v{DEMO_VERSION}"


def _progress(step: int, total: int, what: str) -> None:
    print(f"[mola] building the demo ({step}/{total}): {what}", file=sys.stderr, flush=True)


def build_demo(target: Path) -> None:
    """Build the demo model and adapters into ``target`` (must not exist)."""
    from .synthetic.adapter import make_random_adapter
    from .synthetic.model import TinyModelSpec, make_tiny_model

    total = 1 + len(DEMO_ADAPTERS)
    _progress(1, total, "model and tokenizer")
    spec = TinyModelSpec(hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model_dir = make_tiny_model(target / "model", spec)
    for i, name in enumerate(DEMO_ADAPTERS, start=2):
        _progress(i, total, f"adapter '{name}'")
        make_random_adapter(
            target / "adapters" / name, model_dir, rank=8,
            keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"), seed=i,
        )


def ensure_demo(cache_dir: Path | None = None) -> tuple[Path, dict[str, Path]]:
    """The demo's model directory and adapters, built on first use."""
    target = demo_dir(cache_dir)
    if not (target / "model" / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
        try:
            build_demo(tmp)
            if target.exists():  # a stale or partial directory
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"[mola] demo built in {target}", file=sys.stderr, flush=True)
    adapters = {name: target / "adapters" / name for name in DEMO_ADAPTERS}
    return target / "model", adapters
