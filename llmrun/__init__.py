"""llmrun: a local LLM runner with Ollama, OpenAI and Anthropic compatible APIs."""

__version__ = "0.1.0"
