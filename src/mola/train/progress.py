"""What a training run reports: a progress line per report on stderr, and
its result."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class TrainResult:
    path: Path
    seconds: float
    train_loss: float | None
    val_loss: float | None
    trainable_parameters: int
    served: dict | None = None
    outputs: tuple[Path, ...] = ()  # everything written: the adapter directory and/or the .gguf
    # The base as trained on: its linears, how many of them stayed
    # nn.QuantizedLinear (a quantized base is trained as it is, never
    # dequantized), and the MLX memory loading and training held at the peak.
    linear_layers: int = 0
    quantized_layers: int = 0
    peak_memory_bytes: int = 0


class Progress:
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
