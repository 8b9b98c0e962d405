"""The engine: LLM (offline), the engine core's step loop, request intake
(validation, tokenization) and output assembly (detokenization, stop strings)."""
