"""A chat request's reasoning settings: its chat-template variables, the parser that splits its
output, and the thinking spec the engine enforces (budget, grammar on the answer only)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.server.protocol import APIError
from iterserve.server.reasoning.base import PROMPT_TAIL_TOKENS, ReasoningParser
from iterserve.thinking import ThinkingSpec

# apply_chat_template's own parameters: a template variable of these names would replace what the
# server passes (the messages, the tools, the generation prompt) or change what the call returns
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(default: dict[str, Any] | None, given: dict[str, Any] | None) -> dict[str, Any] | None:
    """The server's default variables updated by the request's (vLLM's rule: the request wins)."""
    if given:
        bad = sorted(RESERVED_TEMPLATE_KWARGS & set(given))
        if bad:
            raise APIError(f"chat_template_kwargs: {', '.join(repr(b) for b in bad)} cannot be set (the server "
                           "passes it itself)", param="chat_template_kwargs")
    merged = {**(default or {}), **(given or {})}
    return merged or None


def check_default_template_kwargs(value: Any) -> dict[str, Any]:
    """--default-chat-template-kwargs, checked at start-up."""
    if not isinstance(value, dict):
        raise ValueError(f"--default-chat-template-kwargs must be a JSON object, got {value!r}")
    bad = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if bad:
        raise ValueError(f"--default-chat-template-kwargs cannot set {', '.join(bad)}")
    return value


@dataclass
class RequestReasoning:
    """What a chat request does with thinking: its parser (None without --reasoning-parser), whether
    the answer shows the thinking, and the engine's spec (None when nothing needs enforcing)."""

    parser: ReasoningParser | None = None
    include: bool = True
    spec: ThinkingSpec | None = None


def request_reasoning(parser_cls: type[ReasoningParser] | None, tokenizer, prompt_ids: list[int],
                      budget: int | None, server_budget: int, constrained: bool,
                      include: bool | None) -> RequestReasoning:
    """budget: the request's thinking_token_budget (None: the server's --reasoning-budget; -1:
    unlimited). constrained: a grammar (response_format, a forced tool call) applies to the answer."""
    if parser_cls is None:
        if budget is not None and budget >= 0:
            raise APIError("thinking_token_budget needs a reasoning model served with --reasoning-parser",
                           param="thinking_token_budget")
        return RequestReasoning()
    budget = server_budget if budget is None else budget
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    parser = parser_cls(parser_cls.prompt_state_of(tail))
    spec = None
    if budget >= 0 or constrained:
        spec = parser.thinking_spec(tokenizer, budget if budget >= 0 else None)
    return RequestReasoning(parser, include is not False, spec)
