"""The HTTP side: the FastAPI app, its routes, SSE streaming, request ids and errors."""
