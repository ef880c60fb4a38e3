"""Hermes' format (Qwen 2.5 / 3, Hermes 2/3, SmolLM3 templates; vLLM's `hermes`):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call><tool_call>...</tool_call>

Several blocks are parallel calls. A last block left open when the model stopped (EOS before
`</tool_call>`) still counts when its JSON is whole, as in vLLM. Any block that is not a JSON call
makes the whole text content.
"""
from __future__ import annotations

import json
import re

from iterserve.server.tool_parsers.base import ToolCallFormatError, ToolParser, make_call, name_and_arguments

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (CALL_OPEN,)

    def format_calls(self, calls) -> str:
        return "".join(f"{CALL_OPEN}\n{json.dumps({'name': n, 'arguments': a})}\n{CALL_CLOSE}" for n, a in calls)

    def instructions(self) -> str:
        return ("For each function call, return a json object with function name and arguments within "
                f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n' + CALL_CLOSE)

    def parse_calls(self, section: str) -> list[dict]:
        calls = []
        for m in _BLOCK_RE.finditer(section):
            body = m.group(1).strip()
            if not body and not m.group(0).endswith(CALL_CLOSE):
                continue  # a bare "<tool_call>" at the very end: nothing was written
            calls.append(make_call(*name_and_arguments(json.loads(body))))
        if not calls:
            raise ToolCallFormatError("no call in the section")
        return calls
