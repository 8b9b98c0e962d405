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


def encode_rendered_chat(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered chat template.

    Most templates write the BOS token themselves, so the tokenizer must not
    add another; a template that leaves it out (the embedded model's) still
    needs the BOS the model was trained with.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add_bos = bool(bos) and not text.startswith(bos)
    return tokenizer.encode(text, add_special_tokens=add_bos)
