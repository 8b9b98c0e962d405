"""Loading the tokenizer of a model folder (a fast Hugging Face tokenizer), and
the chat template that may replace its own (--chat-template)."""

from __future__ import annotations

import codecs
import os
from typing import Any

# A value with none of these is a file name, not a Jinja template.
_TEMPLATE_CHARS = "{}\n"


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


def read_chat_template(value: str) -> str:
    """--chat-template, as in vLLM: a file to read, else the template itself
    (escapes such as \\n, typed on a command line, are decoded)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read {value!r}: {e}") from e
    if not any(c in value for c in _TEMPLATE_CHARS):
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    # Non-ASCII text survives: it is escaped before the escapes are decoded.
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


def encode_rendered_chat(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered chat template.

    Most templates write the BOS token themselves, so the tokenizer must not
    add another; a template that leaves it out (the embedded model's) still
    needs the BOS the model was trained with.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add_bos = bool(bos) and not text.startswith(bos)
    return tokenizer.encode(text, add_special_tokens=add_bos)
