"""Loading the tokenizer of a model folder (a fast Hugging Face tokenizer), with
the chat template that may replace its own (--chat-template, read by
raylm.chat_template)."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """The tokenizer in folder `path`; `chat_template` (template text) replaces its own."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"tokenizer path {path!r} is not a folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types; the user needs the path
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
    if chat_template is not None:
        # Every renderer (LLM.chat, the server) reads it from the tokenizer.
        tokenizer.chat_template = chat_template
    return tokenizer


def encode_rendered_chat(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered chat template.

    Most templates write the BOS token themselves, so the tokenizer must not
    add another; a template that leaves it out (the embedded model's) still
    needs the BOS the model was trained with.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add_bos = bool(bos) and not text.startswith(bos)
    return tokenizer.encode(text, add_special_tokens=add_bos)
