"""How llama.cpp's convert_hf_to_gguf.py writes each mlx-lm model type beyond the
common keys of gguf_model.py (one module per family, a Twin per model type): the
config make_tiny_model gives a tiny model of the type, the metadata the converter's
``set_gguf_parameters`` adds, and what its ``modify_tensors`` does to a tensor
(Gemma's norms are written as ``1 + w``).

A new family: a module here with ``TWINS = {model_type: Twin(...)}``, listed in
FAMILIES below."""

from __future__ import annotations

from . import cohere, gemma, granite, llama, olmo2, phi3, smollm3
from .twin import Twin

FAMILIES = (llama, gemma, phi3, granite, smollm3, olmo2, cohere)
TWINS: dict[str, Twin] = {model_type: twin for family in FAMILIES for model_type, twin in family.TWINS.items()}

__all__ = ["TWINS", "Twin"]
