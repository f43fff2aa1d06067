"""The request pipeline, with no HTTP in it: a dialect's body becomes a
:class:`~mola.frontend.spec.GenerationSpec`, which is admitted (cheap checks,
backpressure), prepared in one trip to the tokenizer thread (template,
tokens, reasoning, grammar) and started on the engine as one
:class:`~mola.frontend.generation.Generation` per choice (pipeline.py)."""
