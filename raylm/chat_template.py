"""Chat templates: --chat-template as a setting (a file to read, or the
template itself), and `render_bounded`, which renders one within bounds of
time, work and output: the way in to the bounded rendering, whose parts live
beside this module (the bounds and the budget that keeps them,
chat_template_budget; the sizes of operations before they run,
chat_template_prediction; the bounded Jinja environment, chat_template_sandbox).

At the root with config.py, which validates the setting, so that the config
layer needs nothing from the layers above it (jinja2 and transformers are
imported only when a template is first rendered).
"""

from __future__ import annotations

import codecs
import os
import threading

from raylm.chat_template_budget import MAX_RENDERED_CHARS, ChatTemplateRenderError, _local, _RenderBudget
from raylm.chat_template_sandbox import _make_bounded_environment

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


class ChatTemplateNotBounded(RuntimeError):
    """transformers rendered without the bounded environment (see _install_render_hook)."""


_hook_lock = threading.Lock()
_hooked = False


def _install_render_hook() -> None:
    """Makes transformers' apply_chat_template compile templates in the
    bounded environment (it keeps everything else: special tokens, tools,
    continue_final_message). transformers compiles through one module-level
    function; render_bounded checks after each render that it went through
    the bounded environment, so a transformers that changed this fails loudly
    instead of rendering unbounded."""
    global _hooked
    with _hook_lock:
        if _hooked:
            return
        import functools

        from transformers.utils import chat_template_utils

        original = chat_template_utils._compile_jinja_template
        environment = _make_bounded_environment(original("").environment)

        @functools.lru_cache(maxsize=64)  # a few server templates, and request templates seen lately
        def compile_bounded(template: str):
            return environment.from_string(template)

        chat_template_utils._compile_jinja_template = compile_bounded
        _hooked = True


def render_bounded(tokenizer, conversation: list[dict], **kwargs) -> str:
    """tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    within the render bounds above; ChatTemplateRenderError past them, and the
    template's own errors as they are (jinja's, ValueError, ...)."""
    _install_render_hook()
    budget = _RenderBudget()
    _local.budget = budget
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    except RecursionError:
        raise ChatTemplateRenderError("chat template render exceeded its limits (recursion too deep)") from None
    except MemoryError:
        raise ChatTemplateRenderError("chat template render exceeded its limits (out of memory)") from None
    finally:
        _local.budget = None
    if not budget.used:
        raise ChatTemplateNotBounded(
            "the chat template was not rendered in raylm's bounded environment "
            "(has transformers changed how apply_chat_template compiles templates?)"
        )
    if len(text) > MAX_RENDERED_CHARS:
        raise ChatTemplateRenderError(
            f"chat template render exceeded its output limit ({len(text)} characters > {MAX_RENDERED_CHARS})"
        )
    return text
