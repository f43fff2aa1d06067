"""Base models: mlx-lm directories, hub ids and llama.cpp GGUF files, loaded as
mlx-lm models with mlx-lm tokenizers.

    loader.py     where a model comes from, and --dtype
    gguf.py       a GGUF file -> mlx-lm config, weights and model
    codecs.py     GGUF tensor types -> MLX arrays (kept quantized or dequantized)
    tokenizer.py  the tokenizer in a GGUF's metadata -> Hugging Face files -> mlx-lm
    convert.py    `mola convert`: a GGUF file -> an mlx-lm model directory
    fetch.py      the real test/demo model (SmolLM2-135M-Instruct), fetched once
"""
