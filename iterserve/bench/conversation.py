"""Multi-turn chat traffic: N concurrent conversations, over one shared system prompt or one each.

Real chat traffic repeats itself: every turn of a conversation resends the system prompt and the
whole history, and many users share one system prompt. This is the traffic a prefix cache is for.
With `system_prompts="distinct"` each conversation has a system prompt (a reference document) of its
own, so conversations share no prefix block and only a conversation's own history can hit: the case
where which replica a conversation goes to decides its hit rate.

Each conversation is closed loop within itself and open across conversations: a conversation
starts at its own offset, sends turn 1, streams the answer, appends the answer to its history,
waits its think time, then sends turn 2 with the grown history, and so on. The conversations run
concurrently, so the server sees N interleaved, growing prefixes. Works against any
OpenAI-compatible server: the chat endpoint sends the messages; the completions endpoint sends
them flattened into one prompt (same prefix growth, no chat template).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx
import numpy as np
from tqdm import tqdm

from iterserve.bench.client import (CONNECT_TIMEOUT_S, GRACE_S, ClientError, RequestRecord, RunResult,
                                    api_root, prefix_cache_counters, prefix_cache_delta, resolve_served_model,
                                    stream_request)
from iterserve.bench.workload import WORDS_PER_TOKEN, LenSpec, WorkloadError, prose_source, sample_lengths


SYSTEM_PROMPTS = ("shared", "distinct")
SYSTEM_PREAMBLE = "You are a helpful assistant. Use the following reference text.\n\n"


@dataclass
class ConversationOptions:
    """Everything that shapes the multi-turn workload (the bench CLI's `--conversations` etc.)."""

    num_conversations: int = 8
    turns: int = 6
    system_prompt_len: int = 400  # tokens of each conversation's system prompt
    system_prompts: str = "shared"  # "shared": one for all conversations; "distinct": one each
    user_len: LenSpec = (32, 96)  # tokens of each new user message
    output_len: LenSpec = 64  # max_tokens of each answer
    think_time_s: float = 1.0  # mean pause between an answer and the next turn (exponential)
    stagger_s: float = 2.0  # conversations start uniformly spread over [0, stagger_s]
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_conversations", "turns", "system_prompt_len"):
            if int(getattr(self, name)) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompts not in SYSTEM_PROMPTS:
            raise WorkloadError(f"system_prompts must be one of {', '.join(SYSTEM_PROMPTS)}, "
                                f"got {self.system_prompts!r}")
        if self.think_time_s < 0 or self.stagger_s < 0:
            raise WorkloadError("think time and stagger must be >= 0")


@dataclass
class Conversation:
    index: int
    start_s: float
    system_prompt: str
    user_turns: list[str]
    output_lens: list[int]
    think_s: list[float]  # pause after each answer (the last one is unused)
    history: list[dict[str, str]] = field(default_factory=list)


def build_conversations(opts: ConversationOptions, tokenizer: Any = None) -> list[Conversation]:
    """The conversations' fixed parts: start offsets, the system prompt(s), each turn's user
    message, answer length and think time, all from `opts.seed`."""
    rng = np.random.default_rng(opts.seed)
    source = prose_source(tokenizer)
    offsets = system_prompt_offsets(opts, source.size)
    n, t = opts.num_conversations, opts.turns
    starts = np.sort(rng.uniform(0.0, opts.stagger_s, n)) if opts.stagger_s else np.zeros(n)
    user_lens = sample_lengths(opts.user_len, n * t, rng, "user_len").reshape(n, t)
    out_lens = sample_lengths(opts.output_len, n * t, rng, "output_len").reshape(n, t)
    thinks = rng.exponential(opts.think_time_s, (n, t)) if opts.think_time_s else np.zeros((n, t))
    convs = []
    for c in range(n):
        users = [source.text(int(user_lens[c, k]), int(rng.integers(0, source.size))) for k in range(t)]
        system = SYSTEM_PREAMBLE + source.text(opts.system_prompt_len, offsets[c])
        convs.append(Conversation(c, float(starts[c]), system, users, [int(x) for x in out_lens[c]],
                                  [float(x) for x in thinks[c]]))
    return convs


def system_prompt_offsets(opts: ConversationOptions, text_size: int) -> list[int]:
    """Where in the prose each conversation's system prompt starts: 0 for all when shared; distinct
    ones at offsets spread evenly over the text (never 0, so none equals the shared one) and so far
    apart that no two share a leading block. Not drawn from the seed's generator, whose draws (and so
    the other parts of the conversations) stay the same whichever kind of system prompt is chosen."""
    n = opts.num_conversations
    if opts.system_prompts == "shared":
        return [0] * n
    return [1 + (c * (text_size - 1)) // n for c in range(n)]


def _messages(conv: Conversation, turn: int) -> list[dict[str, str]]:
    return ([{"role": "system", "content": conv.system_prompt}] + conv.history
            + [{"role": "user", "content": conv.user_turns[turn]}])


ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}
PROMPT_TAIL = "Assistant:"  # the flattened prompt ends here: the answer follows


def _message_text(role: str, content: str) -> str:
    return f"{ROLE_NAMES[role]}: {content}\n\n"


def _flatten(messages: Sequence[dict[str, str]]) -> str:
    """The completions endpoint's prompt: the same growing prefix, without a chat template."""
    return "".join(_message_text(m["role"], m["content"]) for m in messages) + PROMPT_TAIL


@dataclass(frozen=True)
class ConversationFraming:
    """Tokens a flattened prompt carries beyond its nominal lengths (the system prompt's, each user
    message's, each answer's): the preamble and "System: ... \\n\\n" around the system prompt, "User:
    ... \\n\\nAssistant:" around each user message, " ... \\n\\n" around each answer sent back. The
    simulator adds them to the conversations it plans (sim/simulator.py `conversation_plans`), so
    its prompts are as long as the ones the server is sent."""

    system: int = 0
    user: int = 0
    answer: int = 0


def conversation_framing(tokenizer: Any = None, samples: int = 8) -> ConversationFraming:
    """Counts the framing with `tokenizer` on this module's own texts (mean over a few samples,
    each piece tokenised alone: a merge across a boundary can shift one token); without one, by
    the word estimate the prose source uses when it has no tokenizer (0.75 words a token)."""
    source = prose_source(tokenizer)
    if tokenizer is not None:
        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))
    else:
        def count(text: str) -> int:
            return round(len(text.split()) / WORDS_PER_TOKEN)
    n, sys_x, user_x, ans_x = 64, [], [], []
    for k in range(samples):
        body = source.text(n, 997 * k + 13)
        nominal = count(body)
        sys_x.append(count(_message_text("system", SYSTEM_PREAMBLE + body)) - nominal)
        user_x.append(count(_message_text("user", body) + PROMPT_TAIL) - nominal)
        ans_x.append(count(" " + _message_text("assistant", body).split(": ", 1)[1]) - nominal)
    mean = lambda xs: max(0, round(sum(xs) / len(xs)))  # noqa: E731
    return ConversationFraming(mean(sys_x), mean(user_x), mean(ans_x))


def turn_body(conv: Conversation, turn: int, model: str, chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": conv.output_lens[turn], "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    messages = _messages(conv, turn)
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = _flatten(messages)
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def run_conversations(base_url: str, convs: Sequence[Conversation], model: str | None = None,
                            endpoint: str = "chat", api_key: str | None = None,
                            timeout_s: float | None = None, ignore_eos: bool = True,
                            progress: bool = True) -> RunResult:
    """Runs every conversation to its last turn; one RequestRecord per turn (its `conversation`
    and `turn` set). The run's meta carries the prefix-cache hit rate when the server's /metrics
    exposes vLLM's prefix_cache_queries / prefix_cache_hits counters (iterserve and vLLM do)."""
    if endpoint not in ("completions", "chat"):
        raise ClientError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    root = api_root(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    total_turns = sum(len(c.user_turns) for c in convs)
    if timeout_s is None:
        timeout_s = max((c.start_s + sum(c.think_s) for c in convs), default=0.0) + GRACE_S
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=root, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)) as http:
        model = await resolve_served_model(http, model)
        before = await prefix_cache_counters(http)
        bar = tqdm(total=total_turns, disable=not progress, unit="turn", desc="bench")
        t0 = time.perf_counter()

        async def talk(conv: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
            for turn in range(len(conv.user_turns)):
                body = turn_body(conv, turn, model, endpoint == "chat", ignore_eos)
                rec = RequestRecord(len(records), time.perf_counter() - t0,
                                    _approx_tokens(body), conv.output_lens[turn],
                                    conversation=conv.index, turn=turn)
                records.append(rec)
                text: list[str] = []
                await stream_request(http, path, body, rec, t0, text_sink=text)
                bar.update(1)
                if not rec.success:
                    return  # a conversation cannot go on without its answer
                conv.history += [{"role": "user", "content": conv.user_turns[turn]},
                                 {"role": "assistant", "content": "".join(text)}]
                if turn + 1 < len(conv.user_turns):
                    await asyncio.sleep(conv.think_s[turn])

        tasks = [asyncio.create_task(talk(c)) for c in convs]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)
        except TimeoutError:
            pass  # wait_for cancelled the rest; their records say so
        duration = time.perf_counter() - t0
        bar.close()
        after = await prefix_cache_counters(http)
    result = RunResult(root, model, endpoint, duration, records, started_at=t0)
    result.meta["prefix_cache"] = prefix_cache_delta(before, after)
    result.meta["later_turns"] = later_turn_stats(records)
    return result


def _approx_tokens(body: dict[str, Any]) -> int:
    """Words / 0.75: the record's input_len until the server's usage says the exact count."""
    text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
    return max(1, round(len(text.split()) / 0.75))


def later_turn_stats(records: Sequence[RequestRecord]) -> dict[str, float | int | None]:
    """TTFT of turns after the first: the requests whose prefix a cache could hold."""
    ttfts = [r.ttft_s * 1e3 for r in records if r.success and r.turn and r.ttft_s is not None]
    if not ttfts:
        return {"count": 0, "ttft_p50_ms": None, "ttft_p95_ms": None}
    p50, p95 = np.percentile(ttfts, (50, 95))
    return {"count": len(ttfts), "ttft_p50_ms": float(p50), "ttft_p95_ms": float(p95)}
