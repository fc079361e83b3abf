"""The OpenAI-compatible HTTP face of the runtime engine (no model logic here)."""
