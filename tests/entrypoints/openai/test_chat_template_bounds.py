"""render_bounded (issue 20): chat templates render as transformers renders
them, and a template that would build too much or run too long stops with
ChatTemplateRenderError instead. In-process, on the tiny model's tokenizer;
the server-side tests are in test_intake_bounds.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from raylm import chat_template_budget
from raylm.chat_template import ChatTemplateNotBounded, render_bounded
from raylm.chat_template_budget import MAX_RENDER_WORK, ChatTemplateRenderError
from tests.entrypoints.openai.test_intake_bounds import HOSTILE_TEMPLATES

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "<think>hm</think>\nHi!"},
    {"role": "user", "content": "Bye"},
]
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
        messages=CONVERSATION, add_generation_prompt=True, tools=None, documents=None, **tokenizer.special_tokens_map
    )
    assert render_bounded(tokenizer, CONVERSATION, chat_template=template, add_generation_prompt=True) == expected


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_long_conversation_renders_as_transformers_does(tokenizer, name):
    """Messages of ~2M characters, with newlines and text past ASCII, are far
    inside the bounds: what a template builds is charged as it is, not as its
    worst case."""
    conversation = [
        {"role": "system", "content": "Be brief.\n" * 1000},
        {"role": "user", "content": "a line of text\n" * 130_000},
        {"role": "assistant", "content": "<think>hm\n</think>\n" + "\u00e9\u4e2d\U0001f600 ok\n" * 100_000},
        {"role": "user", "content": "Bye"},
    ]
    template = TEMPLATES[name]
    expected = chat_template_utils._cached_compile_jinja_template(template).render(
        messages=conversation, add_generation_prompt=True, tools=None, documents=None, **tokenizer.special_tokens_map
    )
    assert render_bounded(tokenizer, conversation, chat_template=template, add_generation_prompt=True) == expected


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_templates_stop(tokenizer, name):
    with pytest.raises(ChatTemplateRenderError, match="^chat template render exceeded"):
        render_bounded(tokenizer, CONVERSATION, chat_template=HOSTILE_TEMPLATES[name])


@pytest.mark.parametrize(
    "template",
    [
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
    ],
)
def test_other_ways_of_building_too_much_stop(tokenizer, template):
    with pytest.raises(ChatTemplateRenderError, match="^chat template render exceeded"):
        render_bounded(tokenizer, CONVERSATION, chat_template=template)


def test_a_render_that_bypassed_the_bounds_fails_loudly(tokenizer, monkeypatch):
    render_bounded(tokenizer, CONVERSATION, chat_template=TEMPLATES["chatml"])  # hooked by now
    monkeypatch.setattr(
        chat_template_utils, "_compile_jinja_template", chat_template_utils._cached_compile_jinja_template
    )
    with pytest.raises(ChatTemplateNotBounded):
        render_bounded(tokenizer, CONVERSATION, chat_template=TEMPLATES["chatml"])


# ---- issue 48, finding 6: time between few heavy steps, memory by bytes --------


def test_few_heavy_steps_are_timed(tokenizer, monkeypatch):
    """30 wordwraps of 240k characters each (tens of ms apiece, fewer than 64
    steps in all): the clock is read between them, and the render stops one
    step past its limit (was: read every 64 steps, so never)."""
    monkeypatch.setattr(chat_template_budget, "RENDER_CPU_SECONDS", 0.05)
    template = "{% set s = 'ab ' * 80000 %}{% for i in range(30) %}{% set w = s | wordwrap(5) %}{% endfor %}"
    started = time.thread_time()
    with pytest.raises(ChatTemplateRenderError, match="^chat template render exceeded its time limit"):
        render_bounded(tokenizer, CONVERSATION, chat_template=template)
    # The whole loop takes ~2 s here; stopping takes the limit and a step or two.
    assert time.thread_time() - started < 1.0


@pytest.mark.parametrize(
    "template",
    [
        "{{ ('ab ' * 2000000) | wordwrap(5) | length }}",  # Python's textwrap: seconds in one step
        "{{ ('ab' * 1000000) | sort | length }}",  # a Python key for each character
        "{{ ([[0]] * 30000) | sum(start=[]) | length }}",  # quadratic, in one C call
        "{{ ('\xe9a' * 200000).encode('punycode') | length }}",  # a quadratic codec
        "{{ ('{0}' * 200000).format('x') | length }}",  # the sandbox's formatter is Python
    ],
)
def test_one_heavy_step_is_refused_by_its_size(tokenizer, template):
    """A step the clock could not interrupt is refused before it runs."""
    with pytest.raises(ChatTemplateRenderError, match="^chat template render exceeded"):
        render_bounded(tokenizer, CONVERSATION, chat_template=template)


_RSS_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
from raylm.chat_template import render_bounded
from raylm.chat_template_budget import ChatTemplateRenderError

def peak_rss():
    # VmHWM: this process's peak RSS (ru_maxrss would count the forked parent's too).
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
conversation = [{"role": "user", "content": "Hello"}]
render_bounded(tokenizer, conversation, chat_template="{{ messages[0]['content'] }}")  # imports, compiles
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the RSS now
except OSError:
    pass
before = peak_rss()
try:
    render_bounded(tokenizer, conversation, chat_template=sys.argv[2])
    error = None
except ChatTemplateRenderError as e:
    error = str(e)
print(json.dumps({"error": error, "grown": peak_rss() - before}))
"""


@pytest.mark.parametrize(
    "template",
    [
        # Lists of 100k new strings each (~6 MiB apiece, once charged as 100k items).
        "{% set ns = namespace(l=[]) %}{% for i in range(100) %}{% set ns.l = ns.l + [('ab ' * 100000).split()] %}"
        "{% endfor %}",
        # Lazy items: 100k one-character lists, of characters past latin-1 (new objects each).
        "{% set ns = namespace(l=[]) %}{% for i in range(30) %}{% set ns.l = ns.l + [('\u0101' * 100000) | batch(1) "
        "| list] %}{% endfor %}",
        # A separator between every two of 5000 items: 150 MB, once built before it was charged.
        "{{ ('a' * 5000) | join('x' * 30000) | length }}",
    ],
)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc")
def test_lists_of_big_strings_stop_at_the_memory_limit(llama_dir, template):
    """A fresh process's peak RSS (the peak, which sampling would miss) grows
    by no more than the limit and a little slack."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, llama_dir, template],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and result["error"].startswith("chat template render exceeded"), result
    assert result["grown"] < MAX_RENDER_WORK + 16 * 2**20, result
