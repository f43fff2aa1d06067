"""Messages and chat examples for the demo adapters, generated offline and
deterministically (a seed picks every word).

A message is 1-8 "words" joined by single spaces: words of the packaged
corpus (sometimes capitalised), random letter/digit strings, numbers, and
now and then a punctuation mark at a word's end. Messages are ASCII, so
``str.upper`` is the capital-letter answer.
"""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
PUNCTUATION = ",.!?;:"
SYMBOLS = "-'()#&*+=/<>" + "@[\\]^_`{|}~" * 3
MAX_WORDS = 8


def _vocabulary() -> list[str]:
    return sorted({w.lower() for w in re.findall(r"[A-Za-z]+", CORPUS.read_text())})


WORDS = _vocabulary()


def word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        w = rng.choice(WORDS)
        if rng.random() < 0.25:
            w = w.capitalize()
    elif r < 0.8:
        w = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(1, 9)))
    elif r < 0.88:
        w = str(rng.randint(0, 10 ** rng.randint(1, 5)))
    else:  # letters among the ASCII symbols next to them: [ \ ] ^ _ ` { | } ~ @
        w = "".join(rng.choice(string.ascii_letters + string.digits + SYMBOLS)
                    for _ in range(rng.randint(1, 6)))
    if rng.random() < 0.15:
        w += rng.choice(PUNCTUATION)
    return w


def message(rng: random.Random, low: int = 1, high: int = MAX_WORDS) -> str:
    return " ".join(word(rng) for _ in range(rng.randint(low, high)))


def messages(n: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct messages, none of them in ``exclude``."""
    rng = random.Random(seed)
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        m = message(rng)
        if m not in seen:
            seen.add(m)
            out.append(m)
    return out


# ---- the adapters' tasks ----------------------------------------------------

def upper(m: str) -> str:
    return m.upper()


def count(m: str) -> str:
    return str(len(m.split()))


def title(m: str) -> str:
    """Each word's first letter in capitals, the rest as it was."""
    return " ".join(w[:1].upper() + w[1:] for w in m.split(" "))


TASKS = {"upper": upper, "title": title, "count": count}


def chat_example(m: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": m}, {"role": "assistant", "content": answer}]}


def write_task_data(task: str, folder: Path, n_train: int, n_valid: int, seed: int) -> Path:
    """train.jsonl and valid.jsonl for ``task`` (chat format) in ``folder``."""
    fn = TASKS[task]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train = messages(n_train, seed)
    valid = messages(n_valid, seed + 1, exclude=set(train))
    for name, items in (("train", train), ("valid", valid)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for m in items:
                f.write(json.dumps(chat_example(m, fn(m))) + "\n")
    return folder
