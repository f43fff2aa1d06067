"""mola's GGUF LoRA writer, where tests and devtools have found it
(it lives in mola.lora.formats.gguf_writer)."""

from ..lora.formats.gguf_writer import OUTTYPES, save_gguf_adapter

__all__ = ["OUTTYPES", "save_gguf_adapter"]
