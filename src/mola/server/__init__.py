"""The HTTP front end: FastAPI app, OpenAI protocol, routes and streaming."""
