"""mola: an OpenAI-compatible multi-LoRA inference server on MLX."""

import os as _os

# transformers (used by mlx-lm for tokenizers) warns at import that PyTorch is
# missing; mola never needs PyTorch.
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__version__ = "0.1.0"
