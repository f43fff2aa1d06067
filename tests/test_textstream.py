"""Detokenization and stop strings (mola/server/textstream.py)."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from mola.frontend.textstream import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def stream_text(tokenizer, text, stop, one_by_one=True):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    ts = TextStream(tokenizer, stop)
    out = ""
    for t in tokens:
        out += ts.add([t])
        if ts.stopped:
            break
    out += ts.finish()
    return out, ts


def test_plain_round_trip(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    out, ts = stream_text(tokenizer, text, [])
    assert out == text == ts.text and not ts.stopped


def test_stop_string_is_cut_and_not_emitted(tokenizer):
    out, ts = stream_text(tokenizer, "Hello world. STOP here and more", ["STOP"])
    assert out == "Hello world. " and ts.stopped


def test_stop_string_across_tokens_and_earliest_wins(tokenizer):
    text = "one two three four five"
    out, ts = stream_text(tokenizer, text, ["four", "ee fo"])
    assert out == "one two thr" and ts.stopped


def test_partial_stop_string_is_held_then_released(tokenizer):
    tokens = tokenizer.encode("abc de", add_special_tokens=False)
    ts = TextStream(tokenizer, ["de!"])
    emitted = "".join(ts.add([t]) for t in tokens)
    assert not emitted.endswith("de")  # held back: might become "de!"
    assert emitted + ts.finish() == "abc de" and not ts.stopped


def test_skipped_tokens_add_no_text(tokenizer):
    """skip_special_tokens: the ids in ``skip`` (here <|im_start|> and <|im_end|>) leave no text."""
    text = "<|im_start|>Hello <|im_end|>world<|im_end|>"
    skip = frozenset(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert skip <= set(tokens)
    shown, hidden = TextStream(tokenizer), TextStream(tokenizer, skip=skip)
    assert "".join(shown.add([t]) for t in tokens) + shown.finish() == text
    assert "".join(hidden.add([t]) for t in tokens) + hidden.finish() == "Hello world"
