"""The bodies of OpenAI's completion endpoints as plain dicts, shaped by its
schemas (components/schemas in OpenAI's openapi.yaml): chat completions and
their stream chunks, text completions, log-probabilities, and the model cards
of /v1/models. (The Responses API's objects are in responses_api/, the
Messages API's in anthropic/.)"""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """``cached_tokens``: prompt tokens served from the prompt cache;
    ``reasoning_tokens``: completion tokens spent thinking (None: the model's
    reasoning is not split off, and the detail is left out)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def with_alora(answer: dict, invoked: bool | None) -> dict:
    """An activated LoRA's answer (a chat or completion choice, a Responses
    response, a Messages message) says whether its invocation was in the
    prompt (mola's own field, ``alora_invoked``; false: the base alone answered)."""
    if invoked is not None:
        answer["alora_invoked"] = invoked
    return answer


# ---- chat ---------------------------------------------------------------------


def chat_message(content: str | None, tool_calls: list[dict] | None, reasoning: str | None = None,
                 with_reasoning: bool = False) -> dict:
    """``with_reasoning``: the server splits reasoning off (``reasoning_content``,
    vLLM's and DeepSeek's field, null when the model did not think)."""
    message = {"role": "assistant", "content": content, "refusal": None}
    if with_reasoning:
        message["reasoning_content"] = reasoning or None
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_completion(id: str, model: str, created: int, choices: list[dict], usage_: dict) -> dict:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: list[dict] | None) -> dict:
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }


def chat_chunk(id: str, model: str, created: int, choices: list[dict], usage_: dict | None = None,
               include_usage: bool = False) -> dict:
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = usage_
    return chunk


def chunk_choice(index: int, delta: dict, finish_reason: str | None = None,
                 logprobs: list[dict] | None = None) -> dict:
    return {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }


# ---- completions --------------------------------------------------------------


def completion(id: str, model: str, created: int, choices: list[dict], usage_: dict | None) -> dict:
    body = {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- log-probabilities ------------------------------------------------------------


class TokenText:
    """Token id -> (text, bytes), cached, for log-probability entries."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        try:
            from mlx_lm.tokenizer_utils import _byte_decoder

            self._byte_decoder = _byte_decoder()
        except ImportError:  # pragma: no cover - older mlx-lm
            self._byte_decoder = None

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self._tokenizer.decode([token])
            raw = None
            piece = self._tokenizer.convert_ids_to_tokens(token)
            if self._byte_decoder and isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                raw = [self._byte_decoder[c] for c in piece]
            hit = (text, raw if raw is not None else list(text.encode("utf-8")))
            self._cache[token] = hit
        return hit


def chat_logprobs(token_text: TokenText, tokens: list[int], logprobs: list) -> list[dict]:
    """ChatCompletionTokenLogprob entries for ``tokens``."""
    out = []
    for token, (lp, top) in zip(tokens, logprobs):
        text, raw = token_text(token)
        alts = []
        for alt, alt_lp in top:
            alt_text, alt_raw = token_text(alt)
            alts.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        out.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return out


def completion_logprobs(token_text: TokenText, tokens: list[int], logprobs: list, offset: int) -> dict:
    """The completions endpoint's logprobs object; ``offset`` is the text
    length before these tokens."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, (lp, top) in zip(tokens, logprobs):
        text, _ = token_text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({token_text(t)[0]: v for t, v in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# ---- models ---------------------------------------------------------------------


def model_card(id: str, created: int, root: str, parent: str | None, max_model_len: int | None) -> dict:
    """A Model object with vLLM's extra fields (root, parent, max_model_len)."""
    return {
        "id": id,
        "object": "model",
        "created": created,
        "owned_by": "mola",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }
