"""The OpenAI-compatible server (`raylm serve`): the FastAPI app (api_server),
its protocol models, the completion, chat, tokenize and tool-calling handlers,
structured-output fields, admission bounds (limits), Prometheus metrics, the
data-parallel admin routes, the tool-call and reasoning parsers, and the
`raylm bench serve` load generator.
"""
