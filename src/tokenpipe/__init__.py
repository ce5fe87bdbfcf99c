"""tokenpipe: a fast, predictable OpenAI-compatible streaming gateway for LLM APIs."""

__version__ = "0.1.0"
