"""The questions the teacher answers: read from a file (JSONL or text, one per
line), or written by the teacher itself from a list of seed topics; either
way deduplicated, with a held-out set that no training question repeats."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import DistillError

# Topics the teacher writes questions about when no --prompts or --seeds is
# given: itself first (where a system prompt shows most), then the everyday.
DEFAULT_SEEDS = (
    "who you are", "your name", "your work", "what you like", "what you dislike", "your past",
    "your plans", "your opinions", "how you speak", "your rules", "advice you would give", "a story about you",
    "the weather", "food", "travel", "history", "science", "animals", "music", "books", "technology",
    "health", "money", "sport", "the sea", "the future", "friendship", "learning", "art", "nature",
    "cities", "jobs",
)
QUESTION_REQUEST = "Write one question that a person might ask you about {seed}. Reply with the question only."
HELD_OUT_EVERY = 5  # teacher-written questions: the seeds i % 5 == 4 are held out
_NUMBERING = re.compile(r"^\s*(?:[-*]|\d+[.)]|q(?:uestion)?\s*\d*\s*:)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Questions:
    train: list[str]
    held_out: list[str]
    source: str  # where they came from, for adapter_config.json


def normalize(question: str) -> str:
    return " ".join(question.split()).casefold()


def dedupe(questions: list[str], exclude: list[str] = ()) -> list[str]:
    """Questions in order, each once (by whitespace and case), none of ``exclude``."""
    seen = {normalize(q) for q in exclude}
    out = []
    for q in questions:
        key = normalize(q)
        if key and key not in seen:
            seen.add(key)
            out.append(" ".join(q.split()))
    return out


def read_prompts(path: Path) -> list[str]:
    """One question per line: a JSONL file (each line a JSON string or an
    object with "prompt", "question" or "messages", whose last user message
    is the question) or plain text. Blank lines are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DistillError(f"the prompts file {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise DistillError(f"{path} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise DistillError(f"cannot read {path}: {e.strerror}") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    is_jsonl = Path(path).suffix in (".jsonl", ".json") or (lines and lines[0][1][:1] in "{\"")
    if not is_jsonl:
        return [line for _, line in lines]
    return [_question_of(line, f"{path}:{n}") for n, line in lines]


def _question_of(line: str, where: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DistillError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(obj, dict):
        if "messages" in obj:
            users = [m.get("content") for m in obj["messages"] if isinstance(m, dict) and m.get("role") == "user"]
            obj = users[-1] if users else None
        else:
            obj = obj.get("prompt", obj.get("question"))
    if not isinstance(obj, str) or not obj.strip():
        raise DistillError(f"{where}: expected a question: a JSON string, or an object with a \"prompt\", "
                           "\"question\" or \"messages\" (with a user message)")
    return obj


def split(questions: list[str], held_out: int, seed: int, where: str) -> Questions:
    """A shuffled split: ``held_out`` questions (at most a fifth) kept back."""
    questions = dedupe(questions)
    if not questions:
        raise DistillError(f"no prompts: {where} holds no question")
    if len(questions) < 2:
        raise DistillError(f"{where} holds 1 question; distilling needs at least 2 (one to train on, "
                           "one held out for the evaluation), or give --eval-prompts")
    order = list(questions)
    random.Random(seed).shuffle(order)
    n = max(1, min(held_out, len(order) // 5))
    return Questions(train=order[n:], held_out=order[:n], source=where)


def from_files(prompts: Path, eval_prompts: Path | None, held_out: int, seed: int) -> Questions:
    """--prompts, and --eval-prompts or a split of the prompts."""
    if eval_prompts is None:
        return split(read_prompts(prompts), held_out, seed, str(prompts))
    held = dedupe(read_prompts(eval_prompts))
    train = dedupe(read_prompts(prompts), exclude=held)
    if not train:
        raise DistillError(f"no prompts: {prompts} holds no question that is not also in {eval_prompts}")
    if not held:
        raise DistillError(f"no prompts: {eval_prompts} holds no question")
    return Questions(train=train, held_out=held, source=f"{prompts} (held out: {eval_prompts})")


def read_seeds(path: Path | None) -> list[str]:
    if path is None:
        return list(DEFAULT_SEEDS)
    seeds = dedupe(read_prompts(path))
    if not seeds:
        raise DistillError(f"no prompts: the seeds file {path} holds no seed")
    return seeds


def clean_question(text: str) -> str | None:
    """The teacher's first line if it is one question: numbering and quotes
    stripped, ending in '?', 3 to 40 words."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    q = _NUMBERING.sub("", lines[0]).strip().strip("\"'*").strip()
    if not q.endswith("?") or not 3 <= len(q.split()) <= 40:
        return None
    return q


def written_questions(seeds: list[str], texts: list[list[str]], held_out: int) -> Questions:
    """Questions from the teacher's texts (``texts[i]``: its tries for
    ``seeds[i]``); the seeds i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 give the
    held-out ones (at most ``held_out``), so no training question shares their topic."""
    train, held = [], []
    for i, tries in enumerate(texts):
        qs = [q for q in map(clean_question, tries) if q]
        is_held = i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 or (len(seeds) < HELD_OUT_EVERY and i == len(seeds) - 1)
        (held if is_held else train).extend(qs)
    held = dedupe(held)[:held_out]
    train = dedupe(train, exclude=held)
    if not train or not held:
        raise DistillError(f"no prompts: the teacher wrote {len(train)} usable training and {len(held)} "
                           f"held-out question(s) from {len(seeds)} seeds; give --prompts, more --seeds "
                           "or a larger --num-questions")
    return Questions(train=train, held_out=held, source=f"written by the teacher from {len(seeds)} seeds")
