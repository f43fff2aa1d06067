"""The base model's own answers to the chat demo's questions: greedy, through
mlx-lm's BatchGenerator, each cut at the end of its first sentence. Answers
that are no clean sentence (a list, a number cut at its decimal point, a
ramble with no end in sight) are left out."""

from __future__ import annotations

import re
from typing import Callable

MAX_TOKENS = 48  # a first sentence longer than this is left out
BATCH_SIZE = 32
MAX_WORDS = 40
_SENTENCE = re.compile(r"[A-Z0-9][^\n]*[A-Za-z)][.!?]")


def sentence_ends(tokenizer) -> list[int]:
    """Token ids that end a sentence: their text, trailing space aside, ends in
    . ! or ? and holds no letter or digit ("." and "!" but not "Dr.")."""
    ends = []
    for t in range(len(tokenizer.vocab)):
        text = tokenizer.decode([t]).rstrip()
        if text and text[-1] in ".!?" and not any(c.isalnum() for c in text):
            ends.append(t)
    return ends


def clean_sentence(text: str) -> str | None:
    """``text`` if it is one clean sentence: it starts with a capital or a
    digit, ends with . ! or ? after a letter, holds no newline and 3 to
    MAX_WORDS words."""
    text = text.strip()
    if not _SENTENCE.fullmatch(text) or not 3 <= len(text.split()) <= MAX_WORDS:
        return None
    return text


def base_answers(model, tokenizer, questions: list[str], log: Callable[[str], None]) -> dict[str, str]:
    """question -> the first sentence of the base's greedy answer, for the
    questions whose answer is a clean sentence."""
    from mlx_lm.generate import BatchGenerator

    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(eos) + sentence_ends(tokenizer)],
                         completion_batch_size=BATCH_SIZE, prefill_batch_size=8)
    try:
        uids = gen.insert(prompts, [MAX_TOKENS] * len(prompts))
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        stopped: set[int] = set()  # ended by EOS or a sentence's end, not by MAX_TOKENS
        finished = 0
        while responses := gen.next_generated():
            for r in responses:
                tokens[r.uid].append(r.token)
                if r.finish_reason == "stop":
                    stopped.add(r.uid)
                if r.finish_reason is not None:
                    finished += 1
                    if finished % 64 == 0 or finished == len(uids):
                        log(f"[mola] the base model's answers: {finished}/{len(uids)}")
    finally:
        gen.close()
    out = {}
    for q, u in zip(questions, uids):
        sentence = clean_sentence(tokenizer.decode([t for t in tokens[u] if t not in eos]))
        if u in stopped and sentence is not None:
            out[q] = sentence
    return out
