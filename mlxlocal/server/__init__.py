"""`mlxlocal serve`: OpenAI-, Anthropic- and Ollama-compatible HTTP APIs on the engine."""

from mlxlocal.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
