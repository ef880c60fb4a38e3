"""Mistral's calls (vLLM's `mistral`), after the `[TOOL_CALLS]` special token, in either of the
two forms Mistral's tokenizers use:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": ..., ...}]
    [TOOL_CALLS]get_weather{"city": "Oslo"}                                       (tokenizer v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}      (v13)

Call ids are 9 letters and digits, as vLLM makes them: Mistral's chat templates refuse any other id
when the calls come back in the conversation.
"""
from __future__ import annotations

import json
import random
import string

from iterserve.server.tool_parsers.base import (ToolCallFormatError, ToolParser, json_objects, make_call,
                                               name_and_arguments)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def format_calls(self, calls) -> str:
        return TOOL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in calls])

    def parse_calls(self, section: str) -> list[dict]:
        parts = section.split(TOOL_CALLS)[1:]
        calls = []
        for part in parts:
            if not part.lstrip().startswith(("[", "{")):  # name[ARGS]{...} or name{...}
                name, args = part.split(ARGS, 1) if ARGS in part else (part[:part.index("{")], part[part.index("{"):])
                name, obj = name.strip(), json.loads(args)
                if not name or not isinstance(obj, dict):
                    raise ToolCallFormatError("a named call needs a name and an object")
                calls.append(make_call(name, obj, self.new_call_id()))
                continue
            for value in json_objects(part):  # a list of calls, or one call object
                for item in value if isinstance(value, list) else [value]:
                    calls.append(make_call(*name_and_arguments(item), self.new_call_id()))
        return calls
