"""mola: an OpenAI-compatible multi-LoRA inference server on MLX."""

__version__ = "0.1.0"
