"""What users run: the `raylm` CLI (cli.py: generate, serve, plan, bench), the
dry run of a placement (plan.py), offline benchmarks (bench.py) and the
OpenAI-compatible server (openai/)."""
