"""Chat templates: --chat-template as a setting (a file to read, or the
template itself), and `render_bounded`, which renders one within bounds of
time, work and output.

At the root with config.py, which validates the setting, so that the config
layer needs nothing from the layers above it (jinja2 and transformers are
imported only when a template is first rendered).
"""

from __future__ import annotations

import codecs
import os
import re
import threading
import time

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


# ---- Bounded rendering ---------------------------------------------------------
# A chat template is a program. The model's own runs on every chat request with
# the client's messages, and with --trust-request-chat-template a client may
# send one of its own; either way a render must not be able to take the server
# down. Jinja's sandbox keeps a template away from Python's internals but not
# from unbounded work: `{{ 'a' * 200000000 }}`, loops nested in loops, a string
# doubled in a loop. Every render here runs in an environment that counts
# what the template builds and how many steps it takes:
#
# - time: the render's own CPU time (time.thread_time, so that a render waiting
#   for the GIL behind other threads is not charged for it), and a wall-clock
#   backstop, checked at every loop iteration, call, filter and operator;
# - work: the characters (or items) of every value it builds, summed, checked
#   before an operation that could build a large value at once (repetition,
#   concatenation, joining, padding, replacing, formatting) and after every one;
# - output: the rendered text's length.
#
# Past any of them the render stops with ChatTemplateRenderError (a ValueError:
# HTTP 400 online). Work is charged cumulatively, so it also bounds the memory a
# render can hold at once.

# CPU seconds one render may take; a real template renders a long conversation
# in milliseconds.
RENDER_CPU_SECONDS = 2.0
# And seconds by the clock, however busy the machine: a render's thread shares
# the GIL with the event loop and other renders, so its CPU time lags.
RENDER_WALL_SECONDS = 10.0
# The longest rendered prompt: ~2M tokens of English, beyond any context length.
MAX_RENDERED_CHARS = 8 * 2**20
# What a render may build in all: a template touches each message a few times.
MAX_RENDER_WORK = 8 * MAX_RENDERED_CHARS
# Integers past this many bits (2**100000) are refused: their arithmetic and
# their text are the cost, not their size in a template.
MAX_INT_BITS = 4096
# The clock is read every this many steps (a syscall; a step is ~a microsecond).
_CLOCK_EVERY = 64
# Filters whose result is text built from their whole argument.
_STRINGIFYING_FILTERS = frozenset({"join", "tojson", "string", "format", "pprint", "xmlattr", "urlize", "escape",
                                   "e", "forceescape", "safe", "list", "wordwrap", "title", "capitalize", "upper",
                                   "lower", "trim", "striptags", "truncate", "urlencode", "filesizeformat"})


class ChatTemplateRenderError(ValueError):
    """A render went past one of its bounds."""


class ChatTemplateNotBounded(RuntimeError):
    """transformers rendered without the bounded environment (see _install_render_hook)."""


class _RenderBudget:
    """One render's bounds, kept by the thread that renders."""

    def __init__(self) -> None:
        self.deadline = time.thread_time() + RENDER_CPU_SECONDS
        self.wall_deadline = time.monotonic() + RENDER_WALL_SECONDS
        self.work = 0
        self.steps = 0
        self.used = False  # set by the bounded environment: the render really went through it

    def step(self) -> None:
        self.steps += 1
        if self.steps % _CLOCK_EVERY == 0 and (time.thread_time() > self.deadline
                                               or time.monotonic() > self.wall_deadline):
            raise ChatTemplateRenderError(f"chat template render exceeded its time limit ({RENDER_CPU_SECONDS:g} s "
                                          f"of CPU, {RENDER_WALL_SECONDS:g} s in all)")

    def charge(self, amount: int) -> None:
        self.work += amount
        if self.work > MAX_RENDER_WORK:
            raise ChatTemplateRenderError(
                f"chat template render exceeded its work limit (it built more than {MAX_RENDER_WORK} characters)")

    def remaining(self) -> int:
        return MAX_RENDER_WORK - self.work


_local = threading.local()


def _active() -> _RenderBudget | None:
    return getattr(_local, "budget", None)


def _size(value) -> int:
    """What building `value` cost: its length for text and containers."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 8
    return 1


def _text_size(value, limit: int) -> int:
    """About len(str(value)), counted without building it; stops once past
    `limit` (so it costs at most ~limit steps)."""
    from jinja2.utils import Namespace

    stack, total = [value], 0
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item)
        elif isinstance(item, Namespace):
            stack.append(dict(item._Namespace__attrs))  # its text shows its attributes
        else:
            total += 24  # numbers (bounded by MAX_INT_BITS), None, small objects
    return total


def _check_ints(values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDERED_CHARS:
            raise ChatTemplateRenderError(f"chat template render exceeded its limits (an argument of {value})")


# A number of 8 digits or more in a format string: a width past MAX_RENDERED_CHARS.
_FORMAT_NUMBER = re.compile(r"\d{8,}")


def _check_format_text(fmt) -> None:
    """A width or precision in a format string is a size; `*` takes it from
    the arguments, which _check_ints sees."""
    if isinstance(fmt, str) and _FORMAT_NUMBER.search(fmt):
        raise ChatTemplateRenderError("chat template render exceeded its limits (a format width)")


def _predicted_binop(operator: str, left, right) -> int:
    """An upper bound of the size of `left <operator> right`, before it is built."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                return len(seq) * max(times, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 8
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return right * max(left.bit_length(), 1) // 8
    elif operator == "+" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
        return len(left) + len(right)
    elif operator == "%" and isinstance(left, str):
        _check_format_text(left)
        _check_ints(right if isinstance(right, tuple) else (right,))
        return len(left) + _text_size(right, MAX_RENDER_WORK)
    return 0


def _predicted_str_method(name: str, text: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of the size of `text.<name>(...)` for the str methods
    that can build much more than they are given."""
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        return max(len(text), args[0])
    if name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t") * (size if isinstance(size, int) else 0)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = text.count(args[0]) if args[0] else len(text) + 1
        return len(text) + hits * max(len(args[1]) - len(args[0]), 0)
    if name in ("join", "format", "format_map"):
        if name == "format":
            _check_format_text(text)
        return len(text) * (2 if name == "join" else 1) + _text_size((args, kwargs), MAX_RENDER_WORK)
    return 0


def _predicted_filter(name: str, args: tuple, kwargs: dict) -> int:
    value = args[0] if args else None
    if name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(value) + (value.count("\n") + 1) * width
    if name == "center" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 80)
        return max(len(value), width if isinstance(width, int) else 0)
    if name == "replace" and isinstance(value, str) and len(args) >= 3:
        return _predicted_str_method("replace", value, args[1:3], {})
    if name == "tojson":
        indent = kwargs.get("indent") or (args[2] if len(args) > 2 else None) or 0
        indent = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        return _text_size(value, MAX_RENDER_WORK) * (2 + indent)
    if name in _STRINGIFYING_FILTERS:
        return _text_size((args, kwargs), MAX_RENDER_WORK)
    return 0


def _charge_predicted(budget: _RenderBudget, predicted: int) -> None:
    if predicted > MAX_RENDERED_CHARS or predicted > budget.remaining():
        raise ChatTemplateRenderError(
            f"chat template render exceeded its work limit (one value of ~{predicted} characters)")


def _bounded_filter(name: str, function):
    """`function` (a filter), charged to the active budget."""
    import functools

    @functools.wraps(function)  # keeps jinja's pass_context & co. markers
    def bounded(*args, **kwargs):
        budget = _active()
        if budget is None:
            return function(*args, **kwargs)
        budget.step()
        # A pass_context/pass_eval_context/pass_environment filter gets that first.
        plain = args[1:] if getattr(function, "jinja_pass_arg", None) is not None else args
        _check_ints(plain[1:])
        _check_ints(kwargs.values())
        _charge_predicted(budget, _predicted_filter(name, plain, kwargs))
        result = function(*args, **kwargs)
        budget.charge(_size(result))
        return result

    return bounded


def _steps(iterable):
    """A for loop's items, each one a step of the render."""
    budget = _active()
    if budget is None:
        yield from iterable
        return
    for item in iterable:
        budget.step()
        yield item


def _concat(values) -> str:
    """The `~` operator, measured before it joins."""
    budget = _active()
    if budget is not None:
        budget.step()
        _charge_predicted(budget, _text_size(list(values), MAX_RENDER_WORK))
    return "".join(str(v) for v in values)


def _make_bounded_environment(prototype):
    """An ImmutableSandboxedEnvironment like transformers' `prototype` (its
    extensions, filters and globals), with every way of building a large value
    charged to the active budget."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class _Bounding(NodeTransformer):
        """Loops step the budget; `~` measures before it joins."""

        def __init__(self, environment):
            self.environment = environment

        def _filter(self, node, name: str, lineno: int):
            return nodes.Filter(node, name, [], [], None, None, lineno=lineno).set_environment(self.environment)

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = self._filter(node.iter, "_raylm_steps", node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            items = nodes.List(node.nodes, lineno=node.lineno).set_environment(self.environment)
            return self._filter(items, "_raylm_concat", node.lineno)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

        def _parse(self, source, name, filename):
            return _Bounding(self).visit(super()._parse(source, name, filename))

        def call_binop(self, context, operator, left, right):
            budget = _active()
            if budget is None:
                return super().call_binop(context, operator, left, right)
            budget.step()
            _charge_predicted(budget, _predicted_binop(operator, left, right))
            result = super().call_binop(context, operator, left, right)
            if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
                raise ChatTemplateRenderError(f"chat template render exceeded its limits (an integer of "
                                              f"{result.bit_length()} bits)")
            budget.charge(_size(result))
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            budget = _active()
            if budget is None:
                return super().call(__context, __obj, *args, **kwargs)
            budget.step()
            _check_ints(args)
            _check_ints(kwargs.values())
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                _charge_predicted(budget, _predicted_str_method(getattr(__obj, "__name__", ""), owner, args, kwargs))
            result = super().call(__context, __obj, *args, **kwargs)
            budget.charge(_size(result))
            return result

        def wrap_str_format(self, value):
            """str.format and format_map, which the sandbox hands out wrapped:
            their width fields are sizes."""
            wrapper = super().wrap_str_format(value)
            if wrapper is None:
                return None
            text = value.__self__

            def bounded(*args, **kwargs):
                budget = _active()
                if budget is not None:
                    _charge_predicted(budget, _predicted_str_method("format", text, args, kwargs))
                return wrapper(*args, **kwargs)

            return bounded

        def concat(self, pieces) -> str:
            """The render's output, and every block's ({% set %}...{% endset %},
            macro bodies): each piece charged as it is made."""
            budget = _active()
            if budget is None:
                return "".join(pieces)
            budget.used = True
            collected = []
            for piece in pieces:
                budget.step()
                budget.charge(len(piece))
                collected.append(piece)
            return "".join(collected)

    def finalize(value):
        """What `{{ ... }}` prints, measured before it becomes text."""
        budget = _active()
        if budget is not None and not isinstance(value, str):
            _charge_predicted(budget, _text_size(value, MAX_RENDER_WORK))
        return value

    env = BoundedEnvironment(
        trim_blocks=prototype.trim_blocks, lstrip_blocks=prototype.lstrip_blocks, finalize=finalize,
        extensions=[type(extension) for extension in prototype.extensions.values()])
    env.filters.update({name: _bounded_filter(name, f) for name, f in prototype.filters.items()})
    env.filters["_raylm_steps"] = _steps
    env.filters["_raylm_concat"] = _concat
    env.globals.update(prototype.globals)
    env.globals.pop("lipsum", None)  # lipsum(n=...) writes n paragraphs; no chat template needs it
    return env


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
        raise ChatTemplateNotBounded("the chat template was not rendered in raylm's bounded environment "
                           "(has transformers changed how apply_chat_template compiles templates?)")
    if len(text) > MAX_RENDERED_CHARS:
        raise ChatTemplateRenderError(
            f"chat template render exceeded its output limit ({len(text)} characters > {MAX_RENDERED_CHARS})")
    return text
