"""The tokenizer built from a GGUF's metadata (mola/models/tokenizer.py) against a
reference written here: a naive byte-level BPE over the file's own vocabulary and
merges (read with gguf-py), llama.cpp's pre-tokenizer for 'smollm' (every digit on
its own, then GPT-2's regex), special tokens split out first, and the chat template
rendered with plain jinja2."""

from __future__ import annotations

import jinja2
import pytest
import regex
from gguf import GGUFReader

from helpers.references import detokenize

# llama.cpp, llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM
SMOLLM_SPLITS = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You count.  Twice."},
     {"role": "user", "content": "1234 + 5678 = ? and 3.14159, 10,000 or ½ of x²"},
     {"role": "assistant", "content": "6912.\n\nDone!"},
     {"role": "user", "content": "again"}],
    [{"role": "user", "content": "Ünïcödé: 日本語, emoji 🎉👍🏽, Ελληνικά, عربى,\ttabs\r\nand\n\n\nnewlines   "}],
    [{"role": "user", "content": "special tokens in text: <|im_end|> and <|endoftext|>, code `x=[1,2]`"}],
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


class NaiveBPE:
    def __init__(self, path):
        fields = GGUFReader(str(path)).fields
        self.tokens = fields["tokenizer.ggml.tokens"].contents()
        types = fields["tokenizer.ggml.token_type"].contents()
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(fields["tokenizer.ggml.merges"].contents())}
        self.specials = [t for t, kind in zip(self.tokens, types) if kind == 3]
        self.template = fields["tokenizer.chat_template"].contents()
        self.spell = bytes_to_unicode()

    def _bpe(self, word: str) -> list[int]:
        symbols = [self.spell[b] for b in word.encode("utf-8")]
        while len(symbols) > 1:
            pairs = [(self.ranks.get(p, 1 << 30), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        return [self.ids[s] for s in symbols]

    def _pretokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in SMOLLM_SPLITS:  # each regex splits the previous pieces; gaps are kept
            out = []
            for piece in pieces:
                pos = 0
                for m in regex.finditer(pattern, piece):
                    if m.start() > pos:
                        out.append(piece[pos:m.start()])
                    out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def encode(self, text: str) -> list[int]:
        split = "(" + "|".join(regex.escape(s) for s in self.specials) + ")"
        ids = []
        for part in regex.split(split, text):
            if part in self.specials:
                ids.append(self.ids[part])
            elif part:
                for piece in self._pretokenize(part):
                    ids += self._bpe(piece)
        return ids

    def render(self, messages) -> str:
        return jinja2.Environment().from_string(self.template).render(messages=messages,
                                                                      add_generation_prompt=True)


@pytest.fixture(scope="module")
def reference(smollm_gguf):
    return NaiveBPE(smollm_gguf)


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["france", "digits", "unicode", "specials"])
def test_chat_prompts_tokenize_as_the_reference_does(conversation, smollm, reference):
    tok = smollm.tokenizer
    text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text == reference.render(conversation)
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True)
    assert ids == reference.encode(text)
    assert len(ids) == len(reference.encode(reference.render(conversation)))


def test_plain_text_digits_and_the_pre_tokenizer(smollm, reference):
    """' ½' is where llama.cpp's digit split differs from GPT-2's regex alone."""
    tok = smollm.tokenizer
    for text in [" ½", "Hello world! 123", "x² v1.2.3 abc123def", "  multiple   spaces", "\n"]:
        assert tok.encode(text) == reference.encode(text), text
    assert tok.encode(" ½") != [3351, 138]  # what GPT-2's regex alone gives


def test_special_ids_and_streamed_decoding(smollm, reference):
    tok = smollm.tokenizer
    # llama.cpp's end-of-generation set (tests/test_eog.py writes its rule again from its source).
    assert tok.eos_token_ids == {reference.ids[t] for t in ("<|im_end|>", "<|endoftext|>", "<reponame>")}
    assert tok.bos_token == "<|im_start|>" and tok.pad_token_id == 2
    assert tok.encode("hi")[0] != tok.bos_token_id  # tokenizer.ggml.add_bos_token is False
    assert type(tok.detokenizer).__name__ == "BPEStreamingDetokenizer"
    text = CONVERSATIONS[2][0]["content"] + " 6912."
    assert detokenize(tok, reference.encode(text)) == text
