"""Tool calling on chat completions: the tools in the prompt, the grammar that forces a call, and the
output parsed back into OpenAI's `tool_calls` (whole or as streaming deltas).

The call format is Hermes' (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), which
Qwen, Hermes and SmolLM3 templates use and vLLM's `hermes` parser reads. A chat template that has
a tools section gets `tools=` as transformers passes it; one without (SmolLM2's) gets the same
instructions in the system message instead, so that the model still sees the functions.

`tool_choice`:
- "none": no tools in the prompt, nothing parsed (plain content);
- "auto": tools in the prompt; `<tool_call>` blocks in the output become tool calls;
- "required": the output is forced (JSON schema) to a list of {"name", "parameters"} objects, one
  per call, each name one of the tools and its parameters valid for that tool (vLLM's form);
- a named function: the output is forced to that function's parameters, which become the call's
  arguments.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from iterserve.server.protocol import APIError, ChatCompletionRequest, ChatMessage, ToolDef
from iterserve.structured.params import StructuredOutputsParams

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)

FALLBACK_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_has_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolMode:
    """What this request does with tools: `choice` is "none", "auto", "required" or a function name."""

    tools: list[ToolDef]
    choice: str
    named: bool = False
    parallel: bool = True  # "required" may make several calls (parallel_tool_calls=false: one)

    @classmethod
    def from_body(cls, body: ChatCompletionRequest) -> ToolMode:
        tools = body.tools or []
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if not isinstance(choice, str):  # {"type": "function", "function": {"name": ...}}
            name = choice.function.name
            if name not in {t.function.name for t in tools}:
                raise APIError(f"tool_choice names function {name!r}, which is not among the tools",
                               param="tool_choice")
            return cls(tools, name, named=True)
        if choice in ("auto", "required") and not tools:
            raise APIError(f'tool_choice "{choice}" needs tools', param="tool_choice")
        return cls(tools, choice, parallel=body.parallel_tool_calls is not False)

    @property
    def active(self) -> bool:
        return self.choice != "none"

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
    assistant tool calls and tool results itself; otherwise they are written into the text."""
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
            else:
                msg["content"] += "".join(
                    f"{CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                    f"\n{CALL_CLOSE}" for c in calls)
        if m.role == "tool":
            if native_tools:
                msg["tool_call_id"] = m.tool_call_id
            else:
                msg["content"] = f"<tool_response>\n{msg['content']}\n</tool_response>"
        out.append(msg)
    if mode.active and not native_tools:
        text = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t) for t in mode.template_tools()))
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


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parse_tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict]]:
    """(content, tool calls) from a finished output. Text that does not parse as the forced form
    (e.g. cut off by max_tokens) stays content with no calls."""
    if mode.named:
        return None, [_call(mode.choice, text)]
    if mode.choice == "required":
        try:
            items = json.loads(text)
            return None, [_call(it["name"], it["parameters"]) for it in items]
        except (ValueError, TypeError, KeyError):
            return text, []
    if mode.choice == "auto":
        calls = []
        for m in _CALL_RE.finditer(text):
            try:
                obj = json.loads(m.group(1))
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            except (ValueError, TypeError, KeyError):
                return text, []  # not a well-formed call: leave the text as the model wrote it
        if calls:
            content = text[: text.index(CALL_OPEN)].strip()
            return content or None, calls
    return text, []


@dataclass
class ToolCallStream:
    """Turns text deltas into chat deltas for one streamed request. A named function streams its
    arguments as they come; "required" and "auto" hold back what may be a call until it is whole
    (content before an auto call streams as it comes)."""

    mode: ToolMode
    _text: str = ""
    _sent: int = 0  # chars of _text already sent as content
    _in_call: bool = False
    _named_id: str = field(default_factory=new_call_id)
    _named_started: bool = False

    def feed(self, delta: str) -> list[dict]:
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
        if self.mode.choice == "required" or self._in_call:
            return []
        j = self._text.find(CALL_OPEN, self._sent)
        if j != -1:
            self._in_call = True
            return self._content(j)
        return self._content(len(self._text) - _partial_suffix(self._text, CALL_OPEN))

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas, and whether tool calls were made."""
        if self.mode.named:
            if not self._named_started:  # empty output: still announce the call
                return self.feed("") or [{"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                                           "function": {"name": self.mode.choice,
                                                                        "arguments": ""}}]}], True
            return [], True
        content, calls = parse_tool_calls(self._text, self.mode)
        if not calls:
            return self._content(len(self._text)), False
        deltas = self._content(self._text.find(CALL_OPEN)) if self.mode.choice == "auto" else []
        deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        return deltas, True

    def _content(self, upto: int) -> list[dict]:
        if upto <= self._sent:
            return []
        piece, self._sent = self._text[self._sent:upto], upto
        return [{"content": piece}]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker (held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
