"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens)
over the chat path: protocol.py (the request bodies), convert.py (Anthropic
messages and tools <-> the chat messages and tools the template renders),
events.py (the message and its stream events), errors.py (Anthropic's
error envelope)."""
