"""vLLM's tokenizer endpoints, with the model ids of the rest of the API (an
adapter tokenizes as its base does):

    POST /tokenize    {"model", "prompt"} or {"model", "messages", "add_generation_prompt", ...}
                      -> {"count", "max_model_len", "tokens"} (and "token_strs" if asked)
    POST /detokenize  {"model", "tokens"} -> {"prompt"}

``messages`` go through the model's chat template exactly as /v1/chat/completions
renders them, so ``count`` is the prompt's ``usage.prompt_tokens``; a ``prompt``
is encoded as /v1/completions encodes it. Both run on the prompt lanes, off the
event loop, and their input is bounded (protocol.py). A chat with images, on a
vision base, is prepared as chat prepares it (frontend/prepare.py's
``prompt_tokens``: the images decoded and bounded, mlx-vlm's processor), each
image's placeholder repeated once per vision token.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import InvalidRequest, ModelNotFound
from ...frontend.images_in import count_images
from ...frontend.prepare import prompt_tokens
from ...frontend.prompts import render_messages
from ...frontend.spec import PromptSpec
from ..dialects.chat import message_dicts
from ..protocol import DetokenizeRequest, TokenizeRequest
from ..base_leases import state_for
from ...frontend.state import ServerState

router = APIRouter()


async def _check_model(state: ServerState, model: str | None) -> None:
    """``model`` must be an id the API serves: the base, or an adapter on it."""
    if model is None or model == state.base_id:
        return
    if await state.registry.catalog.find(model) is None:
        raise ModelNotFound(model)


def _tokenize(tokenizer, body: TokenizeRequest, messages: list[dict] | None, max_chars: int) -> list[int]:
    if messages is None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(tokenizer.encode(body.prompt, add_special_tokens=add_special))
    # Counted only: tools need no parser of the model's calls here.
    return render_messages(tokenizer, messages, body.tools, False, "messages",
                           None, max_chars, add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           add_special_tokens=bool(body.add_special_tokens), options=body.template_options())


async def _tokenize_images(state: ServerState, body: TokenizeRequest, messages: list[dict]) -> list[int]:
    """A chat with images, as /v1/chat/completions prepares it: the generation
    prompt added, no special tokens but the template's (a 400 for other asks)."""
    for field, want in (("add_generation_prompt", True), ("continue_final_message", False),
                        ("add_special_tokens", False)):
        if bool(getattr(body, field)) != want:
            raise InvalidRequest(f"'{field}' must be {str(want).lower()} for a chat with images: it is "
                                 "tokenized as /v1/chat/completions prepares it.", param=field)
    spec = PromptSpec(messages=messages, tools=body.tools, options=body.template_options())
    tokens, = await prompt_tokens(state, spec, body.model)
    return tokens


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state: ServerState = await state_for(request, body.model)
    body.check()
    await _check_model(state, body.model)
    messages = message_dicts(body.messages) if body.messages is not None else None
    if messages is not None and count_images(messages):
        tokens = await _tokenize_images(state, body, messages)
    else:
        tokens = await state.prompts.call(body.chars(), _tokenize, body, messages, state.prompts.max_chars)
    out = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = await state.prompts.call(len(tokens), lambda tok: tok.convert_ids_to_tokens(tokens))
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state: ServerState = await state_for(request, body.model)
    await _check_model(state, body.model)
    for i, token in enumerate(body.tokens):
        if token >= state.vocab_size:
            raise InvalidRequest(f"tokens[{i}] is {token}, outside the vocabulary (size {state.vocab_size}).",
                                 param=f"tokens[{i}]")
    # Special tokens are kept, as vLLM's /detokenize keeps them.
    prompt = await state.prompts.call(len(body.tokens), lambda tok: tok.decode(body.tokens))
    return {"prompt": prompt}
