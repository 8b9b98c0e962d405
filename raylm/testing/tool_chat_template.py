"""A chat template that renders tools the Hermes / Qwen2.5 way, for the tiny
test models: the tools listed in the system turn inside <tools></tools>, an
assistant's calls as <tool_call> JSON, tool results as <tool_response>.
`install_tool_chat_template` copies a model folder and gives it this template."""

from __future__ import annotations

import json
import pathlib
import shutil

TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{ '<|system|>\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    '{{ \'\n</tools>\nCall a function with <tool_call>{"name": ..., "arguments": ...}</tool_call><|end|>\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|system|>\n' + messages[0]['content'] + '<|end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'assistant' and not message.get('tool_calls')) %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|user|>\n<tool_response>\n' + message['content'] + '\n</tool_response><|end|>\n' }}"
    "{%- elif message['role'] != 'system' %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{%- endif %}"
)


def install_tool_chat_template(model_dir: str | pathlib.Path, dest: str | pathlib.Path) -> pathlib.Path:
    """A copy of `model_dir` at `dest` whose tokenizer uses TOOL_CHAT_TEMPLATE."""
    dest = pathlib.Path(dest)
    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    # transformers 5 reads chat_template.jinja; older versions the config entry.
    (dest / "chat_template.jinja").write_text(TOOL_CHAT_TEMPLATE)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return dest
