"""The Jinja environment a chat template renders in: jinja2's immutable
sandbox, with every loop, call, filter, operator, slice, literal and piece of
output a step of the active render budget, and every way of building a large
value measured before (raylm.chat_template_prediction) and charged after
(raylm.chat_template_budget).

Apart from those two because this is the part that knows Jinja: its
compiled-template hooks (a NodeTransformer over the parsed template, the
environment's call/binop/concat overrides, the filters' wrappers), which
change with jinja2, where the budget and the measures do not. jinja2 is
imported only when an environment is made.
"""

from __future__ import annotations

from raylm.chat_template_budget import (
    MAX_INT_BITS,
    MAX_RENDER_WORK,
    ChatTemplateRenderError,
    _active,
    _allocated,
    _bind_namespace,
    _register_inputs,
)
from raylm.chat_template_prediction import (
    _LAZY_FILTERS,
    _SLOW_STR_METHODS,
    _STRFTIME_BYTES,
    _check_filter_step,
    _check_ints,
    _check_predicted,
    _check_step,
    _predicted_binop,
    _predicted_filter,
    _predicted_str_method,
    _sized,
    _text_bytes,
)


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
            args = (*args[:passed], _sized(args[passed]), *args[passed + 1 :])
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

    _bind_namespace(utils.Namespace)

    class _Bounding(NodeTransformer):
        """Loops step the budget; `~` measures before it joins; slices and
        literals, which Jinja compiles to plain Python, are charged."""

        def __init__(self, environment):
            self.environment = environment

        def _filter(self, node, name: str, lineno: int, args=()):
            return nodes.Filter(node, name, list(args), [], None, None, lineno=lineno).set_environment(self.environment)

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
            bounds = [
                part if part is not None else nodes.Const(None, lineno=node.lineno)
                for part in (node.arg.start, node.arg.stop, node.arg.step)
            ]
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
                raise ChatTemplateRenderError(
                    f"chat template render exceeded its limits (an integer of {result.bit_length()} bits)"
                )
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
        trim_blocks=prototype.trim_blocks,
        lstrip_blocks=prototype.lstrip_blocks,
        finalize=finalize,
        extensions=[type(extension) for extension in prototype.extensions.values()],
    )
    env.filters.update({name: _bounded_filter(name, f) for name, f in prototype.filters.items()})
    env.filters["_raylm_steps"] = _steps
    env.filters["_raylm_concat"] = _concat
    env.filters["_raylm_slice"] = _sliced
    env.filters["_raylm_literal"] = pass_context(_literal)
    env.globals.update(prototype.globals)
    env.globals.pop("lipsum", None)  # lipsum(n=...) writes n paragraphs; no chat template needs it
    return env
