"""The tool-call parser interface: model text in, OpenAI `tool_calls` out, whole or streamed.

A parser reads the text a model writes when it calls a function in its family's format
(`<tool_call>` JSON, `[TOOL_CALLS]`, pythonic lists, ...) and is used with `tool_choice: "auto"`;
"required" and a named function are forced by a grammar to plain JSON and parsed in tool_calls.py,
whatever the parser. Parsers know nothing of the server: `extract(text) -> (content, calls)` on a
finished text, and `stream()` for a `feed(delta) -> deltas` / `finish()` reader, so that a
reasoning parser can hand them the answer text after the thinking is split off.

Streaming holds back everything from the start of the call section to the end of the output, then
sends each call as OpenAI's deltas (index, id, type and name first, then its arguments). Whether the
section is well formed, and so whether it is calls or plain content, is known only once the text is
whole: sending calls earlier could send a call that the non-streamed answer would not have, and the
concatenated deltas must equal the non-streamed result.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    """One OpenAI tool call; arguments as JSON text (a string is taken as already JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


class ToolCallFormatError(ValueError):
    """The call section is not well formed: the whole text stays content."""


class ToolParser:
    """Base class: a subclass sets `name` (vLLM's --tool-call-parser name) and `markers` (the text
    that opens its call section, when it has any) and implements `parse_calls`.

    `tools` are the request's tool definitions as dicts ({"type": "function", "function": {...}});
    parsers whose format carries untyped values (qwen3_coder) read the parameter types from them."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    only_at_start: ClassVar[bool] = False  # calls only where the output starts (pythonic)

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    # ---- what a subclass provides -------------------------------------------------------------------
    def parse_calls(self, section: str) -> list[dict]:
        """The calls in the call section (from the start marker to the end of the text); raises
        ToolCallFormatError (or ValueError, KeyError, TypeError) when it is not well formed."""
        raise NotImplementedError

    def parse_section(self, section: str) -> tuple[list[dict], int]:
        """The calls and how many chars of the section they take; text after them is content again.
        By default the calls take the whole section (parse_calls)."""
        return self.parse_calls(section), len(section)

    def call_start(self, text: str, pos: int = 0) -> int | None:
        """Where the call section begins in text (looking from pos on), or None: by default the
        first marker."""
        found = [i for i in (text.find(m, pos) for m in self.markers) if i != -1]
        return min(found) if found else None

    def held(self, text: str) -> int:
        """How many chars at the end of text may still become the start of a call section (held back
        from streamed content): by default the longest tail that is a proper prefix of a marker."""
        return max((_partial_suffix(text, m) for m in self.markers), default=0)

    def new_call_id(self) -> str:
        return new_call_id()

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        """The text the model would write for these (name, arguments) calls: the inverse of
        extract, used to write an assistant's earlier calls into a template that has no tools
        section, and to tell the model the format (`instructions`)."""
        raise NotImplementedError

    def instructions(self) -> str:
        """How to call, for a system message written by the server (templates without tools)."""
        return ("To call functions, answer with the calls in this form and nothing else:\n"
                + self.format_calls([("function_name", {"argument": "value"})]))

    # ---- the interface --------------------------------------------------------------------------------
    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a finished output. Text without a call section, or whose call section
        is malformed, is all content with no calls; otherwise content is the text around the calls
        (stripped; None when empty)."""
        found = self.split(text)
        if found is None:
            return text, []
        start, end, calls = found
        content = (text[:start] + text[end:]).strip()
        return content or None, calls

    def split(self, text: str) -> tuple[int, int, list[dict]] | None:
        """(start, end, calls) of the call section in a finished text; None when there are no
        well-formed calls."""
        start = self.call_start(text)
        if start is None:
            return None
        try:
            calls, used = self.parse_section(text[start:])
        except (ValueError, KeyError, TypeError, AttributeError, SyntaxError, RecursionError):
            return None
        return (start, start + used, calls) if calls else None

    def stream(self) -> ToolParserStream:
        return ToolParserStream(self)

    def tool_parameters(self, name: str) -> dict:
        """The JSON schema of a tool's parameters ({} when the tool or its schema is unknown)."""
        for t in self.tools:
            fn = t.get("function") or {}
            if fn.get("name") == name:
                return fn.get("parameters") or {}
        return {}


@dataclass
class ToolParserStream:
    """One streamed output: content is sent as it comes up to the call section (a possible start
    marker at the end is held back), the section is held, and at `finish` the calls are sent."""

    parser: ToolParser
    _text: str = ""
    _sent: int = 0  # chars of _text already sent as content
    _in_calls: bool = False

    def feed(self, delta: str) -> list[dict]:
        """Chat deltas ({"content": ...}) for this piece of text."""
        self._text += delta
        if self._in_calls:
            return []
        if self.parser.only_at_start and self._sent:  # content has begun: no call can follow
            return self._content(len(self._text))
        # a marker cannot start before the held-back tail: look from there, not from 0 (linear time)
        start = self.parser.call_start(self._text, max(0, self._sent - 1))
        if start is not None:
            self._in_calls = True
            return self._content(start)
        return self._content(len(self._text) - self.parser.held(self._text))

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas, and whether tool calls were made."""
        found = self.parser.split(self._text)
        if found is None:
            return self._content(len(self._text)), False
        start, end, calls = found
        deltas = self._content(start)
        if end < len(self._text):  # text after the calls (llama3_json): content too, sent before them
            self._sent = end       # so that a message is whole before the calls begin (Responses items)
            deltas.extend(self._content(len(self._text)))
        deltas.extend(call_deltas(calls))
        return deltas, True

    def _content(self, upto: int) -> list[dict]:
        if upto <= self._sent:
            return []
        piece, self._sent = self._text[self._sent:upto], upto
        return [{"content": piece}]


def call_deltas(calls: list[dict]) -> list[dict]:
    """OpenAI's streamed form of finished calls: per call one delta with index, id, type and name
    (arguments ""), then one with its arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}}]})
        if c["function"]["arguments"]:
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def json_objects(text: str, separators: str = "") -> list[Any]:
    """The JSON values written one after another in text, with whitespace and any of `separators`
    between them; raises ValueError on anything else."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return out
        obj, i = dec.raw_decode(text, i)
        out.append(obj)


def name_and_arguments(obj: Any) -> tuple[str, Any]:
    """A {"name", "arguments" | "parameters"} object's parts (the formats use both keys)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallFormatError("a call needs a name")
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ToolCallFormatError("a call's arguments must be an object")
    return obj["name"], args
