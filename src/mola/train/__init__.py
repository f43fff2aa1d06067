"""`mola train`: a LoRA adapter from a folder of JSONL data, with mlx-lm's tuner.

    mola train --model PATH_OR_HF_ID --data DIR --out ADAPTER_DIR|FILE.gguf
               [--rank 8] [--layers N] [--iters N] [--batch-size N]
               [--learning-rate X] [--target q_proj,v_proj,...] [--serve-url URL]

DIR holds ``train.jsonl`` and, optionally, ``valid.jsonl``, one example per
line in one of the formats mlx-lm accepts:

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
    {"prompt": ..., "completion": ...}
    {"text": ...}

    config.py   TrainConfig: the settings, checked when made
    data.py     the data, checked line by line before any model loads
    output.py   the output path checked first; the adapter moved into place; --serve-url
    export.py   a FILE.gguf output: the adapter written by mola's GGUF writer
    run.py      the run: mlx-lm's dataset classes tokenize, linear_to_lora_layers adds the
                LoRA layers, tuner.trainer.train runs the loop, progress goes to stderr

The result is an mlx-lm adapter directory (``adapter_config.json`` +
``adapters.safetensors``) that ``mola serve --adapter``, ``POST /v1/adapters``
and ``mlx_lm.load(model, adapter_path=...)`` all load, and/or (``--out
FILE.gguf``) a llama.cpp GGUF LoRA of the same weights. It is written to a
temporary directory beside the output and moved into place at the end, so an
interrupted run leaves no half-written adapter. A quantized base is trained as
it is: mlx-lm's LoRA layers wrap its ``QuantizedLinear`` layers.
"""

from ..errors import DataError, OutputPathError, TrainError
from .config import (DEFAULT_BATCH_SIZE, DEFAULT_ITERS, DEFAULT_LAYERS, DEFAULT_LEARNING_RATE,
                     DEFAULT_MAX_SEQ_LENGTH, DEFAULT_RANK, DEFAULT_SCALE, GGUF_OUTTYPES, TRAIN_DTYPES,
                     TrainConfig)
from .data import DataFile, DataSet, check_data, read_data_file
from .output import check_output, hot_load
from .run import TrainResult, run, train_adapter

__all__ = [
    "DEFAULT_BATCH_SIZE", "DEFAULT_ITERS", "DEFAULT_LAYERS", "DEFAULT_LEARNING_RATE",
    "DEFAULT_MAX_SEQ_LENGTH", "DEFAULT_RANK", "DEFAULT_SCALE", "GGUF_OUTTYPES", "TRAIN_DTYPES", "DataError", "DataFile", "DataSet",
    "OutputPathError", "TrainConfig", "TrainError", "TrainResult", "check_data", "check_output",
    "hot_load", "read_data_file", "run", "train_adapter",
]
