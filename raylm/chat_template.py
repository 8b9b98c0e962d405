"""Chat templates: --chat-template as a setting (a file to read, or the
template itself), and `render_bounded`, which renders one within bounds of
time, work and output.

At the root with config.py, which validates the setting, so that the config
layer needs nothing from the layers above it (jinja2 and transformers are
imported only when a template is first rendered).
"""

from __future__ import annotations

import codecs
import itertools
import os
import re
import sys
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
# what the template builds and how long it takes:
#
# - time: the render's own CPU time (time.thread_time, so that a render waiting
#   for the GIL behind other threads is not charged for it), and a wall-clock
#   backstop, checked at every step (loop iteration, call, filter, operator,
#   slice, literal, piece of output) and inside raylm's own walks over values.
#   So that one step cannot run long between two readings, a filter that works
#   item by item in Python (sort, wordwrap, pprint, ...) is refused an input
#   past MAX_SLOW_STEP_UNITS, a lazy filter's items are steps of their own, and
#   encode/decode take only the linear codecs.
# - memory: the bytes of every value it builds (strings and numbers by
#   their allocation; containers by their own size and the values they hold that
#   are new: not the render's inputs, nor what the operands already held),
#   summed, and checked before an operation that could build a large value at
#   once (repetition, concatenation, joining, padding, replacing, formatting,
#   splitting, a string's characters as a list) as well as after every one.
# - output: the rendered text's length.
#
# Past any of them the render stops with ChatTemplateRenderError (a ValueError:
# HTTP 400 online). Memory is charged cumulatively, so it bounds what a render
# can hold at once; an operation that is not predicted builds at most about
# what it reads (a strip, a partition), so a render stops within about one
# value's size of MAX_RENDER_WORK.

# CPU seconds one render may take; a real template renders a long conversation
# in milliseconds.
RENDER_CPU_SECONDS = 2.0
# And seconds by the clock, however busy the machine: a render's thread shares
# the GIL with the event loop and other renders, so its CPU time lags.
RENDER_WALL_SECONDS = 10.0
# The longest rendered prompt: ~2M tokens of English, beyond any context length.
MAX_RENDERED_CHARS = 8 * 2**20
# The bytes a render may build in all: a template touches each message a few
# times (ASCII text takes a byte a character, other text up to 4).
MAX_RENDER_WORK = 8 * MAX_RENDERED_CHARS
# The largest single value: a longest prompt's worth of the widest characters.
MAX_VALUE_BYTES = 4 * MAX_RENDERED_CHARS
# Integers past this many bits (2**100000) are refused: their arithmetic and
# their text are the cost, not their size in a template.
MAX_INT_BITS = 4096
# time.monotonic costs ~40 ns and is read at every step; time.thread_time is a
# system call (~0.5 us, as much as a light step), so it is read once every this
# many seconds of the wall clock (CPU time cannot run ahead of it).
_CPU_CLOCK_EVERY_S = 0.01
# raylm's own walks over a value (measuring it) read the clock every this many items.
_WALK_CLOCK_EVERY = 1024
# The most input (characters, or items) one step of a slow filter or method
# gets: those work item by item in Python, at up to ~1 us an item or a
# character (sort of a string, urlize, pprint), so one step stays under ~0.3 s
# and the clock, read between steps, holds. Real templates apply them to roles
# and tool schemas, not to whole conversations.
MAX_SLOW_STEP_UNITS = 2**18
# Filters that run in C in time linear in what they read and build (or in
# constant time), whatever their input: bounded by the memory limit alone.
_LINEAR_FILTERS = frozenset({"abs", "attr", "capitalize", "center", "count", "d", "default", "e", "escape",
                             "filesizeformat", "first", "float", "forceescape", "format", "int", "join", "last",
                             "length", "list", "lower", "random", "replace", "round", "safe", "string", "tojson",
                             "trim", "truncate", "upper"})
# Filters that return an iterator, whose items are each a step (and charged) as
# they are taken: the work is in the taking.
_LAZY_FILTERS = frozenset({"batch", "items", "map", "reject", "rejectattr", "reverse", "select", "selectattr",
                           "slice", "unique"})
# Every other filter is slow (sort, dictsort, groupby, min, max, sum, pprint,
# wordwrap, urlize, title, xmlattr, ..., and any filter added later), and so
# are these arguments of linear ones: tojson's indent (Python's json encoder)
# and join's attribute (a Python getter for each item).
_SLOW_ARGUMENTS = {"tojson": ("indent", 2), "join": ("attribute", 2)}
# Slow filters whose Python work is per item (a key, a comparison, a line of
# JSON), their strings' characters being handled in C: their input is counted in
# items (a string's characters, when the string itself is the input). The other
# slow filters (wordwrap, urlize, pprint, ...) work through characters; so is
# sum measured, whose sum of lists copies the total so far at each item.
_ITEMWISE_FILTERS = frozenset({"sort", "dictsort", "groupby", "min", "max", "tojson", "join", "xmlattr"})
# Str methods that run in Python over their text: the sandbox's formatter,
# Markup's unescape and striptags.
_SLOW_STR_METHODS = frozenset({"format", "format_map", "unescape", "striptags"})
# transformers' strftime_now(format), in bytes per character of the format:
# %c writes 24 characters for 2, each up to 4 bytes in the result and 8 in
# time.strftime's buffer (a wchar_t, doubled until the text fits).
_STRFTIME_BYTES = 12 * (4 + 8)
# The codecs encode and decode may use: C and linear (punycode, for one, is quadratic).
_LINEAR_CODECS = frozenset({"utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le",
                            "utf-32-be", "ascii", "iso8859-1"})
# Filters whose result is text built from their whole argument.
_STRINGIFYING_FILTERS = frozenset({"join", "tojson", "string", "format", "pprint", "xmlattr", "urlize", "escape",
                                   "e", "forceescape", "safe", "list", "wordwrap", "title", "capitalize", "upper",
                                   "lower", "trim", "striptags", "truncate", "urlencode", "filesizeformat"})
# What str.split() and str.splitlines() split at (they make one string a piece).
_SPACES = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
# A str of one character, with its header (sys.getsizeof('\U0001f600') is 80)
# and its slot in a list; characters past latin-1 are new objects each.
_CHAR_BYTES = 88


class ChatTemplateRenderError(ValueError):
    """A render went past one of its bounds."""


class ChatTemplateNotBounded(RuntimeError):
    """transformers rendered without the bounded environment (see _install_render_hook)."""


def _allocated(value) -> int:
    """The memory `value` takes: its size, rounded up to the allocator's 16
    bytes (a 2-character str, 51 bytes, takes 64)."""
    return (sys.getsizeof(value) + 15) & ~15


class _RenderBudget:
    """One render's bounds, kept by the thread that renders."""

    def __init__(self) -> None:
        self.deadline = time.thread_time() + RENDER_CPU_SECONDS
        now = time.monotonic()
        self.wall_deadline = now + RENDER_WALL_SECONDS
        self.next_cpu_reading = now
        self.work = 0
        # ids of the objects the render was given (the conversation, tools, ...):
        # never charged, as the template did not build them; alive, and so
        # their ids unique, for as long as the render runs.
        self.inputs: set[int] = set()
        self.used = False  # set by the bounded environment: the render really went through it

    def step(self) -> None:
        now = time.monotonic()
        over = now > self.wall_deadline
        if now >= self.next_cpu_reading:
            self.next_cpu_reading = now + _CPU_CLOCK_EVERY_S
            over = over or time.thread_time() > self.deadline
        if over:
            raise ChatTemplateRenderError(f"chat template render exceeded its time limit ({RENDER_CPU_SECONDS:g} s "
                                          f"of CPU, {RENDER_WALL_SECONDS:g} s in all)")

    def charge(self, amount: int) -> None:
        self.work += amount
        if self.work > MAX_RENDER_WORK:
            raise ChatTemplateRenderError(
                f"chat template render exceeded its memory limit (it built more than {MAX_RENDER_WORK} bytes)")

    def remaining(self) -> int:
        return MAX_RENDER_WORK - self.work

    def charge_built(self, value, operands=()) -> None:
        """Charges the bytes `value` holds that the operation which returned
        it built: itself and what it holds, each object once, leaving out the
        render's inputs and the operands with what they hold (a slice or a
        sorted copy shares its items; `split` and a string's list of
        characters make new ones). Identity, not equality: an equal copy is
        built all the same."""
        if value is None or value is True or value is False or id(value) in self.inputs:
            return
        for operand in operands:
            if value is operand:
                return
        total = _allocated(value)
        children = _children(value)
        if children:
            shared = {id(operand) for operand in operands}
            for operand in operands:
                if not isinstance(operand, str):
                    shared.update(map(id, _children(operand)))
            # Depth first, a stack of iterators: the walk holds no copy of a container.
            stack, seen, walked, limit = [iter(children)], set(), 0, self.remaining()
            while stack and total <= limit:
                item = next(stack[-1], _END)
                if item is _END:
                    stack.pop()
                    continue
                walked += 1
                if walked % _WALK_CLOCK_EVERY == 0:
                    self.step()
                key = id(item)
                if key in seen or key in shared or key in self.inputs:
                    continue
                seen.add(key)
                total += _allocated(item)
                if not isinstance(item, str) and (inner := _children(item)):
                    stack.append(iter(inner))
        self.charge(total)


_local = threading.local()


def _active() -> _RenderBudget | None:
    return getattr(_local, "budget", None)


def _walked(count: int) -> None:
    """A walk over a value has taken `count` items: every so many, the clock."""
    if count % _WALK_CLOCK_EVERY == 0 and (budget := _active()) is not None:
        budget.step()


class _Namespace:
    """jinja2.utils.Namespace once a bounded environment is made (jinja2 is
    imported only then); until then, nothing is one."""


_END = object()
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def _children(item):
    """The values a container holds, an iterable (falsy if there are none); a
    Namespace's are its attributes, a dict's its keys and values."""
    if isinstance(item, dict):
        return item and itertools.chain(item.keys(), item.values())
    if isinstance(item, (list, tuple, set, frozenset)):
        return item
    if isinstance(item, _Namespace):
        return (item._Namespace__attrs,)
    return ()


def _register_inputs(budget: _RenderBudget, values) -> None:
    """Records the render's inputs, all the way down."""
    stack, inputs, walked = [iter(values)], budget.inputs, 0
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        if id(item) not in inputs:
            inputs.add(id(item))
            if not isinstance(item, str) and (inner := _children(item)):
                stack.append(iter(inner))
        walked += 1
        if walked % _WALK_CLOCK_EVERY == 0:
            budget.step()


def _width(*values) -> int:
    """Bytes a character of text built from `values` may take: 1 if every
    string among them is ASCII (str.isascii is O(1)), else up to 4."""
    for value in values:
        if isinstance(value, str) and not value.isascii():
            return 4
    return 1


def _text_measure(value, limit: int, plain_depth: int = 0, json_indent: int | None = None) -> tuple[int, bool]:
    """About the length of str(value) (of json.dumps(value, indent=json_indent)
    if given), counted without building it, and whether it has characters past
    ASCII; stops once past `limit` (so it costs at most ~limit steps). Strings
    deeper than `plain_depth` are shown by repr (or as JSON): a character may
    take 10 (or 6)."""
    # Depth first, a stack of (iterator, depth): the walk holds no copy of a container.
    stack, chars, wide, walked = [(iter((value,)), 0)], 0, False, 0
    while stack and chars <= limit:
        item = next(stack[-1][0], _END)
        if item is _END:
            stack.pop()
            continue
        depth = stack[-1][1]
        if isinstance(item, str) and depth <= plain_depth and json_indent is None:
            chars += len(item)
            wide = wide or not item.isascii()
        elif isinstance(item, (str, bytes)):
            wide = wide or (isinstance(item, str) and not item.isascii())
            if isinstance(item, bytes) or not item.isprintable():
                chars += len(item) * (10 if json_indent is None else 6) + 3
            else:
                chars += len(item) + 2
        elif isinstance(item, (dict, list, tuple, set, frozenset, _Namespace, *_DICT_VIEWS)):
            # The separators, and under indent a line of its own for each item.
            line = 0 if json_indent is None else 1 + json_indent * (depth + 1)
            if not isinstance(item, _Namespace):  # a Namespace's attributes are a dict below it
                chars += 16 + (4 if isinstance(item, dict) else 2 + line) * len(item)
            if isinstance(item, _DICT_VIEWS):  # str() shows what they see: an items view's pairs
                inner = itertools.chain.from_iterable(item) if isinstance(item, _DICT_VIEWS[2]) else item
            else:
                inner = _children(item)
            if chars <= limit and inner:
                stack.append((iter(inner), depth + 1))
        elif isinstance(item, int) and not isinstance(item, bool):
            chars += item.bit_length() // 3 + 2  # bounded by MAX_INT_BITS
        else:
            chars += 128  # floats, None, small objects' reprs
        walked += 1
        _walked(walked)
    return chars, wide


def _text_bytes(value, limit: int, plain_depth: int = 0, json_indent: int | None = None) -> int:
    """The bytes of the text _text_measure measures."""
    chars, wide = _text_measure(value, limit, plain_depth, json_indent)
    return chars * (4 if wide else 1)


def _check_ints(values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDERED_CHARS:
            raise ChatTemplateRenderError(f"chat template render exceeded its limits (an argument of {value})")


# A number of 8 digits or more in a format string: a width past MAX_RENDERED_CHARS.
_FORMAT_NUMBER = re.compile(r"\d{8,}")


# A conversion that shows a value by repr (%r, %a, {!r}, {!a}): a character of
# a string may take 10.
_REPR_CONVERSION = re.compile(r"%(?:\([^)]*\))?[-#0 +*\d.]*[ra]|![ra]")
# plain_depth for _text_measure that counts every string as it is.
_ALL_PLAIN = 1 << 30


def _shows_repr(fmt) -> bool:
    return bool(_REPR_CONVERSION.search(fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt))


def _check_format_text(fmt) -> None:
    """A width or precision in a format string is a size; `*` takes it from
    the arguments, which _check_ints sees."""
    if isinstance(fmt, bytes):
        fmt = fmt.decode("latin-1")
    if isinstance(fmt, str) and _FORMAT_NUMBER.search(fmt):
        raise ChatTemplateRenderError("chat template render exceeded its limits (a format width)")


def _check_step(what: str, units: int, unit: str = "characters") -> None:
    """One step of a slow filter or method, refused past MAX_SLOW_STEP_UNITS."""
    if units > MAX_SLOW_STEP_UNITS:
        raise ChatTemplateRenderError(f"chat template render exceeded its time limit ({what} on more than "
                                      f"{MAX_SLOW_STEP_UNITS} {unit} at once)")


def _sized(value):
    """`value` as something whose size is known before it is used: an iterator
    (a lazy filter's) is taken into a list first, its items charged as they come."""
    return value if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else list(value)


def _chars_bytes(value) -> int:
    """A list of the characters (or items) of `value`."""
    if isinstance(value, str):
        return len(value) * (8 if value.isascii() else _CHAR_BYTES)
    return 8 * len(value) if isinstance(value, (bytes, list, tuple, dict, set, frozenset)) else 0


def _predicted_binop(operator: str, left, right) -> int:
    """An upper bound of the bytes of `left <operator> right`, before it is built."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                item = 8 if isinstance(seq, (list, tuple)) else _width(seq)
                return len(seq) * max(times, 0) * item
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 8
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return right * max(left.bit_length(), 1) // 8
    elif operator == "+" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
        item = 8 if isinstance(left, (list, tuple)) else _width(left, right)
        return (len(left) + len(right)) * item
    elif operator == "%" and isinstance(left, (str, bytes)):
        _check_format_text(left)
        _check_ints(right if isinstance(right, tuple) else (right,))
        return _joined_bytes(left, 1, right, plain_depth=-1 if _shows_repr(left) else 1)
    return 0


def _pieces(text, sep, maxsplit) -> int:
    """How many pieces text.split(sep, maxsplit) makes, at most (counted in C)."""
    if sep is None:
        spaces = _SPACES if isinstance(text, str) else b" \t\n\r\x0b\x0c"
        if isinstance(text, str) and text.isascii():
            spaces = spaces[:10]  # the ASCII ones come first
        hits = sum(text.count(spaces[i:i + 1]) for i in range(len(spaces)))
    else:
        hits = text.count(sep) if isinstance(sep, type(text)) and sep else 0
    if isinstance(maxsplit, int) and maxsplit >= 0:
        hits = min(hits, maxsplit)
    return hits + 1


def _joined_bytes(text, times: int, values, plain_depth: int) -> int:
    """The bytes of `text` written `times` times with the text of `values`: one
    string, as wide as its widest character."""
    chars, wide = _text_measure(values, MAX_RENDER_WORK, plain_depth)
    chars += len(text) * times
    return chars * (4 if wide or not (isinstance(text, bytes) or text.isascii()) else 1)


# Case mappings: a character may become 3 ('\ufb03'.upper() is 'FFI'), and wider.
_CASE_MAPPINGS = frozenset({"upper", "lower", "title", "capitalize", "swapcase", "casefold"})
# The methods _predicted_str_method predicts; the others build at most about
# what they read (strip, partition, hex, ...).
_PREDICTED_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs", "replace", "join", "format",
                                "format_map", "split", "rsplit", "splitlines", "translate", "encode", "decode",
                                *_CASE_MAPPINGS})


def _predicted_str_method(name: str, text, args: tuple, kwargs: dict) -> int:
    """An upper bound of the bytes of `text.<name>(...)` (text a str or bytes)
    for the methods that can build much more than they are given."""
    if name not in _PREDICTED_METHODS:
        return 0
    if name in _CASE_MAPPINGS:
        return len(text) * (1 if isinstance(text, bytes) or text.isascii() else 12)
    width = _width(text, *args, *kwargs.values())
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        return max(len(text), args[0]) * width
    if name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return (len(text) + text.count("\t" if isinstance(text, str) else b"\t")
                * (size if isinstance(size, int) else 0)) * width
    if name == "replace" and len(args) >= 2 and isinstance(args[0], type(text)) and isinstance(args[1], type(text)):
        hits = text.count(args[0]) if args[0] else len(text) + 1
        return (len(text) + hits * max(len(args[1]) - len(args[0]), 0)) * width
    if name == "join" and args:
        # The separator goes between every two items.
        return _joined_bytes(text, max(len(args[0]) - 1, 0), args[0], plain_depth=1)
    if name in ("format", "format_map"):
        _check_format_text(text)
        return _joined_bytes(text, 1, (*args, *kwargs.values()), plain_depth=-1 if _shows_repr(text) else 1)
    if name in ("split", "rsplit", "splitlines"):
        if name == "splitlines":
            pieces = sum(text.count(c) for c in _LINE_BREAKS) + 1 if isinstance(text, str) else text.count(b"\n") + \
                text.count(b"\r") + 1
        else:
            sep = args[0] if args else kwargs.get("sep")
            pieces = _pieces(text, sep, args[1] if len(args) > 1 else kwargs.get("maxsplit", -1))
        # A piece is a new object with its header (~50-80 bytes) and its slot.
        return pieces * _CHAR_BYTES + len(text) * width
    if name == "translate" and args:
        table = args[0]
        values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
        longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
        return len(text) * max(longest, 1) * 4
    if name in ("encode", "decode"):
        codec = args[0] if args else kwargs.get("encoding", "utf-8")
        try:
            canonical = codecs.lookup(codec).name if isinstance(codec, str) else None
        except LookupError:
            canonical = None  # the method's own error says so
        if isinstance(codec, str) and canonical is not None and canonical not in _LINEAR_CODECS:
            raise ChatTemplateRenderError(f"chat template render exceeded its limits (codec {codec!r}; "
                                          f"only the UTF, ASCII and Latin-1 codecs are allowed)")
        return len(text) * 4 + 4  # a BOM
    return 0


def _predicted_filter(name: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of the bytes of a filter's result, before it is built."""
    value = args[0] if args else None
    if name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return (len(value) + (value.count("\n") + 1) * width) * _width(value, *args[1:2])
    if name == "center" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 80)
        return max(len(value), width if isinstance(width, int) else 0) * _width(value)
    if name == "replace" and isinstance(value, str) and len(args) >= 3:
        return _predicted_str_method("replace", value, args[1:3], {})
    if name == "join" and value is not None:
        separator = args[1] if len(args) > 1 else kwargs.get("d", "")
        return _predicted_str_method("join", separator if isinstance(separator, str) else "", (value,), {})
    if name == "tojson":
        indent = kwargs.get("indent") or (args[2] if len(args) > 2 else None) or 0
        indent = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        return _text_bytes(value, MAX_RENDER_WORK, json_indent=indent)
    if name in ("list", "sort"):
        return _chars_bytes(value)
    if name in _CASE_MAPPINGS:
        chars, wide = _text_measure((*args, *kwargs.values()), MAX_RENDER_WORK, plain_depth=1)
        return chars * (12 if wide else 1)
    if name in _STRINGIFYING_FILTERS:
        return _text_bytes((*args, *kwargs.values()), MAX_RENDER_WORK, plain_depth=1)
    return 0


def _check_predicted(budget: _RenderBudget, predicted: int) -> None:
    if predicted > MAX_VALUE_BYTES or predicted > budget.remaining():
        raise ChatTemplateRenderError(
            f"chat template render exceeded its memory limit (one value of ~{predicted} bytes)")


def _count_items(values, limit: int) -> int:
    """How many values a walk over `values` meets (a string among them counts
    its characters, which a filter iterates); stops once past `limit`."""
    stack, count, walked = [iter(values)], 0, 0
    while stack and count <= limit:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        count += len(item) if isinstance(item, (str, bytes)) and len(stack) == 1 else 1
        if not isinstance(item, (str, bytes)) and (inner := _children(item)):
            stack.append(iter(inner))
        walked += 1
        _walked(walked)
    return count


def _check_filter_step(name: str, args: tuple, kwargs: dict) -> None:
    """Refuses one step of filter `name`, if it is slow, past MAX_SLOW_STEP_UNITS of input."""
    if name in _LAZY_FILTERS:
        return
    if name in _LINEAR_FILTERS:
        keyword, position = _SLOW_ARGUMENTS.get(name, (None, 0))
        if keyword is None or (kwargs.get(keyword) is None and (len(args) <= position or args[position] is None)):
            return
    if name == "indent" and args and isinstance(args[0], str):
        # A Python step for each line; the rest is C.
        _check_step(f"filter {name!r}", args[0].count("\n"), "lines")
    elif name in _ITEMWISE_FILTERS:
        _check_step(f"filter {name!r}", _count_items((*args, *kwargs.values()), MAX_SLOW_STEP_UNITS), "items")
    else:
        # Characters as they are (plain at any depth): the work is reading them.
        units, _ = _text_measure((*args, *kwargs.values()), MAX_SLOW_STEP_UNITS, plain_depth=_ALL_PLAIN)
        _check_step(f"filter {name!r}", units)


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
        passed = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0
        if name == "join" and len(args) > passed:
            args = (*args[:passed], _sized(args[passed]), *args[passed + 1:])
        plain = args[passed:]
        _check_ints(plain[1:])
        _check_ints(kwargs.values())
        _check_filter_step(name, plain, kwargs)
        _check_predicted(budget, _predicted_filter(name, plain, kwargs))
        result = function(*args, **kwargs)
        if name in _LAZY_FILTERS and not isinstance(result, (str, bytes, list, tuple, dict)):
            return _charged_items(result, (*plain, *kwargs.values()))
        budget.charge_built(result, (*plain, *kwargs.values()))
        return result

    return bounded


def _charged_items(iterable, operands: tuple):
    """A lazy filter's items, each one a step of the render and charged for
    what it built (batch's lists, items' pairs, a string's characters)."""
    budget = _active()
    for item in iterable:
        budget.step()
        budget.charge_built(item, operands)
        yield item


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
        _check_predicted(budget, _text_bytes(list(values), MAX_RENDER_WORK, plain_depth=1))
    result = "".join(str(v) for v in values)
    if budget is not None:
        budget.charge(_allocated(result))
    return result


def _sliced(value, start, stop, step):
    """`value[start:stop:step]`, a copy of (part of) its operand."""
    budget = _active()
    if budget is not None:
        budget.step()
    result = value[start:stop:step]
    if budget is not None:
        budget.charge_built(result, (value,))
    return result


def _literal(context, value):
    """A list, tuple or dict written in the template: its own slots (its items
    are values built, and charged, where they were made). Takes the context
    only so that Jinja does not fold a constant one at compile time: each
    evaluation builds one."""
    budget = _active()
    if budget is not None:
        budget.step()
        budget.charge(_allocated(value))
    return value


def _make_bounded_environment(prototype):
    """An ImmutableSandboxedEnvironment like transformers' `prototype` (its
    extensions, filters and globals), with every way of building a large value
    charged to the active budget."""
    from jinja2 import nodes, pass_context, utils
    from jinja2.environment import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    global _Namespace
    _Namespace = utils.Namespace

    class _Bounding(NodeTransformer):
        """Loops step the budget; `~` measures before it joins; slices and
        literals, which Jinja compiles to plain Python, are charged."""

        def __init__(self, environment):
            self.environment = environment

        def _filter(self, node, name: str, lineno: int, args=()):
            return nodes.Filter(node, name, list(args), [], None, None, lineno=lineno).set_environment(
                self.environment)

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = self._filter(node.iter, "_raylm_steps", node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            items = nodes.List(node.nodes, lineno=node.lineno).set_environment(self.environment)
            return self._filter(items, "_raylm_concat", node.lineno)

        def visit_Getitem(self, node):
            self.generic_visit(node)
            if not isinstance(node.arg, nodes.Slice) or node.ctx != "load":
                return node
            bounds = [part if part is not None else nodes.Const(None, lineno=node.lineno)
                      for part in (node.arg.start, node.arg.stop, node.arg.step)]
            return self._filter(node.node, "_raylm_slice", node.lineno, bounds)

        def _visit_literal(self, node):
            self.generic_visit(node)
            if getattr(node, "ctx", "load") != "load":  # a tuple assigned to: {% for a, b in ... %}
                return node
            return self._filter(node, "_raylm_literal", node.lineno)

        visit_List = visit_Dict = visit_Tuple = _visit_literal

    class BoundedTemplate(Template):
        def new_context(self, vars=None, shared=False, locals=None):  # jinja's own signature (shadows builtins)
            budget = _active()
            if budget is not None:
                _register_inputs(budget, (vars or {}).values())
            return super().new_context(vars, shared, locals)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})
        template_class = BoundedTemplate

        def _parse(self, source, name, filename):
            return _Bounding(self).visit(super()._parse(source, name, filename))

        def call_binop(self, context, operator, left, right):
            budget = _active()
            if budget is None:
                return super().call_binop(context, operator, left, right)
            budget.step()
            _check_predicted(budget, _predicted_binop(operator, left, right))
            result = super().call_binop(context, operator, left, right)
            if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
                raise ChatTemplateRenderError(f"chat template render exceeded its limits (an integer of "
                                              f"{result.bit_length()} bits)")
            budget.charge_built(result, (left, right))
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # jinja's own signature (no `self`)
            budget = _active()
            if budget is None:
                return super().call(__context, __obj, *args, **kwargs)
            budget.step()
            _check_ints(args)
            _check_ints(kwargs.values())
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "")
            if isinstance(owner, (str, bytes)):
                if name == "join" and args:
                    args = (_sized(args[0]), *args[1:])
                if name in _SLOW_STR_METHODS:
                    _check_step(f"str.{name}", len(owner))
                _check_predicted(budget, _predicted_str_method(name, owner, args, kwargs))
            elif name == "strftime_now" and args and isinstance(args[0], str):
                _check_predicted(budget, len(args[0]) * _STRFTIME_BYTES)
            result = super().call(__context, __obj, *args, **kwargs)
            budget.charge_built(result, (owner, *args, *kwargs.values()))
            return result

        def wrap_str_format(self, value):
            """str.format and format_map, which the sandbox hands out wrapped:
            their width fields are sizes, and the formatter is Python."""
            wrapper = super().wrap_str_format(value)
            if wrapper is None:
                return None
            text = value.__self__

            def bounded(*args, **kwargs):
                budget = _active()
                if budget is not None:
                    _check_step(f"str.{value.__name__}", len(text))
                    _check_predicted(budget, _predicted_str_method("format", text, args, kwargs))
                return wrapper(*args, **kwargs)

            return bounded

        def concat(self, pieces) -> str:
            """The render's output, and every block's ({% set %}...{% endset %},
            macro bodies): each piece charged as it is made, and the text they
            make before it is joined."""
            budget = _active()
            if budget is None:
                return "".join(pieces)
            budget.used = True
            collected, chars, wide = [], 0, False
            for piece in pieces:
                budget.step()
                if id(piece) not in budget.inputs:  # a message's text printed as it is was not built
                    budget.charge(_allocated(piece))
                collected.append(piece)
                chars += len(piece)
                wide = wide or not piece.isascii()
            _check_predicted(budget, chars * (4 if wide else 1))
            text = "".join(collected)
            budget.charge(_allocated(text))
            return text

    def finalize(value):
        """What `{{ ... }}` prints, measured before it becomes text."""
        budget = _active()
        if budget is not None and not isinstance(value, str):
            _check_predicted(budget, _text_bytes(value, MAX_RENDER_WORK))
        return value

    env = BoundedEnvironment(
        trim_blocks=prototype.trim_blocks, lstrip_blocks=prototype.lstrip_blocks, finalize=finalize,
        extensions=[type(extension) for extension in prototype.extensions.values()])
    env.filters.update({name: _bounded_filter(name, f) for name, f in prototype.filters.items()})
    env.filters["_raylm_steps"] = _steps
    env.filters["_raylm_concat"] = _concat
    env.filters["_raylm_slice"] = _sliced
    env.filters["_raylm_literal"] = pass_context(_literal)
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
