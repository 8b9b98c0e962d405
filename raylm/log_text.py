"""Client-supplied text, made safe to log: `loggable(value)`.

A request id, a path or an exception message that quotes a prompt is
written by the client. Logged as it is, a newline in it starts what looks
like a log line of the server's own (a forged "engine core 1 died"), and an
ANSI escape or a bidi override rewrites what a terminal shows. `loggable`
gives one line of printable text: every character that is not printable
(controls, line and paragraph separators, format characters such as bidi
overrides) is written as its Python escape, as is the backslash itself, so
that an escape in the log is always the server's; and it is cut to a bounded
length, so that a 16 MiB prompt in an exception message does not flood the
log either.

A plain value module (no raylm imports): the engine and the server both use it.
"""

from __future__ import annotations

import traceback

# Enough for a request id, a path or the start of a message to be recognised.
LOG_TEXT_LIMIT = 200


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char.isprintable():  # str.isprintable: False for Cc, Cf, Zl, Zp, Zs but " ", and unassigned
        return char
    # "\n", "\x1b", "\u202e": what Python's repr would write
    return char.encode("unicode_escape").decode("ascii")


def loggable(value: object, limit: int = LOG_TEXT_LIMIT) -> str:
    """`value` (str() of it) as one printable line of at most about `limit`
    characters; what was cut is counted at the end."""
    text = value if isinstance(value, str) else str(value)
    out: list[str] = []
    length = 0
    for used, char in enumerate(text):
        piece = _escape(char)
        if length + len(piece) > limit:
            return "".join(out) + f"...[{len(text) - used} more chars]"
        out.append(piece)
        length += len(piece)
    return "".join(out)


def traceback_frames(error: BaseException) -> str:
    """Where `error` was raised, as traceback lines without its message
    (which may quote a client: log that through `loggable`). The frames name
    the server's files and source lines only."""
    return "".join(traceback.format_tb(error.__traceback__)).rstrip("\n")
