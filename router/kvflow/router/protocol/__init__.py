"""The OpenAI wire protocol: request validation, response and chunk shapes, errors. Pure."""
