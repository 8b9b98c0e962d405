"""A chat-template render's bounds: its limits (time, bytes built, output),
the budget one render keeps against them (`_RenderBudget`, held by the thread
that renders), the error past them, and the walks over a render's values
that the budget charges.

Apart from how a render is bounded (raylm.chat_template_sandbox: the Jinja
environment that steps and charges the budget; raylm.chat_template_prediction:
the sizes of operations before they run) so that what is counted, and how
much is allowed, reads in one place. The names with an underscore are shared
by the chat_template modules only; nothing outside them uses them.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

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


class ChatTemplateRenderError(ValueError):
    """A render went past one of its bounds."""


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
            raise ChatTemplateRenderError(
                f"chat template render exceeded its time limit ({RENDER_CPU_SECONDS:g} s "
                f"of CPU, {RENDER_WALL_SECONDS:g} s in all)"
            )

    def charge(self, amount: int) -> None:
        self.work += amount
        if self.work > MAX_RENDER_WORK:
            raise ChatTemplateRenderError(
                f"chat template render exceeded its memory limit (it built more than {MAX_RENDER_WORK} bytes)"
            )

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
    imported only then); until then, nothing is one. Read as
    `chat_template_budget._Namespace` by the other chat_template modules, so
    that they see the rebinding."""


def _bind_namespace(namespace_class: type) -> None:
    """jinja2's Namespace, once imported (see _Namespace)."""
    global _Namespace
    _Namespace = namespace_class


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
