"""The tokenizer of mola's built models (the echo demo's base, and the test
fixtures' tiny models): a byte-level BPE (GPT-2 style) trained offline with
`tokenizers` on the packaged corpus (corpus.txt), with a ChatML chat template."""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")

# ChatML with tools in the style of Qwen2.5 (mlx-lm recognises its tool-call
# format, "json_tools": <tool_call>{"name": ..., "arguments": ...}</tool_call>).
CHATML_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call one or more functions. Function signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if tools and loop.first and message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus_lines(vocab_size: int) -> list[str]:
    """Local training text: the packaged corpus, plus, for vocabularies larger
    than it supports, the Python standard library's own sources (offline and
    present on every machine)."""
    lines = CORPUS.read_text().splitlines()
    if vocab_size > 1024:
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for f in sorted(stdlib.glob("*.py")):
            lines += f.read_text(errors="ignore").splitlines()
    return lines


def train_tokenizer(vocab_size: int, extra_special_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer (GPT-2 style) trained on local text,
    wrapped for transformers, with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(vocab_size), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped
