"""`mola train`'s settings: one frozen dataclass, checked when it is made."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidAdapterName
from ..registry.names import check_adapter_id

# mlx-lm's defaults (mlx_lm/lora.py CONFIG_DEFAULTS), which mola keeps.
DEFAULT_RANK = 8
DEFAULT_SCALE = 20.0
DEFAULT_LAYERS = 16
DEFAULT_ITERS = 1000
DEFAULT_BATCH_SIZE = 4
DEFAULT_LEARNING_RATE = 1e-5
DEFAULT_MAX_SEQ_LENGTH = 2048
# gguf_writer.OUTTYPES (as llama.cpp's convert_lora_to_gguf.py --outtype), named
# here so that the command line checks it without loading MLX.
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
TRAIN_DTYPES = ("keep", "float16", "bfloat16", "float32")


@dataclass(frozen=True)
class TrainConfig:
    model: str  # a local model directory, a GGUF file or a Hugging Face hub id
    data: Path  # a directory with train.jsonl and optionally valid.jsonl
    # Where the adapter goes: a directory (an mlx-lm adapter), a FILE.gguf (a
    # llama.cpp GGUF LoRA), or a tuple of one of each (both, from the same
    # weights). Normalized to the first; ``outputs`` holds them all.
    out: Path | tuple
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
    gguf_outtype: str = "f32"  # tensor type of a .gguf output: f32, f16, bf16 or q8_0
    # The base as trained on: "keep" (quantized layers stay quantized: LoRA on
    # the QuantizedLinear layers, as mlx-lm's tuner does) or a float dtype it is
    # dequantized to (mola serve's --dtype).
    dtype: str = "keep"
    # An activated LoRA: its delta applies from the last place this text's
    # tokens start in each example (None: a plain LoRA).
    alora_invocation: str | None = None
    # "lora", or "dora": mlx-lm's DoRALinear (a magnitude per output beside the factors; mola.adapters.dora)
    fine_tune_type: str = "lora"
    outputs: tuple[Path, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "data", Path(self.data).expanduser())
        outs = self.out if isinstance(self.out, (tuple, list)) else (self.out,)
        outs = tuple(Path(o).expanduser() for o in outs)
        ggufs = [o for o in outs if o.suffix == ".gguf"]
        if not outs or len(ggufs) > 1 or len(outs) - len(ggufs) > 1:
            raise ValueError(f"out takes an adapter directory, a FILE.gguf, or one of each; got "
                             f"{', '.join(map(str, outs)) or 'none'}")
        object.__setattr__(self, "outputs", outs)
        object.__setattr__(self, "out", outs[0])
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(TRAIN_DTYPES)}, got {self.dtype!r}")
        if self.gguf_outtype not in GGUF_OUTTYPES:
            raise ValueError(f"gguf_outtype must be one of {', '.join(GGUF_OUTTYPES)}, got {self.gguf_outtype!r}")
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
        if self.alora_invocation is not None and (not isinstance(self.alora_invocation, str)
                                                  or not self.alora_invocation):
            raise ValueError("alora_invocation must be a non-empty text (the invocation, e.g. a role header)")
        self._check_dora()
        if self.serve_url is not None and not re.match(r"^https?://[^\s/]+", self.serve_url):
            raise ValueError(f"serve_url must be an http:// or https:// URL, got {self.serve_url!r}")
        if self.name is not None or self.serve_url is not None:
            try:  # before training, not after it, when the server would refuse it
                check_adapter_id(self.adapter_name)
            except InvalidAdapterName as e:
                raise ValueError(f"{e.message} (set --name)" if self.name is None else e.message) from None

    def _check_dora(self) -> None:
        if self.fine_tune_type not in ("lora", "dora"):
            raise ValueError(f"fine_tune_type must be 'lora' or 'dora', got {self.fine_tune_type!r}")
        if self.fine_tune_type == "dora" and self.gguf_out is not None:
            raise ValueError(f"fine_tune_type 'dora' cannot be written as GGUF ({self.gguf_out}): llama.cpp has no "
                             "DoRA; write an adapter directory")
        if self.fine_tune_type == "dora" and self.alora_invocation is not None:
            raise ValueError("fine_tune_type 'dora' and alora_invocation do not go together: mola serves DoRA as a "
                             "plain adapter only")

    @property
    def adapter_name(self) -> str:
        return self.name or (self.out.resolve().stem if self.out.suffix == ".gguf" else self.out.resolve().name)

    @property
    def mlx_lm_out(self) -> Path | None:
        """The mlx-lm adapter directory to write, if one is asked for."""
        return next((o for o in self.outputs if o.suffix != ".gguf"), None)

    @property
    def gguf_out(self) -> Path | None:
        """The llama.cpp GGUF LoRA file to write, if one is asked for."""
        return next((o for o in self.outputs if o.suffix == ".gguf"), None)
