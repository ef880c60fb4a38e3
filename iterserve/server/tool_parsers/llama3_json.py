"""Llama 3.1 / 3.2 / 3.3 JSON calls (vLLM's `llama3_json`): the output is one or more JSON objects
`{"name": ..., "parameters": {...}}` (or "arguments"), separated by `;` when parallel, either bare
(the output starts with `{`) or after the `<|python_tag|>` token, which is a special token: the server
keeps special tokens in the text while this parser reads it.

    {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}

A bare output is a call only when it starts with `{`: JSON inside prose is the model's answer.
"""
from __future__ import annotations

from iterserve.server.tool_parsers.base import ToolParser, json_objects, make_call, name_and_arguments

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def call_start(self, text: str) -> int | None:
        j = text.find(PYTHON_TAG)
        if j != -1:
            return j
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def held(self, text: str) -> int:
        if not text.strip():  # only whitespace so far: a bare "{" may still open the output
            return len(text)
        return super().held(text)

    def parse_calls(self, section: str) -> list[dict]:
        if section.startswith(PYTHON_TAG):
            section = section[len(PYTHON_TAG):]
        return [make_call(*name_and_arguments(o)) for o in json_objects(section, separators=";")]
