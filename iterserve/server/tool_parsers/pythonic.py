"""Pythonic calls (vLLM's `pythonic`: Llama 3.2 / 4 pythonic templates, ToolACE): the whole output
is a Python list of calls with keyword arguments whose values are literals,

    [get_weather(city="Oslo"), get_time(zone="UTC", exact=True)]

optionally between Llama 4's `<|python_start|>` and `<|python_end|>`. Parsed with `ast`, never
evaluated: a value that is not a literal (a name, an expression) makes the text content.
"""
from __future__ import annotations

import ast

from iterserve.server.tool_parsers.base import ToolCallFormatError, ToolParser, make_call

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = (PYTHON_START,)
    only_at_start = True

    def call_start(self, text: str, pos: int = 0) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("[") or stripped.startswith(PYTHON_START):
            return len(text) - len(stripped)
        return None

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or PYTHON_START.startswith(stripped):
            return len(text)  # may still open with "[" or <|python_start|>
        return 0

    def format_calls(self, calls) -> str:
        def one(name, args) -> str:
            items = args.items() if isinstance(args, dict) else ()
            return f"{name}({', '.join(f'{k}={v!r}' for k, v in items)})"
        return "[" + ", ".join(one(n, a) for n, a in calls) + "]"

    def parse_calls(self, section: str) -> list[dict]:
        section = section.strip()
        if section.startswith(PYTHON_START):
            section = section[len(PYTHON_START):]
        section = section.replace(PYTHON_END, "").strip()
        tree = ast.parse(section, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ToolCallFormatError("pythonic calls are a non-empty list")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ToolCallFormatError("each item must be name(keyword=literal, ...)")
            args = {}
            for kw in node.keywords:
                if kw.arg is None:
                    raise ToolCallFormatError("**kwargs is not a literal")
                args[kw.arg] = _literal(kw.value)
            calls.append(make_call(node.func.id, args))
        return calls


def _literal(node: ast.AST):
    """A literal value; also JSON's true / false / null, which models write in pythonic calls."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)
