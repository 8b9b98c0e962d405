"""The OpenAI-compatible server (`raylm serve`): FastAPI app, protocol models,
completion and chat handlers, metrics, and the `raylm bench serve` load generator."""
