"""What an operation of a chat template will cost, measured before it runs:
the bytes a value's text takes (`_text_measure`), the bytes an operator, a
str method or a filter may build (`_predicted_*`), the input a slow filter's
step gets (`_check_filter_step`), and the arguments (sizes, format widths,
codecs) refused outright.

Apart from the budget (raylm.chat_template_budget), which charges what was
built, and from the environment that calls these (raylm.chat_template_sandbox):
this is the model of Python's and Jinja's operations, the part that changes
when a filter or a method is added. Each walk here stops once past its limit
and reads the clock as it goes, so a measure costs at most about what it
allows.
"""

from __future__ import annotations

import codecs
import itertools
import re

from raylm import chat_template_budget
from raylm.chat_template_budget import (
    _DICT_VIEWS,
    _END,
    MAX_RENDER_WORK,
    MAX_RENDERED_CHARS,
    MAX_SLOW_STEP_UNITS,
    MAX_VALUE_BYTES,
    ChatTemplateRenderError,
    _children,
    _RenderBudget,
    _walked,
)

# Filters that run in C in time linear in what they read and build (or in
# constant time), whatever their input: bounded by the memory limit alone.
_LINEAR_FILTERS = frozenset(
    {
        "abs",
        "attr",
        "capitalize",
        "center",
        "count",
        "d",
        "default",
        "e",
        "escape",
        "filesizeformat",
        "first",
        "float",
        "forceescape",
        "format",
        "int",
        "join",
        "last",
        "length",
        "list",
        "lower",
        "random",
        "replace",
        "round",
        "safe",
        "string",
        "tojson",
        "trim",
        "truncate",
        "upper",
    }
)
# Filters that return an iterator, whose items are each a step (and charged) as
# they are taken: the work is in the taking.
_LAZY_FILTERS = frozenset(
    {"batch", "items", "map", "reject", "rejectattr", "reverse", "select", "selectattr", "slice", "unique"}
)
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
_LINEAR_CODECS = frozenset(
    {"utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be", "ascii", "iso8859-1"}
)
# Filters whose result is text built from their whole argument.
_STRINGIFYING_FILTERS = frozenset(
    {
        "join",
        "tojson",
        "string",
        "format",
        "pprint",
        "xmlattr",
        "urlize",
        "escape",
        "e",
        "forceescape",
        "safe",
        "list",
        "wordwrap",
        "title",
        "capitalize",
        "upper",
        "lower",
        "trim",
        "striptags",
        "truncate",
        "urlencode",
        "filesizeformat",
    }
)
# What str.split() and str.splitlines() split at (they make one string a piece).
_SPACES = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
# A str of one character, with its header (sys.getsizeof('\U0001f600') is 80)
# and its slot in a list; characters past latin-1 are new objects each.
_CHAR_BYTES = 88


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
        elif isinstance(item, (dict, list, tuple, set, frozenset, chat_template_budget._Namespace, *_DICT_VIEWS)):
            # The separators, and under indent a line of its own for each item.
            line = 0 if json_indent is None else 1 + json_indent * (depth + 1)
            if not isinstance(item, chat_template_budget._Namespace):  # a Namespace's attributes are a dict below it
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
        raise ChatTemplateRenderError(
            f"chat template render exceeded its time limit ({what} on more than {MAX_SLOW_STEP_UNITS} {unit} at once)"
        )


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
        hits = sum(text.count(spaces[i : i + 1]) for i in range(len(spaces)))
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
_PREDICTED_METHODS = frozenset(
    {
        "ljust",
        "rjust",
        "center",
        "zfill",
        "expandtabs",
        "replace",
        "join",
        "format",
        "format_map",
        "split",
        "rsplit",
        "splitlines",
        "translate",
        "encode",
        "decode",
        *_CASE_MAPPINGS,
    }
)


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
        return (
            len(text) + text.count("\t" if isinstance(text, str) else b"\t") * (size if isinstance(size, int) else 0)
        ) * width
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
            pieces = (
                sum(text.count(c) for c in _LINE_BREAKS) + 1
                if isinstance(text, str)
                else text.count(b"\n") + text.count(b"\r") + 1
            )
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
            raise ChatTemplateRenderError(
                f"chat template render exceeded its limits (codec {codec!r}; "
                f"only the UTF, ASCII and Latin-1 codecs are allowed)"
            )
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
            f"chat template render exceeded its memory limit (one value of ~{predicted} bytes)"
        )


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
