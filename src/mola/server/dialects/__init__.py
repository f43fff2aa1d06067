"""The four text dialects, each a translation only: ``to_spec(body)`` turns
its request body into a :class:`~mola.frontend.spec.GenerationSpec`, and
``respond(...)`` turns the generations the pipeline started into its
response (JSON, or its stream of events). Chat completions and completions
are OpenAI's; messages is Anthropic's; responses is OpenAI's Responses API."""
