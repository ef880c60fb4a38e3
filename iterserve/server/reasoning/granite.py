"""IBM Granite 3.x: "Here is my thought process:" ... "Here is my response:" (vLLM's `granite`).

The markers are plain text, not special tokens, and quantised models were seen writing "Here's"
for "Here is" (vLLM matches both; so does this parser). Thinking happens only when the request
asks for it (`chat_template_kwargs: {"thinking": true}`), and then the model begins with the
thought-process marker: an output that does not is all content. One difference from vLLM: an output
with the thought-process marker and no response marker is all reasoning here (vLLM's non-streamed
parse calls it content, while its stream sends it as reasoning); here both agree.
"""
from __future__ import annotations

from iterserve.server.reasoning.base import ReasoningParser, register
from iterserve.thinking import Phase


@register("granite")
class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
    neutral_phase = Phase.UNDECIDED
