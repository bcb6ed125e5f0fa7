"""mlxlocal: local LLM inference on Apple Silicon, built on MLX."""

__version__ = "0.1.0"
