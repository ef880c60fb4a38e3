"""Qwen3-Coder's XML-style calls (vLLM's `qwen3_coder`): one `<function=...>` block per call,
each parameter's value as raw text between its tags, inside `<tool_call>` tags:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The values carry no type: each is converted by the type its tool's JSON schema gives the parameter
(integer, number, boolean, object / array as JSON, null), as vLLM does; a parameter the schema does
not type stays a string. Several `<function=...>` blocks are parallel calls.
"""
from __future__ import annotations

import ast
import json
import re

from iterserve.server.tool_parsers.base import ToolCallFormatError, ToolParser, make_call

TOOL_CALL, FUNCTION = "<tool_call>", "<function="
_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = (TOOL_CALL, FUNCTION)

    def format_calls(self, calls) -> str:
        def value(v) -> str:
            return v if isinstance(v, str) else json.dumps(v)
        return "\n".join(
            f"{TOOL_CALL}\n<function={n}>\n"
            + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in (a.items() if isinstance(a, dict) else ()))
            + "</function>\n</tool_call>" for n, a in calls)

    def parse_calls(self, section: str) -> list[dict]:
        calls = []
        for fm in _FUNCTION_RE.finditer(section):
            name = fm.group(1).strip()
            if not name:
                raise ToolCallFormatError("a <function=...> block needs a name")
            props = self.tool_parameters(name).get("properties") or {}
            args = {}
            for pm in _PARAMETER_RE.finditer(fm.group(2)):
                key = pm.group(1).strip()
                args[key] = convert(_trim(pm.group(2)), (props.get(key) or {}).get("type"))
            calls.append(make_call(name, args))
        if not calls:
            raise ToolCallFormatError("no <function=...> block")
        return calls


def _trim(value: str) -> str:
    """The value without the one newline after its opening tag and before its closing tag."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def convert(value: str, kind) -> object:
    """A parameter's text as its schema type says (with the aliases vLLM's parser accepts: int...,
    float / num..., bool...); text that does not convert stays a string."""
    if isinstance(kind, list):  # ["integer", "null"]: the first non-null type
        kind = next((k for k in kind if k != "null"), None)
    kind = kind.lower() if isinstance(kind, str) else None
    if kind is None or kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if value.strip().lower() == "null":
        return None
    v = value.strip()
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(v)
        if kind.startswith(("num", "float", "double")):
            f = float(v)
            return int(f) if f.is_integer() and not any(c in v for c in ".eE") else f
        if kind.startswith("bool"):
            return v.lower() == "true" if v.lower() in ("true", "false") else value
        try:  # object, array, dict, list and anything else: JSON, else a Python literal
            return json.loads(v)
        except ValueError:
            return ast.literal_eval(v)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
