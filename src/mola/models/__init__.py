"""Base models: mlx-lm directories, hub ids and llama.cpp GGUF files, loaded as
mlx-lm models with mlx-lm tokenizers.

    model.py      LoadedModel: what the loader hands the engine
    loader.py     where a model comes from, and --dtype
    metadata.py   a GGUF file's metadata -> mlx-lm config
    gguf_arch/    one module per llama.cpp architecture: norms, metadata keys, tensor fixes
    gguf_file.py  a GGUF file opened, its architecture found
    gguf.py       a GGUF file -> mlx-lm weights and model
    codecs.py     GGUF tensor types -> MLX arrays (kept quantized or dequantized); its repacks by
                  family in codecs_legacy.py, codecs_k.py, codecs_iq.py, the held forms in codec_forms.py
    gguf_cache.py the conversion cache: a GGUF file's converted tensors in MLX safetensors
    gguf_load.py  a GGUF model for mola serve: from the conversion cache, or converted now (then cached)
    progress.py   a long conversion's progress: a bar on a terminal, log lines otherwise
    fit.py        a GGUF file's memory by tensor group, planned before loading
    tokenizer.py  the tokenizer in a GGUF's metadata -> Hugging Face files -> mlx-lm
    eog.py        where a generation ends (every source, llama.cpp's rule), the special tokens
    convert.py    `mola convert`: a GGUF file -> an mlx-lm model directory
    fetch.py      the real test/demo model (SmolLM2-135M-Instruct), fetched once
"""

# --dtype: auto (float32 on a CPU where it fits, the file's own codecs on a GPU), keep, or a float dtype
DTYPE_CHOICES = ("auto", "keep", "float16", "bfloat16", "float32")
