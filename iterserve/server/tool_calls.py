"""Tool calling on chat completions: the tools in the prompt, the grammar that forces a call, and the
output parsed back into OpenAI's `tool_calls` (whole or as streaming deltas).

With tool_choice "auto" the server's tool-call parser (tool_parsers/, vLLM's --tool-call-parser
names; by default the one the chat template's format names) reads the calls. A chat template that
has a tools section gets `tools=` as transformers passes it; one without (SmolLM2's) gets
instructions for Hermes' format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) in the
system message instead, so that the model still sees the functions.

`tool_choice`:
- "none": no tools in the prompt, nothing parsed (plain content);
- "auto": tools in the prompt; calls in the parser's format become tool calls;
- "required": the output is forced (JSON schema) to a list of {"name", "parameters"} objects, one
  per call, each name one of the tools and its parameters valid for that tool (vLLM's form);
- a named function: the output is forced to that function's parameters, which become the call's
  arguments.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from iterserve.server.protocol import APIError, ChatCompletionRequest, ChatMessage, ToolDef
from iterserve.server.tool_parsers import (DEFAULT_PARSER, ToolParser, ToolParserStream, call_deltas, make_call,
                                          parser_class)
from iterserve.structured.params import StructuredOutputsParams


FALLBACK_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

{how}"""


def template_has_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


@dataclass
class ToolMode:
    """What this request does with tools: `choice` is "none", "auto", "required" or a function name."""

    tools: list[ToolDef]
    choice: str
    named: bool = False
    parallel: bool = True  # "required" may make several calls (parallel_tool_calls=false: one)
    parser: str = DEFAULT_PARSER  # the --tool-call-parser that reads "auto" output (tool_parsers/)

    @classmethod
    def from_body(cls, body: ChatCompletionRequest, parser: str = DEFAULT_PARSER) -> ToolMode:
        tools = body.tools or []
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if not isinstance(choice, str):  # {"type": "function", "function": {"name": ...}}
            name = choice.function.name
            if name not in {t.function.name for t in tools}:
                raise APIError(f"tool_choice names function {name!r}, which is not among the tools",
                               param="tool_choice")
            return cls(tools, name, named=True, parser=parser)
        if choice in ("auto", "required") and not tools:
            raise APIError(f'tool_choice "{choice}" needs tools', param="tool_choice")
        return cls(tools, choice, parallel=body.parallel_tool_calls is not False, parser=parser)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def new_parser(self) -> ToolParser:
        return parser_class(self.parser)([t.model_dump(exclude_none=True) for t in self.tools])

    def function(self, name: str) -> ToolDef:
        return next(t for t in self.tools if t.function.name == name)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that enforces "required" or a named function; None for "auto" and "none"."""
        if self.named:
            return StructuredOutputsParams(json=_parameters(self.function(self.choice)))
        if self.choice == "required":
            one_of = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                         "parameters": _parameters(t)},
                       "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
            return StructuredOutputsParams(json=calls if self.parallel else calls | {"maxItems": 1})
        return None

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.active else None


def _parameters(tool: ToolDef) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def prompt_messages(messages: list[ChatMessage], mode: ToolMode, native_tools: bool) -> list[dict]:
    """Chat messages as the template takes them. With `native_tools` the template renders tools,
    assistant tool calls and tool results itself; otherwise they are written into the text, the
    calls in the format of the server's tool-call parser."""
    parser = mode.new_parser()
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                   "arguments": _arguments_obj(c.function.arguments)}}
                     for c in m.tool_calls]
            if native_tools:
                msg["tool_calls"] = calls
            else:  # in the server's parser's format, as the instructions ask the model to write them
                msg["content"] += parser.format_calls([(c["function"]["name"], c["function"]["arguments"])
                                                       for c in calls])
        if m.role == "tool":
            if native_tools:
                msg["tool_call_id"] = m.tool_call_id
            else:
                msg["content"] = f"<tool_response>\n{msg['content']}\n</tool_response>"
        out.append(msg)
    if mode.active and not native_tools:
        text = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t) for t in mode.template_tools()),
                                            how=parser.instructions())
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments_obj(arguments: str):
    """Templates expect arguments as an object; OpenAI sends them as JSON text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def parse_tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict]]:
    """(content, tool calls) from a finished output. "auto" reads the text with the mode's parser
    (tool_parsers/); "required" and a named function read the JSON their grammar forced, whatever
    the parser. Text that does not parse (malformed, or cut off by max_tokens) stays content with
    no calls."""
    parser = mode.new_parser()
    if mode.named:
        return None, [make_call(mode.choice, text, parser.new_call_id())]
    if mode.choice == "required":
        try:
            items = json.loads(text)
            return None, [make_call(it["name"], it["parameters"], parser.new_call_id()) for it in items]
        except (ValueError, TypeError, KeyError):
            return text, []
    if mode.choice == "auto":
        return parser.extract(text)
    return text, []


@dataclass
class ToolCallStream:
    """Turns text deltas into chat deltas for one streamed request. A named function streams its
    arguments as they come; "required" holds the forced JSON until it is whole; "auto" is the
    parser's stream (content as it comes up to the call section, the calls at the end)."""

    mode: ToolMode
    _text: str = ""
    _named_id: str = ""
    _named_started: bool = False
    _auto: ToolParserStream | None = None

    def __post_init__(self) -> None:
        parser = self.mode.new_parser()
        self._named_id = parser.new_call_id()
        if self.mode.choice == "auto":
            self._auto = parser.stream()

    def feed(self, delta: str) -> list[dict]:
        if self._auto is not None:
            return self._auto.feed(delta)
        self._text += delta
        if self.mode.named:
            if not delta:
                return []
            fn = {"arguments": delta}
            if not self._named_started:
                self._named_started = True
                return [{"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                         "function": {"name": self.mode.choice, **fn}}]}]
            return [{"tool_calls": [{"index": 0, "function": fn}]}]
        return []

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas, and whether tool calls were made."""
        if self._auto is not None:
            return self._auto.finish()
        if self.mode.named:
            if not self._named_started:  # empty output: still announce the call
                return [{"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                         "function": {"name": self.mode.choice, "arguments": ""}}]}], True
            return [], True
        content, calls = parse_tool_calls(self._text, self.mode)
        if not calls:
            return ([{"content": self._text}] if self._text else []), False
        return call_deltas(calls), True
