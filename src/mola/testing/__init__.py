"""Test fixtures, built offline: tiny random-weight models and the adapters
and files that ride on them, for the tests, the benchmarks and devtools/.
Nothing in mola's runtime imports this package.

    model.py       tiny random-weight mlx-lm models (llama, qwen, mixtures of experts)
    adapter.py     random LoRA adapters in mlx-lm's format (by hand, or as mlx-lm's tuner writes them)
    peft.py        adapters in Hugging Face PEFT's format (dense, and both expert layouts)
    gguf_model.py  GGUF model files: the llama.cpp twin of a model, or random blocks of any codec
    images.py      a tiny random FLUX.2-klein for mflux, and LoRA files in its key styles
"""
