"""Tool-call parsers by model family, under vLLM's `--tool-call-parser` names (base.py says what a
parser does). `detect_parser` picks one from the model's chat template when the flag is absent."""
from __future__ import annotations

from iterserve.server.tool_parsers.base import ToolParser, ToolParserStream, call_deltas, make_call, new_call_id
from iterserve.server.tool_parsers.granite import GraniteToolParser
from iterserve.server.tool_parsers.hermes import HermesToolParser
from iterserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from iterserve.server.tool_parsers.mistral import MistralToolParser
from iterserve.server.tool_parsers.pythonic import PythonicToolParser
from iterserve.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, GraniteToolParser, PythonicToolParser,
    Qwen3CoderToolParser)}
DEFAULT_PARSER = "hermes"  # the format of the instructions written for templates without tools

# (what the template says, the parser), first match wins: Qwen3-Coder templates also say <tool_call>,
# Granite 3.1+ ones too (with Granite's role tokens)
_TEMPLATE_SIGNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<function=",), "qwen3_coder"),
    (("[func_name1(",), "pythonic"),
    (("<|python_start|>",), "pythonic"),  # Llama 4
    (("<|tool_call|>",), "granite"),
    (("<|start_of_role|>", "<tool_call>"), "granite"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>",), "llama3_json"),
    (("<tool_call>",), "hermes"),
)


def parser_class(name: str) -> type[ToolParser]:
    """The parser registered under name; ValueError listing the names otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {', '.join(sorted(PARSERS))}") from None


def detect_parser(chat_template: str | None) -> str | None:
    """The parser whose format the chat template writes, or None when it names none of them."""
    if not chat_template:
        return None
    for signs, name in _TEMPLATE_SIGNS:
        if all(s in chat_template for s in signs):
            return name
    return None


__all__ = ["PARSERS", "DEFAULT_PARSER", "ToolParser", "ToolParserStream", "call_deltas", "detect_parser",
           "make_call", "new_call_id", "parser_class", "resolve_parser"]


def resolve_parser(name: str | None, tokenizer) -> tuple[str, bool]:
    """The server's parser (the one named, else the one the tokenizer's chat template writes, else
    hermes, whose format the instructions for templates without tools use), logged; and whether any
    of its markers is a special token, which the decoded text must then keep. ValueError for an
    unknown name."""
    import logging

    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    if name is not None:
        parser_class(name)
        how = "--tool-call-parser"
    else:
        detected = detect_parser(template)
        name, how = (detected, "the chat template") if detected else (DEFAULT_PARSER, "the default")
    keeps = any(_is_special(tokenizer, m) for m in parser_class(name).markers)
    logging.getLogger("iterserve.server").info("tool-call parser: %s (from %s)%s", name, how,
                                               "; special tokens kept in tool_choice auto output" if keeps else "")
    return name, keeps


def _is_special(tokenizer, marker: str) -> bool:
    """Whether marker is one token that decoding with skip_special_tokens drops."""
    try:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""
    except Exception:  # noqa: BLE001 - a tokenizer without these methods keeps its text as it is
        return False
