"""The training run itself: mlx-lm's tuner on the checked data, with
progress on stderr, then the adapter written and (with --serve-url) loaded."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable

from ..errors import TrainError
from .config import DEFAULT_LAYERS, TrainConfig
from .data import check_data
from .export import check_gguf_export, write_gguf
from .output import check_output, hot_load, place
from .progress import Progress, TrainResult


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


BUCKET = 64  # batches draw from examples within this many tokens of length


def tokenize(examples: list[dict], tokenizer, mask_prompt: bool) -> list[tuple[list[int], int]]:
    """(tokens, prompt length) per example, by mlx-lm's dataset classes."""
    from mlx_lm.tuner.datasets import create_dataset

    dataset = create_dataset(examples, tokenizer, types.SimpleNamespace(mask_prompt=mask_prompt))
    out = []
    for i in range(len(dataset)):
        tokens, offset = dataset.process(dataset[i])
        out.append((list(tokens), int(offset)))
    return out


def batchable(items: list[tuple[list[int], int]], seed: int | None):
    """Tokenized examples as mlx-lm's batcher takes them. It sorts by
    ``itemlen`` (stably) and cuts batches from that order; sorting on the
    length bucket of examples shuffled first makes batches of similar length
    that still mix everything else (exact sorting would group, say, short
    answers with short answers, and a batch would teach one answer)."""
    import numpy as np
    from mlx_lm.tuner.datasets import CacheDataset

    items = list(items)
    if seed is not None:
        order = np.random.RandomState(seed).permutation(len(items))
        items = [items[i] for i in order]

    class Tokenized(CacheDataset):
        def __init__(self):
            self._data = items

        def itemlen(self, idx):
            return len(items[idx][0]) // BUCKET

        def __getitem__(self, idx):
            return items[idx]

        def __len__(self):
            return len(items)

    return Tokenized()


def resolve_targets(model, targets: tuple[str, ...] | None) -> list[str]:
    """Block-relative module paths (mlx-lm's lora_parameters.keys) for the
    given short names; every linear layer of the blocks when None, the
    experts of a mixture of experts (SwitchLinear) included, as mlx-lm's
    own default keys are."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    kinds = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear)
    linears = sorted({name for block in model.layers for name, m in block.named_modules()
                      if isinstance(m, kinds) or hasattr(m, "to_lora")})
    if targets is None:
        return sorted(linears)
    keys = []
    for t in targets:
        matches = [n for n in linears if n == t or n.endswith("." + t)]
        if not matches:
            raise TrainError(f"--target {t}: the model's blocks have no such linear layer; "
                             f"they have {', '.join(sorted(linears))}")
        if len(matches) > 1 and t not in matches:
            raise TrainError(f"--target {t} is ambiguous ({', '.join(matches)}); name one of them")
        keys += [t] if t in matches else matches
    return sorted(set(keys))


def train_adapter(config: TrainConfig, log: Callable[[str], None] = _stderr) -> TrainResult:
    """Check, load, train and write the adapter; hot-load it when
    ``config.serve_url`` is set. Raises TrainError (or subclasses)."""
    import mlx.core as mx

    t_start = time.perf_counter()
    data = _check_inputs(config, log)
    mx.reset_peak_memory()
    held_before = mx.get_active_memory()  # the peak is the process's: count this run's part
    model, tokenizer, model_config = _load_model(config, log)
    num_layers = layers_to_train(config, len(model.layers))
    keys = resolve_targets(model, config.targets)
    if config.gguf_out is not None:
        check_gguf_export(model_config, keys)  # before training, not after
    train_set = tokenize(data.train.examples, tokenizer, config.mask_prompt)
    valid_set = tokenize(data.valid.examples, tokenizer, config.mask_prompt) if data.valid else []
    _check_lengths(config, train_set, valid_set, log)
    invocation = None
    if config.alora_invocation is not None:  # an activated LoRA (train/alora.py)
        from .alora import find_invocation

        invocation = find_invocation(config.alora_invocation, tokenizer, config.max_seq_length,
                                     (train_set, "training"), (valid_set, "validation"), log=log)
    lora_parameters, trainable = add_lora_layers(model, config, keys, num_layers, log)
    progress = Progress(config.iters, log)
    adapter_config = train_adapter_config(config, num_layers, lora_parameters)
    if invocation is not None:
        adapter_config.update(alora_invocation_tokens=list(invocation), alora_invocation=config.alora_invocation)
    _fit_and_write(model, config, train_set, valid_set, progress, adapter_config, model_config, invocation)
    linears, quantized = _count_linears(model)
    result = TrainResult(
        path=config.out, seconds=time.perf_counter() - t_start, train_loss=progress.train_loss,
        val_loss=progress.val_loss, trainable_parameters=trainable, outputs=config.outputs,
        linear_layers=linears, quantized_layers=quantized, peak_memory_bytes=mx.get_peak_memory() - held_before,
    )
    if quantized:
        log(f"[mola] the base stayed quantized: {quantized} of {linears} linear layers are QuantizedLinear; "
            f"peak memory {result.peak_memory_bytes / 2**20:.1f} MiB")
    log(f"[mola] adapter written to {' and '.join(map(str, config.outputs))} in {result.seconds:.0f} s"
        + (f" (final training loss {result.train_loss:.3f})" if result.train_loss is not None else ""))
    if config.serve_url:
        result.served = hot_load(config.serve_url, config.adapter_name, config.out, config.api_key)
        log(f"[mola] {config.serve_url} now serves the adapter as model '{config.adapter_name}'")
    return result


def _check_inputs(config: TrainConfig, log: Callable[[str], None]):
    """Everything that can be checked without the model: data, output, model path."""
    from ..models.loader import looks_like_hub_id

    data = check_data(config.data, config.batch_size)
    model_path = Path(config.model).expanduser()
    protect = (config.data,) + ((model_path,) if model_path.exists() else ())
    for out in config.outputs:
        check_output(out, config.force, protect)
    if not model_path.exists() and not looks_like_hub_id(config.model):
        raise TrainError(f"the model path does not exist: {model_path}")
    n_valid = len(data.valid.examples) if data.valid else 0
    log(f"[mola] data: {len(data.train.examples)} training and {n_valid} validation examples "
        f"({data.format} format) in {config.data}")
    return data


def _load_model(config: TrainConfig, log: Callable[[str], None]):
    from ..models.loader import ModelLoadError, load_base_model

    log(f"[mola] loading {config.model} ...")
    try:
        loaded = load_base_model(config.model, dtype=config.dtype)
    except ModelLoadError as e:
        raise TrainError(e.message) from None
    return loaded.model, loaded.tokenizer, loaded.config


def _count_linears(model) -> tuple[int, int]:
    """(linear layers, of which nn.QuantizedLinear) in the model as trained
    (mlx-lm's LoRA layers wrap them)."""
    import mlx.nn as nn

    kinds = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    return len(kinds), sum(isinstance(m, nn.QuantizedLinear) for m in kinds)


def layers_to_train(config: TrainConfig, total: int) -> int:
    """How many of the last blocks get LoRA layers."""
    if config.layers is None or config.layers == -1:
        return total if config.layers == -1 else min(DEFAULT_LAYERS, total)
    if config.layers > total:
        raise TrainError(f"--layers {config.layers}: the model has only {total} layers")
    return config.layers


def _check_lengths(config: TrainConfig, train_set, valid_set, log: Callable[[str], None]) -> None:
    too_long = sum(len(t) > config.max_seq_length for t, _ in train_set + valid_set)
    if too_long:
        log(f"[mola] warning: {too_long} example(s) are longer than --max-seq-length "
            f"{config.max_seq_length} tokens and will be truncated")
    if config.mask_prompt and all(off >= len(t) - 1 for t, off in train_set):
        raise TrainError("with --mask-prompt nothing is left to learn: every example is all prompt")


def add_lora_layers(model, config: TrainConfig, keys: list[str], num_layers: int,
                     log: Callable[[str], None]) -> tuple[dict, int]:
    """mlx-lm's LoRA layers on the chosen modules of the last blocks, the
    rest frozen; returns (lora_parameters, trainable parameter count)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(config.seed)
    np.random.seed(config.seed)
    model.freeze()
    lora_parameters = {"rank": config.rank, "scale": float(config.scale), "dropout": float(config.dropout)}
    if config.targets is not None:
        lora_parameters["keys"] = keys
    linear_to_lora_layers(model, num_layers, lora_parameters, use_dora=config.fine_tune_type == "dora")
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    short = sorted({k.rsplit(".", 1)[-1] for k in keys})
    kind = "DoRA" if config.fine_tune_type == "dora" else "LoRA"
    log(f"[mola] {kind} rank {config.rank} on {', '.join(short)} of the last {num_layers} of "
        f"{len(model.layers)} layers: {trainable:,} trainable parameters; {config.iters} iterations "
        f"of batch {config.batch_size}, learning rate {config.learning_rate:g}")
    return lora_parameters, trainable


def learning_rate_schedule(config: TrainConfig):
    """A constant rate, or mlx-lm's schedule (cosine to 10%, linear warm-up)."""
    from mlx_lm.tuner.utils import build_schedule

    if config.lr_schedule == "cosine":
        return build_schedule({"name": "cosine_decay",
                               "arguments": [config.learning_rate, config.iters - config.warmup,
                                             config.learning_rate * 0.1],
                               "warmup": config.warmup})
    if config.warmup:
        return build_schedule({"name": "linear_schedule",
                               "arguments": [config.learning_rate, config.learning_rate, 1],
                               "warmup": config.warmup})
    return config.learning_rate


def train_adapter_config(config: TrainConfig, num_layers: int, lora_parameters: dict) -> dict:
    """adapter_config.json, as mlx-lm writes it, plus how it was trained."""
    return {
        "fine_tune_type": config.fine_tune_type,
        "num_layers": num_layers,
        "lora_parameters": lora_parameters,
        "model": config.model,
        "data": str(config.data),
        "iters": config.iters,
        "batch_size": config.batch_size,
        "learning_rate": config.learning_rate,
        "lr_schedule": config.lr_schedule,
        "warmup": config.warmup,
        "grad_clip": config.grad_clip,
        "max_seq_length": config.max_seq_length,
        "mask_prompt": config.mask_prompt,
        "seed": config.seed,
        "trained_with": "mola train",
    }


def _fit_and_write(model, config: TrainConfig, train_set, valid_set, progress: "Progress",
                   adapter_config: dict, model_config: dict, invocation: tuple[int, ...] | None = None) -> None:
    """mlx-lm's training loop into a temporary directory beside the output,
    then moved into place (and written as GGUF for a .gguf output). With an
    ``invocation``, the LoRA layers are activated ones (mola.train.alora)."""
    from mlx_lm.tuner.trainer import TrainingArgs, train

    activated = {}
    if invocation is not None:
        from .alora import activate, batches, loss

        activated = {"loss": loss(activate(model)), "iterate_batches": batches(invocation)}

    out = config.mlx_lm_out or config.gguf_out  # the directory is moved into place: beside it
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.resolve().stem}.train-", dir=out.resolve().parent))
    try:
        args = TrainingArgs(
            batch_size=config.batch_size, iters=config.iters, val_batches=config.val_batches,
            steps_per_report=config.steps_per_report, steps_per_eval=config.steps_per_eval,
            steps_per_save=config.iters + 1,  # only the final save
            adapter_file=str(tmp / "adapters.safetensors"), max_seq_length=config.max_seq_length,
            grad_checkpoint=config.grad_checkpoint,
        )
        # mlx-lm's own progress display goes to stdout; mola reports through
        # the callback instead, on stderr.
        with contextlib.redirect_stdout(io.StringIO()):
            train(model=model, optimizer=adam(learning_rate_schedule(config), config.grad_clip),
                  train_dataset=batchable(train_set, config.seed),
                  val_dataset=batchable(valid_set, None) if valid_set else None, args=args,
                  training_callback=progress.callback, **activated)
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        if config.gguf_out is not None:
            write_gguf(tmp, config.gguf_out, model_config, config.model, config.gguf_outtype)
        if config.mlx_lm_out is not None:
            place(tmp, config.mlx_lm_out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def adam(learning_rate, grad_clip: float | None):
    """mlx-lm's default optimizer (Adam), clipping the gradient's global norm
    first when ``grad_clip`` is set."""
    import mlx.optimizers as optim

    if grad_clip is None:
        return optim.Adam(learning_rate=learning_rate)

    class ClippedAdam(optim.Adam):
        def update(self, model, gradients):
            gradients, _ = optim.clip_grad_norm(gradients, grad_clip)
            return super().update(model, gradients)

    return ClippedAdam(learning_rate=learning_rate)


def run_command(work):
    """Run a command that writes an adapter, as `mola train` and `mola distill`
    do: (0, what ``work()`` returns), or (1, None) with its TrainError's
    message on stderr, or (130, None) after Ctrl-C."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return 0, work()
    except TrainError as e:
        print(f"[mola] error: {e.message}", file=sys.stderr, flush=True)
        return 1, None
    except KeyboardInterrupt:
        print("[mola] interrupted; no adapter was written", file=sys.stderr, flush=True)
        return 130, None


def run(config: TrainConfig) -> int:
    """`mola train`'s exit status: 0 when the adapter is written (and, with
    --serve-url, loaded), 1 with a message on stderr otherwise."""
    return run_command(lambda: train_adapter(config))[0]
