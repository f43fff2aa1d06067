"""The student's training: mlx-lm's tuner (``tuner.trainer.train``) with the
distillation loss and batches, `mola train`'s optimiser and progress line,
and the weights after the last finished step kept for Ctrl-C."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from ..train.config import TrainConfig
from ..train.progress import Progress
from .data import Example, make_iterate_batches


class Checkpoint:
    """The adapter's weights after the last finished step. They are held, not
    copied: MLX arrays are immutable, and a step makes new ones."""

    def __init__(self, model):
        self.model = model
        self.steps = -1  # steps finished when the weights were taken
        self.weights: dict | None = None

    def take(self) -> None:
        from mlx.utils import tree_flatten

        self.steps += 1
        self.weights = dict(tree_flatten(self.model.trainable_parameters()))

    def save(self, path: Path) -> None:
        import mlx.core as mx

        mx.save_safetensors(str(path), self.weights)


def fit(model, recipe: TrainConfig, loss: str, examples: list[Example], adapter_file: Path,
        progress: Progress) -> int | None:
    """Train the model's LoRA layers and write them to ``adapter_file``.
    Returns None, or on Ctrl-C the number of steps whose weights were
    written (KeyboardInterrupt again when no step had finished)."""
    from mlx_lm.tuner.trainer import TrainingArgs, train

    from ..train.run import adam, learning_rate_schedule
    from .loss import LOSSES

    checkpoint = Checkpoint(model)
    args = TrainingArgs(
        batch_size=recipe.batch_size, iters=recipe.iters, steps_per_report=recipe.steps_per_report,
        steps_per_eval=recipe.iters + 1, steps_per_save=recipe.iters + 1,  # only the final save
        adapter_file=str(adapter_file), max_seq_length=recipe.max_seq_length, grad_checkpoint=recipe.grad_checkpoint,
    )
    try:
        # mlx-lm's own progress display goes to stdout; mola's goes to stderr.
        with contextlib.redirect_stdout(io.StringIO()):
            train(model=model, optimizer=adam(learning_rate_schedule(recipe), recipe.grad_clip), train_dataset=examples,
                  args=args, loss=LOSSES[loss],
                  iterate_batches=make_iterate_batches(loss == "kl", recipe.seed, checkpoint.take),
                  training_callback=progress.callback)
    except KeyboardInterrupt:
        if checkpoint.steps < 1:
            raise
        checkpoint.save(adapter_file)
        return checkpoint.steps
    return None
