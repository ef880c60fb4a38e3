"""`<think>` ... `</think>` parsers: qwen3, deepseek_r1 (and smollm3, the same as deepseek_r1).

They differ only where the prompt leaves the phase open (its generation prompt ends with no marker):

- qwen3: Qwen3's template lets the model open `<think>` itself (and puts `<think>\\n\\n</think>\\n\\n`
  in the prompt when enable_thinking is false; Qwen3-Thinking-2507's puts `<think>\\n` there). An
  output that does not begin with `<think>` is all content, as vLLM's qwen3 parser had it; one that
  begins with it and never closes it is all reasoning (cut off while thinking), as vLLM's current
  qwen3 parser has it for thinking on.
- deepseek_r1: DeepSeek-R1 may start thinking without writing `<think>` (its template may put it in
  the prompt): everything before `</think>` is reasoning, and no `</think>` at all means all
  reasoning, as vLLM's deepseek_r1 parser does.

SmolLM3's template lets the model write `<think>` in its thinking mode and puts an empty block,
`<think>\\n\\n</think>\\n`, in the prompt with enable_thinking false or `/no_think` (read from the
prompt: all content). vLLM has no parser of its own for it; its users serve it with `deepseek_r1`,
so `smollm3` is accepted here as a name for that parser.
"""
from __future__ import annotations

from iterserve.server.reasoning.base import ReasoningParser, register
from iterserve.thinking import Phase


class ThinkTagParser(ReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)


@register("qwen3")
class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"
    neutral_phase = Phase.UNDECIDED


@register("deepseek_r1", "smollm3")
class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    neutral_phase = Phase.THINKING
