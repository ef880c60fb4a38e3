"""What a request asks its output to match, in vLLM's terms (SamplingParams.structured_outputs)."""
from __future__ import annotations

import json
from dataclasses import dataclass


class StructuredOutputError(ValueError):
    """The constraint is invalid or uses a feature the grammar engine does not support (a 400)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints. `json` is a JSON schema (a dict or its JSON text);
    `json_object` asks for any JSON object; `grammar` is Lark or GBNF (llama.cpp's EBNF) text."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise StructuredOutputError(
                "give exactly one structured output constraint (json, regex, choice, grammar or json_object), "
                f"got {', '.join(given) if given else 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(llguidance grammar format, text): what the compiled grammar is cached by."""
        if self.json_object:
            return "json_schema", '{"type": "object"}'
        if self.json is not None:
            # not sort_keys: llguidance emits properties in the schema's order, which is the user's
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json_schema", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar
