"""OpenAI-compatible requests and responses: schemas, request planning, formatting, streaming, routes."""
