"""The embedded demo: what `mola serve` serves with no --model.

    chat.py       the chat demo: SmolLM2-135M-Instruct (fetched once) and three adapters
    questions.py  its training and held-out questions, generated offline
    answers.py    the base model's own first sentences to them (greedy, mlx-lm)
    styles.py     the adapters' rules on those answers, and a check for each style
    echo.py       the echo demo, served when the real model cannot be had (offline, a hash
                  mismatch): a tiny base built weight by weight and three adapters
    echo_base.py  its base model, written to a directory (echo_circuit.py: the weights layer
                  by layer; echo_layout.py: where each feature lives)
    echo_data.py  its adapters' training data, generated offline
    tokenizer.py  the byte-level tokenizer and ChatML template of the echo base (and of the
                  test fixtures' tiny models), trained on corpus.txt
    common.py     what both share: committed adapters, builds renamed into place
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .common import stderr


@dataclass(frozen=True)
class Demo:
    kind: str  # "chat" or "echo"
    model: Path  # the base model: the GGUF file, or the echo model's directory
    name: str  # the base model's id
    adapters: dict[str, Path]  # model id -> adapter


def ensure_demo(cache_dir: Path | None = None, kind: str = "chat") -> Demo:
    """The chat demo (``kind`` "chat"), or the echo demo: asked for, or
    instead of the chat demo, saying why, when its model cannot be had."""
    from ..models.fetch import FetchError
    from . import chat, echo

    if kind == "echo":
        model, adapters = echo.ensure_demo(cache_dir)
        return Demo("echo", model, echo.NAME, adapters)
    try:
        model, adapters = chat.ensure_demo(cache_dir)
        return Demo("chat", model, chat.NAME, adapters)
    except FetchError as e:
        model, adapters = echo.ensure_demo(cache_dir)
        stderr(f"[mola] the chat demo's model ({chat.NAME}) cannot be had: {e.message}")
        stderr(f"[mola] serving the echo demo instead: {echo.NAME} (it echoes the message) and "
               f"{', '.join(adapters)}")
        return Demo("echo", model, echo.NAME, adapters)
