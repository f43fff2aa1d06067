"""A chat prompt with images, through mlx-vlm's own processor and chat
template, on the tokenizer thread (the one trip a prompt makes there): its
token ids, each image's placeholder repeated once per vision token, and the
images' patches and grids the vision tower takes in the prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import VisionConfig
from ..engine.vision_rows import VisionPrompt
from ..errors import ContextLengthExceeded, InvalidRequest
from .prompts import template_variables
from .spec import TemplateOptions
from .tools import messages_for_template

# A prompt's vision tokens at most, by default (--max-vision-tokens).
MAX_VISION_TOKENS = VisionConfig.max_vision_tokens


def message_images(messages: list[dict]) -> list[Any]:
    """The ImageInputs of ``messages``' image parts, in order."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def templater(processor):
    """What holds the model's chat template: the processor, or (Idefics3's,
    whose processor mlx-vlm makes without one) its tokenizer."""
    return processor if getattr(processor, "chat_template", None) else processor.tokenizer


def encode_vision_prompt(processor, messages: list[dict], image_token_id: int,
                         max_vision_tokens: int = MAX_VISION_TOKENS, tools=None,
                         options: TemplateOptions | None = None) -> tuple[list[int], VisionPrompt | None]:
    """(token ids, VisionPrompt) of a chat with images, as mlx-vlm prepares
    it (its chat template, then ``prepare_inputs``); None for a chat
    without one. The messages, tools and template variables (``options``)
    reach the template as on the text path (prompts.render_messages): the
    assistant's tool calls reshaped by messages_for_template. InvalidRequest
    naming the bound when its images take more than ``max_vision_tokens`` tokens."""
    from mlx_vlm.utils import prepare_inputs

    images = message_images(messages)
    template = templater(processor)
    kwargs = template_variables(template, options)
    if tools:
        kwargs["tools"] = tools
    if any(m.get("tool_calls") for m in messages):  # the assistant's calls, as templates expect them
        messages = messages_for_template(messages, template.chat_template)
    prompt = template.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    if not images:
        ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(ids), None
    inputs = prepare_inputs(processor, images=[im.image for im in images], prompts=[prompt])
    ids = np.array(inputs["input_ids"])[0].tolist()  # [L]
    num_vision = sum(1 for t in ids if t == image_token_id)
    if num_vision > max_vision_tokens:
        raise InvalidRequest(
            f"The request's {len(images)} image(s) take {num_vision} vision tokens, more than the "
            f"{max_vision_tokens} a request may (--max-vision-tokens); send smaller or fewer images.",
            param="messages")
    arrays = {k: np.array(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    vision = VisionPrompt(arrays=arrays, hashes=tuple(im.sha256 for im in images), num_image_tokens=num_vision)
    return ids, vision


@dataclass(frozen=True)
class VisionPrompter:
    """A vision base's prompts with images (on the short lane's thread alone)."""

    processor: Any  # mlx-vlm's processor (LoadedModel.processor)
    image_token_id: int  # the id each vision token of a prompt has
    max_vision_tokens: int = MAX_VISION_TOKENS  # a request's vision tokens at most (--max-vision-tokens)

    def encode(self, messages: list[dict], tools, param: str, limit: int | None,
               options: TemplateOptions | None = None) -> tuple[list[int], VisionPrompt]:
        """(token ids, VisionPrompt) of a chat with images; InvalidRequest
        naming ``param`` when the template refuses it, or the vision tokens
        or the context's ``limit`` are exceeded."""
        try:
            ids, vision = encode_vision_prompt(self.processor, messages, self.image_token_id,
                                               self.max_vision_tokens, tools=tools or None, options=options)
        except InvalidRequest:
            raise
        except Exception as e:  # the template's errors (jinja2), the processor's
            raise InvalidRequest(f"The chat with images could not be prepared: {e}", param=param) from None
        if limit is not None and len(ids) > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your {param} "
                f"resulted in {len(ids)} tokens ({vision.num_image_tokens} of them the images').", param=param)
        return ids, vision


def vision_prompter(loaded, config) -> VisionPrompter | None:
    """A vision base's VisionPrompter (a LoadedModel and the ServeConfig); None for a text base."""
    if not loaded.takes_images:
        return None
    return VisionPrompter(loaded.processor, loaded.model.image_token_id, config.vision.max_vision_tokens)
