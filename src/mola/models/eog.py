"""Which tokens end a generation, and which are special: one rule for every
model source (an mlx-lm directory, a hub id, a GGUF file).

The end-of-generation (EOG) set is the union of

- what the tokenizer already stops on: its eos (and, for an mlx-lm directory,
  config.json's and generation_config.json's ``eos_token_id``, which mlx-lm merges);
- ``generation_config.json``'s ``eos_token_id`` (an int or a list), as
  transformers' ``generate`` and vLLM read it;
- llama.cpp's rule (:func:`llama_cpp_eog`): the GGUF metadata's eos, eot and eom
  ids (and its FIM pad/repo/file-separator ids), plus every token whose text is
  one llama.cpp treats as EOG. On a GGUF file it runs over the whole vocabulary,
  as llama.cpp does; on a Hugging Face tokenizer over its added tokens only (a
  byte-level BPE vocabulary can hold such a text as an ordinary merge, which
  llama.cpp would flag as "probably a bug in the model");
- the chat template's end-of-turn token: the added token the template writes
  right after an assistant message's content (``<|im_end|>``, ``<|eot_id|>``,
  ``<end_of_turn>``).

Then llama.cpp's two exceptions are applied to the union: ``<|end|>`` is no EOG
beside ``<|return|>``/``<|call|>`` (gpt-oss's harmony) or ``<|calls|>``/``<|flush|>``
(solar-open), and ``</s>`` none beside ``<|tool_response>`` (gemma4).

The special ids (:func:`special_token_ids`) are what ``skip_special_tokens``
leaves out of the text, as transformers' ``decode`` and vLLM do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Mapping

log = logging.getLogger("mola.loader")

# llama.cpp, src/llama-vocab.cpp, llama_vocab::impl::load(), the block "maintain a list
# of tokens that cause end-of-generation": a token with one of these texts is EOG
# (llama.cpp also gives it the control attribute when the file did not).
LLAMA_CPP_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>",
    "<|return|>", "<|call|>",  # o200k_harmony (gpt-oss)
    "<|flush|>", "<|calls|>",  # solar-open
    "<end_of_turn>", "<|endoftext|>",
    "</s>",  # paddleocr
    "<|eom_id|>", "<EOT>", "_<EOT>",
    "[EOT]", "[EOS]",  # Kimi-K2
    "<|end_of_text|>",
    "<end_of_utterance>",  # smoldocling
    "<eos>", "<turn|>", "<|tool_response>",  # gemma4
    "<｜end▁of▁sentence｜>",  # deepseek
    "[e~[",  # minimax-m2
)
# The same function, "auto-detect special tokens by text": when the metadata names
# no FIM pad / repo / file-separator token, the first token with one of these texts
# is taken, and these three ids are EOG too. (llama.cpp keeps whichever match its
# hash map yields first; a vocabulary with several has them all stop here.)
LLAMA_CPP_FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# The metadata ids that are EOG (tokenizer.ggml.<key>_token_id), in llama.cpp's names.
EOG_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
# What llama.cpp's load() assumes when the metadata has no eos id, by tokenizer model.
DEFAULT_EOS = {"llama": 2, "gpt2": 11, "t5": 1, "plamo2": 2}


def llama_cpp_eog(vocab: Mapping[str, int], ids: Mapping[str, int | None]) -> set[int]:
    """llama.cpp's EOG set for a vocabulary (token text -> id) and the special
    ids its metadata names (``EOG_KEYS`` -> id or None)."""
    out = {i for key in EOG_KEYS if (i := ids.get(key)) is not None}
    for key, texts in LLAMA_CPP_FIM_TEXTS.items():
        if ids.get(key) is None:
            out |= {vocab[t] for t in texts if t in vocab}
    out |= {vocab[t] for t in LLAMA_CPP_EOG_TEXTS if t in vocab}
    return out


def without_exceptions(ids: Iterable[int], text_of: Mapping[int, str]) -> set[int]:
    """llama.cpp's two exceptions (same function, after the sanity checks)."""
    ids = set(ids)
    by_text = {text_of.get(i): i for i in ids}
    has_call = "<|call|>" in by_text or "<|calls|>" in by_text
    if "<|end|>" in by_text and has_call and ("<|return|>" in by_text or "<|flush|>" in by_text):
        ids.discard(by_text["<|end|>"])
    if "</s>" in by_text and "<|tool_response>" in by_text:
        ids.discard(by_text["</s>"])
    return ids


def gguf_eog_ids(metadata: Mapping) -> set[int]:
    """llama.cpp's EOG set for a GGUF file's metadata (as gguf-py reads it)."""
    tokens = list(metadata.get("tokenizer.ggml.tokens") or ())
    n = len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    default = DEFAULT_EOS.get(metadata.get("tokenizer.ggml.model"))
    ids: dict[str, int | None] = {key: None for key in EOG_KEYS}
    ids["eos"] = default if default is not None and default < n else None
    for key in EOG_KEYS:
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and 0 <= int(value) < n:  # out of range: the default stays
            ids[key] = int(value)
    return without_exceptions(llama_cpp_eog(vocab, ids), dict(enumerate(tokens)))


def generation_config_eos(model_dir: Path | None) -> set[int]:
    """``eos_token_id`` of ``generation_config.json`` in ``model_dir`` (an int or a list)."""
    if model_dir is None or not model_dir.is_dir():
        return set()
    path = model_dir / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, AttributeError) as e:
        log.warning("ignoring %s: %s", path, e)
        return set()
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _id_set(value) -> set[int]:
    """An id or ids (mlx-lm's wrapper holds a set; a bare Hugging Face tokenizer may answer one int)."""
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _added_tokens(tokenizer) -> dict[int, str]:
    """id -> text of the tokenizer's added tokens (its control and user-defined tokens)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}


def template_end_of_turn(tokenizer) -> int | None:
    """The added token the chat template writes right after an assistant
    message's content (whitespace between them allowed), if there is one."""
    if not getattr(tokenizer, "has_chat_template", getattr(tokenizer, "chat_template", None)):
        return None
    probe = "mola probes the end of an assistant turn"
    messages = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": probe}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as e:  # a template that wants other messages: no end-of-turn from it
        log.debug("the chat template did not render a probe conversation: %s", e)
        return None
    at = text.rfind(probe) if isinstance(text, str) else -1
    if at < 0:
        return None
    rest = text[at + len(probe):].lstrip()
    ids = tokenizer.encode(rest, add_special_tokens=False) if rest else []
    return ids[0] if ids and ids[0] in _added_tokens(tokenizer) else None


def end_of_generation_ids(tokenizer, model_path: Path | None = None) -> frozenset[int]:
    """The EOG set of a loaded tokenizer (mlx-lm's TokenizerWrapper, or a
    Hugging Face tokenizer) and the directory it came from (None or a GGUF
    file: no generation_config.json). A GGUF tokenizer (models/tokenizer.py)
    already stops on llama.cpp's set, over the whole vocabulary."""
    own = _id_set(getattr(tokenizer, "eos_token_ids", None))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        own.add(tokenizer.eos_token_id)
    added = _added_tokens(tokenizer)
    by_text = llama_cpp_eog({text: i for i, text in sorted(added.items(), reverse=True)}, {})
    ids = own | by_text | generation_config_eos(model_path)
    end_of_turn = template_end_of_turn(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    text_of = dict(zip(sorted(ids), tokenizer.convert_ids_to_tokens(sorted(ids))))
    return frozenset(without_exceptions(ids, text_of))


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids ``skip_special_tokens`` leaves out of the text: the added tokens
    marked special, the tokenizer's own special tokens (bos, eos, pad, unk...)
    and the EOG set; not the tool-call and thinking markers that mlx-lm's
    parsers look for in the text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {int(i) for i, t in decoder.items() if getattr(t, "special", False)}
    ids |= _id_set(getattr(tokenizer, "all_special_ids", None))
    ids |= _id_set(getattr(tokenizer, "eos_token_ids", None))
    for name in ("tool_call_start_tokens", "tool_call_end_tokens", "think_start_tokens", "think_end_tokens"):
        try:
            marker = getattr(tokenizer, name, None)
        except (AttributeError, ValueError):
            marker = None
        if marker and len(marker) == 1:
            ids.discard(marker[0])
    return frozenset(ids)
