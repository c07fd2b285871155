"""The OpenAI-compatible gateway and KV-aware router (`kvflow router`)."""
