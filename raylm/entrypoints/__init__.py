"""What users run: the CLI and (later) the OpenAI-compatible server.
`raylm generate|bench` live in cli.py and bench.py."""
