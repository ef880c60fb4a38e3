"""Reasoning parsers (`--reasoning-parser NAME`): split a reasoning model's thinking from its answer.

Importing the package registers every parser; `get_parser(name)` finds one, `parser_names()` lists them.
"""
from iterserve.server.reasoning import granite, think  # noqa: F401  (they register themselves)
from iterserve.server.reasoning.base import (PromptState, ReasoningParser, ReasoningStream, get_parser,
                                             parser_names)

__all__ = ["PromptState", "ReasoningParser", "ReasoningStream", "get_parser", "parser_names"]
