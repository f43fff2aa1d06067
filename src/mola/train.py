"""`mola train`: a LoRA adapter from a folder of JSONL data, with mlx-lm's tuner.

    mola train --model PATH_OR_HF_ID --data DIR --out ADAPTER_DIR
               [--rank 8] [--layers N] [--iters N] [--batch-size N]
               [--learning-rate X] [--target q_proj,v_proj,...] [--serve-url URL]

DIR holds ``train.jsonl`` and, optionally, ``valid.jsonl``, one example per
line in one of the formats mlx-lm accepts:

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
    {"prompt": ..., "completion": ...}
    {"text": ...}

Everything that can be checked without the model is checked first (the data,
line by line, and the output path), so a typo costs no model load. Training
itself is mlx-lm's: its dataset classes tokenize, ``linear_to_lora_layers``
adds the LoRA layers, ``tuner.trainer.train`` runs the loop. mola feeds the
trainer pre-tokenized examples, so its batches group examples of similar
length, and prints progress with the loss on stderr. The result is an mlx-lm
adapter directory (``adapter_config.json`` + ``adapters.safetensors``) that
``mola serve --adapter``, ``POST /v1/adapters`` and
``mlx_lm.load(model, adapter_path=...)`` all load. It is written to a
temporary directory beside the output and moved into place at the end, so an
interrupted run leaves no half-written adapter.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import MolaError

# mlx-lm's defaults (mlx_lm/lora.py CONFIG_DEFAULTS), which mola keeps.
DEFAULT_RANK = 8
DEFAULT_SCALE = 20.0
DEFAULT_LAYERS = 16
DEFAULT_ITERS = 1000
DEFAULT_BATCH_SIZE = 4
DEFAULT_LEARNING_RATE = 1e-5
DEFAULT_MAX_SEQ_LENGTH = 2048

# The data formats mlx-lm's tuner reads: name -> (required keys, optional keys).
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "chat": (("messages",), ("tools",)),
    "completions": (("prompt", "completion"), ("tools",)),
    "text": (("text",), ()),
}
ROLES = ("system", "developer", "user", "assistant", "tool")
DATA_FILES = ("train.jsonl", "valid.jsonl")


class TrainError(MolaError):
    """`mola train` cannot go on: bad data, output path, model or setting."""


class DataError(TrainError):
    """A data file is missing, unreadable or not in a format mlx-lm reads."""


class OutputPathError(TrainError):
    """The output path cannot take the adapter."""


@dataclass(frozen=True)
class TrainConfig:
    model: str  # a local model directory or a Hugging Face hub id
    data: Path  # a directory with train.jsonl and optionally valid.jsonl
    out: Path  # the adapter directory to write
    rank: int = DEFAULT_RANK
    scale: float = DEFAULT_SCALE  # LoRA scale (mlx-lm's lora_parameters.scale)
    dropout: float = 0.0
    # The last N transformer blocks get LoRA layers; -1: all. None: mlx-lm's
    # default (16), or all blocks when the model has fewer.
    layers: int | None = None
    iters: int = DEFAULT_ITERS
    batch_size: int = DEFAULT_BATCH_SIZE
    learning_rate: float = DEFAULT_LEARNING_RATE
    # Modules of each block to adapt, short ("q_proj") or relative to the
    # block ("self_attn.q_proj"). None: mlx-lm's default, every linear layer.
    targets: tuple[str, ...] | None = None
    lr_schedule: str = "constant"  # or "cosine" (decay to 10% over the run)
    warmup: int = 0  # iterations of linear warm-up
    # Clip the gradient to this global norm (None: no clipping). Large early
    # gradients otherwise inflate Adam's second moments for many steps.
    grad_clip: float | None = None
    max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH
    mask_prompt: bool = False  # learn the completion only (chat, completions)
    seed: int = 0
    steps_per_report: int = 10
    steps_per_eval: int = 200
    val_batches: int = 25  # -1: the whole validation set
    grad_checkpoint: bool = False
    force: bool = False  # replace an existing, non-empty output directory
    name: str | None = None  # the adapter's name for --serve-url (default: out's name)
    serve_url: str | None = None  # hot-load the result into this running mola
    api_key: str | None = field(default=None, repr=False)  # for serve_url

    def __post_init__(self):
        object.__setattr__(self, "data", Path(self.data).expanduser())
        object.__setattr__(self, "out", Path(self.out).expanduser())
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must name a model directory or a Hugging Face hub id")

        def check_int(name, value, low, allow=()):
            if isinstance(value, bool) or not isinstance(value, int) or (value < low and value not in allow):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

        def check_number(name, value, low, *, inclusive=False, high=None):
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            ok = ok and (value >= low if inclusive else value > low) and (high is None or value < high)
            if not ok:
                bound = f">= {low}" if inclusive else f"> {low}"
                extra = f" and < {high}" if high is not None else ""
                raise ValueError(f"{name} must be a finite number {bound}{extra}, got {value!r}")

        check_int("rank", self.rank, 1)
        check_number("scale", self.scale, 0)
        check_number("dropout", self.dropout, 0, inclusive=True, high=1)
        if self.layers is not None:
            check_int("layers", self.layers, 1, allow=(-1,))
        check_int("iters", self.iters, 1)
        check_int("batch_size", self.batch_size, 1)
        check_number("learning_rate", self.learning_rate, 0)
        check_int("warmup", self.warmup, 0)
        if self.grad_clip is not None:
            check_number("grad_clip", self.grad_clip, 0)
        if self.warmup >= self.iters:
            raise ValueError(f"warmup ({self.warmup}) must be shorter than iters ({self.iters})")
        check_int("max_seq_length", self.max_seq_length, 2)
        check_int("seed", self.seed, 0)
        check_int("steps_per_report", self.steps_per_report, 1)
        check_int("steps_per_eval", self.steps_per_eval, 1)
        check_int("val_batches", self.val_batches, 1, allow=(-1,))
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.targets is not None:
            targets = tuple(t.strip() for t in self.targets)
            if not targets or not all(targets):
                raise ValueError("targets must be module names such as q_proj,v_proj (none empty)")
            object.__setattr__(self, "targets", targets)
        if self.name is not None and (not self.name.strip() or self.name != self.name.strip()):
            raise ValueError(f"invalid adapter name {self.name!r}")
        if self.serve_url is not None and not re.match(r"^https?://[^\s/]+", self.serve_url):
            raise ValueError(f"serve_url must be an http:// or https:// URL, got {self.serve_url!r}")

    @property
    def adapter_name(self) -> str:
        return self.name or self.out.resolve().name


# ---- data checks (no model needed) ------------------------------------------


@dataclass
class DataFile:
    path: Path
    format: str
    examples: list[dict]


@dataclass
class DataSet:
    train: DataFile
    valid: DataFile | None

    @property
    def format(self) -> str:
        return self.train.format


def _format_of(obj: dict) -> str | None:
    if "messages" in obj:
        return "chat"
    if "prompt" in obj or "completion" in obj:
        return "completions"
    if "text" in obj:
        return "text"
    return None


def _check_example(obj, where: str) -> str:
    """The example's format; raises DataError naming ``where`` (file:line)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fmt = _format_of(obj)
    if fmt is None:
        found = ", ".join(sorted(obj)) or "none"
        raise DataError(
            f"{where}: no data keys: expected \"messages\" (chat), \"prompt\" and \"completion\" "
            f"(completions) or \"text\"; found keys: {found}"
        )
    required, optional = FORMATS[fmt]
    missing = [k for k in required if k not in obj]
    if missing:
        raise DataError(f"{where}: the {fmt} format needs {' and '.join(repr(k) for k in required)}; "
                        f"missing {', '.join(repr(k) for k in missing)}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join(repr(k) for k in required + optional)
        raise DataError(f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)} "
                        f"for the {fmt} format (it takes {allowed})")
    if fmt == "chat":
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise DataError(f"{where}: messages[{i}] must be an object with \"role\" and \"content\"")
            role = m.get("role")
            if role not in ROLES:
                raise DataError(f"{where}: messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
            content = m.get("content")
            if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
                raise DataError(f"{where}: messages[{i}] (role {role}) needs a string \"content\"")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant message to learn from")
    elif fmt == "completions":
        for k in ("prompt", "completion"):
            if not isinstance(obj[k], str):
                raise DataError(f"{where}: \"{k}\" must be a string, got {type(obj[k]).__name__}")
        if not obj["completion"]:
            raise DataError(f"{where}: \"completion\" is empty")
    else:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise DataError(f"{where}: \"text\" must be a non-empty string")
    if "tools" in obj and not (isinstance(obj["tools"], list) and all(isinstance(t, dict) for t in obj["tools"])):
        raise DataError(f"{where}: \"tools\" must be a list of tool objects")
    return fmt


def read_data_file(path: Path) -> DataFile:
    """Parse and check one JSONL file: every line one example of one format.
    Blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    examples: list[dict] = []
    fmt = first_line = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        line_fmt = _check_example(obj, where)
        if fmt is None:
            fmt, first_line = line_fmt, lineno
        elif line_fmt != fmt:
            raise DataError(
                f"{where}: this example is in the {line_fmt} format but line {first_line} is in the "
                f"{fmt} format; one file must use one format"
            )
        examples.append(obj)
    if not examples:
        raise DataError(f"{path} is empty: it holds no examples")
    return DataFile(path=path, format=fmt, examples=examples)


def check_data(data_dir: Path, batch_size: int = DEFAULT_BATCH_SIZE) -> DataSet:
    """Check a data directory as mlx-lm will read it; raises DataError naming
    the file, line and problem."""
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise DataError(f"the data directory {data_dir} does not exist")
    if not data_dir.is_dir():
        raise DataError(f"{data_dir} is not a directory; --data takes a directory holding train.jsonl "
                        "(and optionally valid.jsonl)")
    train_path = data_dir / "train.jsonl"
    if not train_path.is_file():
        raise DataError(f"{data_dir} has no train.jsonl (one JSON example per line)")
    train = read_data_file(train_path)
    valid = read_data_file(data_dir / "valid.jsonl") if (data_dir / "valid.jsonl").is_file() else None
    for f in (train, valid):
        if f is not None and len(f.examples) < batch_size:
            raise DataError(f"{f.path} has {len(f.examples)} example(s); a batch size of {batch_size} needs "
                            f"at least {batch_size} (lower --batch-size or add examples)")
    return DataSet(train=train, valid=valid)


# ---- output path checks -----------------------------------------------------


def check_output(out: Path, force: bool = False, protect: tuple[Path, ...] = ()) -> None:
    """The adapter directory can be written: not a file, not an existing
    non-empty directory (unless ``force``), under a writable directory, and
    not a directory holding the data or model (``protect``) when forced."""
    out = Path(out)
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise OutputPathError(f"the output path {out} is a file; --out takes a directory for the adapter")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputPathError(f"the output directory {out} already exists and is not empty; "
                                  "choose another --out or pass --force to replace it")
        resolved = out.resolve()
        if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
            raise OutputPathError(f"refusing to replace {out}")
        for p in protect:
            p = Path(p).resolve()
            if p == resolved or resolved in p.parents:
                raise OutputPathError(f"refusing to replace {out}: it holds {p}")
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(f"cannot create {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot create {out}: {parent} is not writable")


# ---- training -----------------------------------------------------------------


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class TrainResult:
    path: Path
    seconds: float
    train_loss: float | None
    val_loss: float | None
    trainable_parameters: int
    served: dict | None = None


class _Progress:
    """mlx-lm's TrainingCallback: one line per report with the loss, on stderr."""

    def __init__(self, iters: int, log: Callable[[str], None]):
        from mlx_lm.tuner.callbacks import TrainingCallback

        self.iters = iters
        self.log = log
        self.t0 = time.perf_counter()
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        progress = self

        class Callback(TrainingCallback):
            def on_train_loss_report(self, info):
                progress.on_train(info)

            def on_val_loss_report(self, info):
                progress.on_val(info)

        self.callback = Callback()

    def on_train(self, info: dict) -> None:
        it = info["iteration"]
        self.train_loss = float(info["train_loss"])
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / it * (self.iters - it)
        width = 20
        done = round(width * it / self.iters)
        bar = "#" * done + "." * (width - done)
        self.log(f"[mola] train [{bar}] {it}/{self.iters}  loss {self.train_loss:.3f}  "
                 f"{info['tokens_per_second']:.0f} tok/s  {elapsed:.0f} s, ~{eta:.0f} s left")

    def on_val(self, info: dict) -> None:
        self.val_loss = float(info["val_loss"])
        self.log(f"[mola] valid  iter {info['iteration'] + 1}/{self.iters}  loss {self.val_loss:.3f}")


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
    given short names; every linear layer of a block when None."""
    import mlx.nn as nn

    block = model.layers[0]
    linears = [name for name, m in block.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear)) or hasattr(m, "to_lora")]
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
    t_start = time.perf_counter()
    data = check_data(config.data, config.batch_size)
    from .engine.loader import looks_like_hub_id

    model_path = Path(config.model).expanduser()
    protect = (config.data,) + ((model_path,) if model_path.exists() else ())
    check_output(config.out, config.force, protect)
    if not model_path.exists() and not looks_like_hub_id(config.model):
        raise TrainError(f"the model path does not exist: {model_path}")
    n_valid = len(data.valid.examples) if data.valid else 0
    log(f"[mola] data: {len(data.train.examples)} training and {n_valid} validation examples "
        f"({data.format} format) in {config.data}")

    import mlx.core as mx
    import numpy as np

    from .engine.loader import ModelLoadError, load_base_model

    log(f"[mola] loading {config.model} ...")
    try:
        loaded = load_base_model(config.model)
    except ModelLoadError as e:
        raise TrainError(e.message) from None
    model, tokenizer = loaded.model, loaded.tokenizer

    total_layers = len(model.layers)
    if config.layers is None or config.layers == -1:
        num_layers = total_layers if config.layers == -1 else min(DEFAULT_LAYERS, total_layers)
    elif config.layers > total_layers:
        raise TrainError(f"--layers {config.layers}: the model has only {total_layers} layers")
    else:
        num_layers = config.layers
    keys = resolve_targets(model, config.targets)

    train_set = tokenize(data.train.examples, tokenizer, config.mask_prompt)
    valid_set = tokenize(data.valid.examples, tokenizer, config.mask_prompt) if data.valid else []
    too_long = sum(len(t) > config.max_seq_length for t, _ in train_set + valid_set)
    if too_long:
        log(f"[mola] warning: {too_long} example(s) are longer than --max-seq-length "
            f"{config.max_seq_length} tokens and will be truncated")
    if config.mask_prompt and all(off >= len(t) - 1 for t, off in train_set):
        raise TrainError("with --mask-prompt nothing is left to learn: every example is all prompt")

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers
    mx.random.seed(config.seed)
    np.random.seed(config.seed)
    model.freeze()
    lora_parameters = {"rank": config.rank, "scale": float(config.scale), "dropout": float(config.dropout)}
    if config.targets is not None:
        lora_parameters["keys"] = keys
    linear_to_lora_layers(model, num_layers, lora_parameters)
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    short = sorted({k.rsplit(".", 1)[-1] for k in keys})
    log(f"[mola] LoRA rank {config.rank} on {', '.join(short)} of the last {num_layers} of "
        f"{total_layers} layers: {trainable:,} trainable parameters; {config.iters} iterations "
        f"of batch {config.batch_size}, learning rate {config.learning_rate:g}")

    if config.lr_schedule == "cosine":
        schedule = {"name": "cosine_decay",
                    "arguments": [config.learning_rate, config.iters - config.warmup,
                                  config.learning_rate * 0.1],
                    "warmup": config.warmup}
        learning_rate = build_schedule(schedule)
    elif config.warmup:
        learning_rate = build_schedule({"name": "linear_schedule",
                                        "arguments": [config.learning_rate, config.learning_rate, 1],
                                        "warmup": config.warmup})
    else:
        learning_rate = config.learning_rate
    optimizer = _adam(learning_rate, config.grad_clip)

    adapter_config = {
        "fine_tune_type": "lora",
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
    out = config.out
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.train-", dir=out.resolve().parent))
    progress = _Progress(config.iters, log)
    try:
        args = TrainingArgs(
            batch_size=config.batch_size,
            iters=config.iters,
            val_batches=config.val_batches,
            steps_per_report=config.steps_per_report,
            steps_per_eval=config.steps_per_eval,
            steps_per_save=config.iters + 1,  # only the final save
            adapter_file=str(tmp / "adapters.safetensors"),
            max_seq_length=config.max_seq_length,
            grad_checkpoint=config.grad_checkpoint,
        )
        # mlx-lm's own progress display goes to stdout; mola reports through
        # the callback instead, on stderr.
        with contextlib.redirect_stdout(io.StringIO()):
            train(model=model, optimizer=optimizer, train_dataset=batchable(train_set, config.seed),
                  val_dataset=batchable(valid_set, None) if valid_set else None, args=args,
                  training_callback=progress.callback)
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        _place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = TrainResult(
        path=out, seconds=time.perf_counter() - t_start, train_loss=progress.train_loss,
        val_loss=progress.val_loss, trainable_parameters=trainable,
    )
    log(f"[mola] adapter written to {out} in {result.seconds:.0f} s"
        + (f" (final training loss {result.train_loss:.3f})" if result.train_loss is not None else ""))
    if config.serve_url:
        result.served = hot_load(config.serve_url, config.adapter_name, out, config.api_key)
        log(f"[mola] {config.serve_url} now serves the adapter as model '{config.adapter_name}'")
    return result


def _adam(learning_rate, grad_clip: float | None):
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


def _place(tmp: Path, out: Path) -> None:
    """Move the finished adapter into ``out``, replacing what was there."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.old-", dir=out.resolve().parent))
        os.replace(out, old / "x")
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(old / "x", out)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(tmp, out)


def hot_load(url: str, name: str, path: Path, api_key: str | None = None, timeout: float = 120.0) -> dict:
    """POST /v1/adapters {"name", "path"} to a running mola; the adapter object
    it answers. Raises TrainError with the server's message."""
    import urllib.error
    import urllib.request

    endpoint = url.rstrip("/") + "/v1/adapters"
    body = json.dumps({"name": name, "path": str(Path(path).resolve())}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except Exception:
            message = e.reason
        hint = ""
        if e.code == 403:
            hint = (" (start the server with an --adapter-dir that holds the adapter, or with "
                    "--allow-any-adapter-path)")
        elif e.code == 409:
            hint = " (choose another --name, or unload the old one first)"
        raise TrainError(f"the adapter was written to {path}, but {endpoint} refused to load it: "
                         f"HTTP {e.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TrainError(f"the adapter was written to {path}, but {endpoint} could not be reached: "
                         f"{reason}") from None


def run(config: TrainConfig) -> int:
    """`mola train`'s exit status: 0 when the adapter is written (and, with
    --serve-url, loaded), 1 with a message on stderr otherwise."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        train_adapter(config)
    except TrainError as e:
        print(f"[mola] error: {e.message}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("[mola] interrupted; no adapter was written", file=sys.stderr, flush=True)
        return 130
    return 0
