"""--chat-template as a setting: a file to read, or the template itself.

At the root with config.py, which validates it, so that the config layer needs
nothing from the layers above it.
"""

from __future__ import annotations

import codecs
import os

# A value with none of these is a file name, not a Jinja template.
_TEMPLATE_CHARS = "{}\n"


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
