"""IBM Granite 3.x calls (vLLM's `granite`): a JSON list of calls after `<|tool_call|>` (Granite
3.0) or `<tool_call>` (3.1 and later), with nothing before it:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": ...}]
"""
from __future__ import annotations

import json

from iterserve.server.tool_parsers.base import ToolCallFormatError, ToolParser, json_objects, make_call, name_and_arguments

GRANITE_TOOL_CALL = "<|tool_call|>"
TOOL_CALL = "<tool_call>"


class GraniteToolParser(ToolParser):
    name = "granite"
    markers = (GRANITE_TOOL_CALL, TOOL_CALL)

    def format_calls(self, calls) -> str:
        return GRANITE_TOOL_CALL + json.dumps([{"name": n, "arguments": a} for n, a in calls])

    def parse_calls(self, section: str) -> list[dict]:
        for m in self.markers:
            if section.startswith(m):
                section = section[len(m):]
                break
        values = json_objects(section)
        if len(values) != 1 or not isinstance(values[0], list):
            raise ToolCallFormatError("granite calls are one JSON list")
        return [make_call(*name_and_arguments(o)) for o in values[0]]
