"""render_bounded (issue 20): chat templates render as transformers renders
them, and a template that would build too much or run too long stops with
ChatTemplateRenderError instead. In-process, on the tiny model's tokenizer;
the server-side tests are in test_intake_bounds.py."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from raylm.chat_template import ChatTemplateNotBounded, ChatTemplateRenderError, render_bounded
from tests.entrypoints.openai.test_intake_bounds import HOSTILE_TEMPLATES

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "<think>hm</think>\nHi!"}, {"role": "user", "content": "Bye"}]
# What real templates do: loops with loop.first/last, namespaces, string
# methods, ~ and + concatenation, filters with arguments, macros, tojson.
TEMPLATES = {
    "chatml": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "namespace": "{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
                 "{% set ns.sys = ns.sys ~ m.content %}{% endif %}{% endfor %}[{{ ns.sys }}]"
                 "{% for m in messages if m.role != 'system' %}{{ m.role | upper }}: "
                 "{{ m.content.split('</think>')[-1].lstrip('\\n') }}{% if not loop.last %} | {% endif %}{% endfor %}",
    "macro_json": "{% macro show(m) %}{{ m | tojson(indent=2) }}{% endmacro %}{% for m in messages %}"
                  "{{ show(m) | indent(4) }}{{ '%s/%d' % (m.role, loop.index) }}{{ bos_token }}{% endfor %}",
}


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("name", TEMPLATES)
def test_renders_as_transformers_does(tokenizer, name):
    template = TEMPLATES[name]
    # transformers' own environment, compiled without raylm's bounds.
    expected = chat_template_utils._cached_compile_jinja_template(template).render(
        messages=CONVERSATION, add_generation_prompt=True, tools=None, documents=None,
        **tokenizer.special_tokens_map)
    assert render_bounded(tokenizer, CONVERSATION, chat_template=template, add_generation_prompt=True) == expected


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_templates_stop(tokenizer, name):
    with pytest.raises(ChatTemplateRenderError, match="^chat template render exceeded"):
        render_bounded(tokenizer, CONVERSATION, chat_template=HOSTILE_TEMPLATES[name])


@pytest.mark.parametrize("template", [
    "{{ 'a'.ljust(1000000000) }}",
    "{{ 'a' | center(1000000000) }}",
    "{% set s = 'a' * 1000000 %}{{ s.replace('', s) }}",
    "{% set s = '\\n' * 1000000 %}{{ s | indent(1000) }}",
    "{{ '%1000000000s' % 'a' }}",
    "{{ '{:>1000000000}'.format('a') }}",
    "{% set s = 'a' * 1000000 %}{{ [s] * 100000 }}",
    "{% set s = 'a' * 1000000 %}{{ ([s] * 100000) | tojson }}",
    "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
])
def test_other_ways_of_building_too_much_stop(tokenizer, template):
    with pytest.raises(ChatTemplateRenderError, match="^chat template render exceeded"):
        render_bounded(tokenizer, CONVERSATION, chat_template=template)


def test_a_render_that_bypassed_the_bounds_fails_loudly(tokenizer, monkeypatch):
    render_bounded(tokenizer, CONVERSATION, chat_template=TEMPLATES["chatml"])  # hooked by now
    monkeypatch.setattr(chat_template_utils, "_compile_jinja_template",
                        chat_template_utils._cached_compile_jinja_template)
    with pytest.raises(ChatTemplateNotBounded):
        render_bounded(tokenizer, CONVERSATION, chat_template=TEMPLATES["chatml"])
