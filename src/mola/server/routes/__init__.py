"""HTTP routes: OpenAI's (chat, models) and mola's own (adapters, health)."""
