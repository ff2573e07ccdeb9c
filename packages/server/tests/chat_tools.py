"""Tools and a chat template that shows them, shared by the tool-calling HTTP tests."""

from __future__ import annotations

import json
import pathlib
import shutil

# The tiny tokenizer's template, plus a system turn listing the tools when there are any.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nYou may call: "
    "{% for tool in tools %}{{ tool['function']['name'] }}: "
    "{{ tool['function']['parameters'] | tojson }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CITY = {"type": "string", "minLength": 1, "maxLength": 10}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": CITY,
                    "limit": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["query"],
            },
        },
    },
]
SCHEMA_OF = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def tools_tokenizer(test_tokenizer_path: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """A copy of the tiny tokenizer in ``folder`` whose chat template is ``TOOLS_TEMPLATE``."""
    shutil.copytree(test_tokenizer_path, folder, dirs_exist_ok=True)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder
