"""Loading the tokenizer of a model folder (a fast Hugging Face tokenizer)."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"tokenizer path {path!r} is not a folder")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types; the user needs the path
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
