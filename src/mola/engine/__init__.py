"""The continuous-batching engine: sequences, scheduler, runner and the
thread that owns the model."""
