"""Reasoning parsers: the base class, the per-request stream, and the registry `--reasoning-parser` reads.

A reasoning model writes its thinking between two markers, then its answer. A parser splits a
finished output into (reasoning, content) and, streamed, each text delta into (reasoning delta,
content delta); the content is what tool-call parsing and the `content` field see. vLLM's names
(`--reasoning-parser qwen3`, ...) choose the parser.

Every parser here is one rule, `split`, over markers: the text is in one of three phases at its
start (thinking, answering, or undecided: a start marker at the very beginning opens the thinking),
and the thinking ends at the first end marker. The phase at the start comes from the prompt (a
template that put the start marker at the end of the prompt leaves the model thinking; one that
put a closed, empty block there, as Qwen3's and SmolLM3's do with enable_thinking false, leaves it
answering) and otherwise from the parser (`neutral_phase`). The rule only ever extends what it
has decided (once the start is settled, reasoning grows until the first end marker and content
after it), so `ReasoningStream` applies the same rule as the text comes, holding back only a tail
that may still become a marker: the deltas of a stream add up to `split` of the whole text, however
the text is cut into deltas (tests/test_reasoning_parsers.py cuts every case at every position).
"""
from __future__ import annotations

import enum
from typing import ClassVar

from iterserve.thinking import Phase, ThinkingSpec

PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens decoded to find a marker the template left there


class PromptState(str, enum.Enum):
    NEUTRAL = "neutral"  # the prompt ends with no marker: the parser's neutral phase applies
    THINKING = "thinking"  # the prompt ends with a start marker (Qwen3-Thinking-2507, DeepSeek-R1's template)
    CLOSED = "closed"  # the prompt ends with an end marker (an empty block: thinking switched off)


class ReasoningParser:
    """Splits one request's output into reasoning and content. Subclasses set the markers (the first
    of each is the canonical one: the engine forces it, tokenised, when a thinking budget runs out)
    and the phase an output starts in when the prompt says nothing."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]]
    end_markers: ClassVar[tuple[str, ...]]
    neutral_phase: ClassVar[Phase]

    def __init__(self, prompt_state: PromptState = PromptState.NEUTRAL) -> None:
        self.prompt_state = prompt_state

    # ---- the phase at the output's start ------------------------------------------------------------
    @classmethod
    def prompt_state_of(cls, prompt_tail: str) -> PromptState:
        """Where the prompt's text (its tail, decoded with special tokens) leaves the model."""
        tail = prompt_tail.rstrip()
        if any(tail.endswith(m) for m in cls.start_markers):
            return PromptState.THINKING
        if any(tail.endswith(m) for m in cls.end_markers):
            return PromptState.CLOSED
        return PromptState.NEUTRAL

    @property
    def initial_phase(self) -> Phase:
        return {PromptState.THINKING: Phase.THINKING, PromptState.CLOSED: Phase.ANSWER}.get(
            self.prompt_state, self.neutral_phase)

    def thinking_spec(self, tokenizer, budget: int | None) -> ThinkingSpec:
        """What the engine needs to enforce a budget and keep a grammar off the thinking."""
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return ThinkingSpec(ids(self.start_markers[0]), ids(self.end_markers[0]), self.initial_phase, budget)

    # ---- splitting ------------------------------------------------------------------------------------
    def _sections(self, text: str) -> tuple[str, str]:
        """(reasoning, content) as strings, "" for none."""
        phase = self.initial_phase
        if phase == Phase.ANSWER:
            return "", text
        stripped = text.lstrip()
        opened = next((m for m in self.start_markers if stripped.startswith(m)), None)
        if opened is not None:  # a start marker at the beginning: dropped, with the space before it
            body = stripped[len(opened):]
        elif phase == Phase.UNDECIDED:
            return "", text  # no thinking block: all of it is the answer
        else:
            body = text
        found = [(i, m) for m in self.end_markers if (i := body.find(m)) != -1]
        if not found:
            return body, ""  # still thinking (or cut off while thinking)
        i, m = min(found)
        return body[:i], body[i + len(m):]

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None where there is none."""
        reasoning, content = self._sections(text)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One streamed choice: text deltas in, (reasoning delta, content delta) out, by the rule of
    `ReasoningParser._sections` applied as the text comes. Work per delta is the delta plus a marker's
    length: the stream keeps only what it has not sent (a tail that may still become a marker; at the
    start, text that may still become a start marker), never the whole output."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._mode = "answer" if parser.initial_phase == Phase.ANSWER else "start"
        self._buf = ""  # received, not sent

    def feed(self, delta: str) -> tuple[str, str]:
        if self._mode == "answer":
            return "", delta
        self._buf += delta
        if self._mode == "start" and not self._resolve_start():
            return "", ""  # still (the beginning of) a start marker, or nothing but space
        if self._mode == "answer":
            content, self._buf = self._buf, ""
            return "", content
        return self._thinking()

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        if self._mode == "start":  # nothing was sent yet: the whole-text rule decides
            reasoning, content = self.parser._sections(self._buf)
        elif self._mode == "thinking":  # a tail that never became an end marker is thinking
            reasoning, content = self._buf, ""
        else:
            reasoning, content = "", self._buf
        self._buf = ""
        return reasoning, content

    def _resolve_start(self) -> bool:
        """Leaves "start" once the text's beginning decides; False while it cannot yet."""
        markers = self.parser.start_markers
        stripped = self._buf.lstrip()
        opened = next((m for m in markers if stripped.startswith(m)), None)
        if opened is not None:
            self._mode, self._buf = "thinking", stripped[len(opened):]
            return True
        if any(m.startswith(stripped) for m in markers):
            return False
        self._mode = "answer" if self.parser.initial_phase == Phase.UNDECIDED else "thinking"
        return True

    def _thinking(self) -> tuple[str, str]:
        """In the thinking: up to the first end marker, or all but a tail that may begin one."""
        ends = self.parser.end_markers
        found = [(i, m) for m in ends if (i := self._buf.find(m)) != -1]
        if found:
            i, m = min(found)
            reasoning, content = self._buf[:i], self._buf[i + len(m):]
            self._mode, self._buf = "answer", ""
            return reasoning, content
        hold = max(_partial_suffix(self._buf, m) for m in ends)
        reasoning, self._buf = self._buf[:len(self._buf) - hold], self._buf[len(self._buf) - hold:]
        return reasoning, ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# ---- the registry ------------------------------------------------------------------------------------
_PARSERS: dict[str, type[ReasoningParser]] = {}


def register(*names: str):
    """Class decorator: the parser answers to these `--reasoning-parser` names."""
    def add(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        for n in names:
            if n in _PARSERS:
                raise ValueError(f"reasoning parser {n!r} is registered twice")
            _PARSERS[n] = cls
        return cls
    return add


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str) -> type[ReasoningParser]:
    """The parser class for a `--reasoning-parser` name; a ValueError listing the names otherwise."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {', '.join(parser_names())}") from None
