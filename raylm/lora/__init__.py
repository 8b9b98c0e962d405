"""LoRA adapters served beside one base model (issue 53): the request's
handle (`request.py`, a plain value every layer may carry), the loader of
PEFT-format adapters, the front end's registry of checked adapters, and the
workers' adapter slots applied in one gathered call per layer."""
