"""The llama.cpp architectures mola serves as GGUF bases, one module per family,
each a BaseArchitecture (base.py): llama.cpp's general.architecture -> mlx-lm's model
type, its norms' names, and hooks for its own metadata keys and tensor fixes.

A new family: a module here with ``ARCHITECTURES = (BaseArchitecture(...), ...)``,
listed in FAMILIES below; its linears' names (and its GGUF LoRA architecture) in
adapters/formats/gguf_names.py; its twin writer in mola/testing/gguf_twins/."""

from __future__ import annotations

from . import cohere, gemma, gpt_oss, granite, llama, olmo2, phi3, qwen, smollm3
from .base import LLAMA_NORMS, BaseArchitecture, float32_decimal
from .llama import MIXTRAL

FAMILIES = (llama, qwen, gpt_oss, gemma, phi3, granite, smollm3, olmo2, cohere)
BASE_ARCHITECTURES: dict[str, BaseArchitecture] = {
    arch.name: arch for family in FAMILIES for arch in family.ARCHITECTURES}

__all__ = ["BASE_ARCHITECTURES", "BaseArchitecture", "LLAMA_NORMS", "MIXTRAL", "float32_decimal"]
