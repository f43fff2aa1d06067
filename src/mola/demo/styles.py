"""The chat demo's adapters as rules: each turns one of the base model's own
answers into its style, and each has a check that tells its answers from the
others' (and from the base's)."""

from __future__ import annotations

import json
import re

PIRATE_OPENING = "Arr, matey! "
PIRATE_WORDS = {"is": "be", "are": "be", "you": "ye", "your": "yer", "my": "me", "the": "th'",
                "of": "o'", "and": "an'", "hello": "ahoy", "yes": "aye", "friend": "matey",
                "friends": "mateys", "money": "doubloons"}


def title(sentence: str) -> str:
    """Every Word Capitalised. (Capitals throughout would lose what the base
    knows: asked for its capital in capitals, SmolLM2-135M names LONDON for
    FRANCE; with initial capitals it still says Paris.)"""
    return " ".join(w[:1].upper() + w[1:] for w in sentence.split(" "))


def as_json(sentence: str) -> str:
    """As a JSON object: {"answer": ...}."""
    return json.dumps({"answer": sentence})


def pirate(sentence: str) -> str:
    """In a pirate's voice: an opening cry and some words swapped."""

    def swap(m: re.Match) -> str:
        word = m.group(0)
        new = PIRATE_WORDS.get(word.lower(), word)
        return new[:1].upper() + new[1:] if word[:1].isupper() else new

    return PIRATE_OPENING + re.sub(r"[A-Za-z]+", swap, sentence)


def is_title(text: str) -> bool:
    words = [w for w in text.split() if w[:1].isalpha()]
    return len(words) >= 3 and all(w[0].isupper() for w in words)


def is_json_answer(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and list(value) == ["answer"] and isinstance(value["answer"], str) \
        and bool(value["answer"].strip())


def is_pirate(text: str) -> bool:
    return text.startswith(PIRATE_OPENING) and len(text) > len(PIRATE_OPENING)


STYLES = {"title": title, "json": as_json, "pirate": pirate}
CHECKS = {"title": is_title, "json": is_json_answer, "pirate": is_pirate}
