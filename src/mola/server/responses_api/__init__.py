"""OpenAI's Responses API (POST /v1/responses): the request and its checks
(protocol.py), input items as chat messages (items.py), the Response object
and its output items (objects.py), the typed stream events (events.py), and
the in-memory store behind ``previous_response_id`` (store.py)."""
