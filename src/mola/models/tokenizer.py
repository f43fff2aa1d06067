"""The tokenizer a GGUF file's metadata describes, as Hugging Face tokenizer files
loaded by mlx-lm's own tokenizer loader (so its TokenizerWrapper, streaming
detokenizer, EOS handling and tool parsers work unchanged).

The vocabulary, merges and special tokens go through transformers' torch-free GGUF
builder (``convert_gguf_tokenizer``, transformers 5.x, pinned in pyproject.toml);
the pre-tokenizer is then set to llama.cpp's for the file's ``tokenizer.ggml.pre``
(llama.cpp's ``llama-vocab.cpp``), e.g. ``smollm`` splits every digit on its own
before GPT-2's regex. A byte-level file whose pre-tokenizer mola does not know is
refused, as llama.cpp refuses it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..errors import ModelLoadError
from .eog import gguf_eog_ids

# GPT-2's split, which tokenizers' ByteLevel(use_regex=True) applies.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("gpt-2", "gpt2", "default", "mpt", "olmo", "jais")
# llama.cpp sets these per pre-tokenizer (before the file's own add_bos_token, which wins).
_ADDS_BOS = ("llama3", "llama-v3", "llama-bpe", "tekken", "chameleon", "falcon3")
_IGNORES_MERGES = ("llama3", "llama-v3", "llama-bpe", "tekken")
_KEEPS_SPACES = ("smollm", "qwen2", "tekken", "chameleon", "command-r", "llama3", "llama-v3",
                 "llama-bpe", "deepseek-llm", "deepseek-coder", "deepseek-v3", "viking")

_TOKENIZER_KEYS = {  # tokenizer.ggml.<key> -> the builder's name
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}


def tokenizer_dict(metadata: dict) -> dict:
    """The builder's input from the metadata (as read by gguf-py)."""
    d = {name: metadata[f"tokenizer.ggml.{key}"] for key, name in _TOKENIZER_KEYS.items()
         if f"tokenizer.ggml.{key}" in metadata}
    if "tokens" not in d:
        raise ModelLoadError("the file has no tokenizer (no tokenizer.ggml.tokens)")
    return d


def _backend(architecture: str, d: dict):
    """A tokenizers.Tokenizer with llama.cpp's pre-tokenizer for the file."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        convert_gguf_tokenizer,
    )

    kind, pre = d.get("tokenizer_type"), d.get("pre_tokenizer_type", "default")
    try:
        backend, _ = convert_gguf_tokenizer(architecture, d)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot build the tokenizer '{kind}' the file describes: {e}") from None
    if kind == "gpt2":
        if pre in _DIGITS_THEN_GPT2:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        elif pre not in _GPT2 and pre not in GGUF_PRE_TOKENIZER_SPLITS:
            raise ModelLoadError(
                f"the file's tokenizer uses llama.cpp's pre-tokenizer '{pre}', which mola does not "
                "know, so it cannot split text the way the model was trained.")
        if pre in _IGNORES_MERGES:
            model = json.loads(backend.to_str())
            model["model"]["ignore_merges"] = True
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(json.dumps(model))
    return backend


def _post_processor(backend, bos: str | None, add_bos: bool) -> None:
    from tokenizers import processors

    if add_bos and bos is not None:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    else:
        backend.post_processor = None


def tokenizer_files(metadata: dict, architecture: str, out: Path, context_length: int | None) -> list[int]:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into
    ``out``; return the ids that end a generation, by llama.cpp's rule (models/eog.py)."""
    d = tokenizer_dict(metadata)
    tokens = d["tokens"]

    def token(key: str) -> str | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None

    pre = d.get("pre_tokenizer_type", "default")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = d.get("tokenizer_type") == "llama" or pre in _ADDS_BOS
    backend = _backend(architecture, d)
    _post_processor(backend, token("bos_token_id"), bool(add_bos))
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": pre not in _KEEPS_SPACES,
        "model_max_length": context_length or 1 << 30,
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=2, ensure_ascii=False))
    return sorted(gguf_eog_ids(metadata))


def load_tokenizer(metadata: dict, architecture: str, context_length: int | None = None):
    """mlx-lm's TokenizerWrapper for the tokenizer in ``metadata``."""
    with tempfile.TemporaryDirectory(prefix="mola-gguf-tokenizer-") as tmp:
        stops = tokenizer_files(metadata, architecture, Path(tmp), context_length)
        return load_tokenizer_dir(Path(tmp), stops)


def load_tokenizer_dir(folder: Path, stops: list[int] | None):
    """mlx-lm's TokenizerWrapper for the files tokenizer_files wrote into ``folder``
    (the conversion cache keeps them: models/gguf_cache.py)."""
    from mlx_lm.tokenizer_utils import load

    return load(Path(folder), eos_token_ids=stops or None)
