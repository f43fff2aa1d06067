"""Tokenizers of other model families: chat templates and added tokens on the tiny model's."""

from __future__ import annotations

import json
from pathlib import Path
import mlx.core as mx


# Chat templates in the style of other families, enough for mlx-lm to pick
# their tool parser (mlx_lm.tokenizer_utils._infer_tool_parser).
MISTRAL_TEMPLATE = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}<|im_end|>
{%- elif message.role == 'assistant' %}{{ message.content }}<|im_end|>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""


MISTRAL_V3_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "{%- for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}",
    '[TOOL_CALLS][{%- for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": '
    '{{ tc.function.arguments | tojson }}}{{ ", " if not loop.last }}{% endfor %}]')


PYTHONIC_TEMPLATE = "{% for m in messages %}<|tool_call_start|>{{ m.content }}<|tool_call_end|>{% endfor %}"


def with_chat_template(model_dir, out_dir, template: str):
    """A copy of a model directory whose tokenizer has another chat template."""
    import shutil

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    (Path(out_dir) / "chat_template.jinja").write_text(template)
    return Path(out_dir)


def with_added_tokens(model_dir, out_dir, tokens: list[str], special: bool = False,
                      eos: tuple[str, ...] = (), template: str | None = None, seed: int = 0):
    """A copy of a tiny model directory whose tokenizer has ``tokens`` added
    (special or not, as a real model declares them), the embedding and output
    rows grown with random ones, ``eos`` among its end-of-sequence ids, and
    (if given) another chat ``template``."""
    import shutil

    import numpy as np
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in tokens], special_tokens=special)
    tok.save_pretrained(str(out_dir))
    config = json.loads((out_dir / "config.json").read_text())
    weights = dict(mx.load(str(out_dir / "model.safetensors")))
    rng = np.random.default_rng(seed)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[key]
        extra = rng.normal(0, float(np.std(np.array(w))), (len(tok) - w.shape[0], w.shape[1]))
        weights[key] = mx.concatenate([w, mx.array(extra, dtype=w.dtype)])
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    ids = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    config.update(vocab_size=len(tok), eos_token_id=ids + [tok.convert_tokens_to_ids(t) for t in eos])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if template is not None:
        (out_dir / "chat_template.jinja").write_text(template)
    return out_dir
