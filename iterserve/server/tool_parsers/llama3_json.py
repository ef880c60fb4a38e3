"""Llama 3.1 / 3.2 / 3.3 JSON calls (vLLM's `llama3_json`): one or more JSON objects
`{"name": ..., "parameters": {...}}` (or "arguments"), separated by `;` when parallel, bare or after
the `<|python_tag|>` token (a special token: the server keeps special tokens in the text while this
parser reads it).

    Here is the call: {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}

As in vLLM's parser the calls may sit inside text (Llama models often say what they are about to
call); unlike vLLM's, that text stays `content` rather than being dropped. The calls start at the
tag or at the first `{` that opens `{"name"`; if what starts there is not a run of call objects,
the whole text is content. Other braces (JSON or code in an answer) stream as content at once; a
`{` is held back only while it may still become `{"name"`.
"""
from __future__ import annotations

import json

from iterserve.server.tool_parsers.base import ToolParser, make_call, name_and_arguments

PYTHON_TAG = "<|python_tag|>"
_NAME_KEY = '"name"'


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def call_start(self, text: str, pos: int = 0) -> int | None:
        found = [j for j in (text.find(PYTHON_TAG, pos), self._brace(text, pos)[0]) if j is not None and j != -1]
        return min(found) if found else None

    def held(self, text: str) -> int:
        last = text.rfind("{")  # only the last brace can still become `{"name"`
        maybe = self._brace(text, last)[1] if last != -1 else None
        return max(super().held(text), len(text) - maybe if maybe is not None else 0)

    @staticmethod
    def _brace(text: str, pos: int) -> tuple[int | None, int | None]:
        """(the first `{` from pos that opens `{"name"`, a last `{` that still may): only such a
        brace starts calls, so braces in prose and code stream as content at once."""
        j = text.find("{", pos)
        while j != -1:
            rest = text[j + 1:].lstrip()
            if rest.startswith(_NAME_KEY):
                return j, None
            if _NAME_KEY.startswith(rest):
                return None, j
            j = text.find("{", j + 1)
        return None, None

    def format_calls(self, calls) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)

    def parse_section(self, section: str) -> tuple[list[dict], int]:
        i = len(PYTHON_TAG) if section.startswith(PYTHON_TAG) else 0
        dec = json.JSONDecoder()
        calls, end = [], i
        while True:  # call objects separated by ";" and whitespace, up to the first other text
            j = end
            while j < len(section) and (section[j].isspace() or section[j] == ";"):
                j += 1
            if j == len(section) or section[j] != "{":
                break
            try:
                obj, j = dec.raw_decode(section, j)
            except ValueError:
                if not calls:
                    raise
                break
            calls.append(make_call(*name_and_arguments(obj)))
            end = j
        return calls, end
