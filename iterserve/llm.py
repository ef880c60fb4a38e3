"""The offline API: `LLM(model="smollm2-135m").generate(prompts, params)` runs an LLMEngine until
every prompt is answered, in the caller's thread."""
from __future__ import annotations

from dataclasses import dataclass, field

from tqdm.auto import tqdm

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.request import RequestTimes
from iterserve.sampling import SamplingParams


@dataclass
class CompletionResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    times: RequestTimes
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: per prompt token, the first None
    embedding: list[float] | None = None  # SamplingParams.pooling: the normalised vector
    error: str | None = None  # why it ended, when the engine failed it (finish_reason "error")


class LLM:
    """Offline batch generation: `LLM(model="smollm2-135m").generate(prompts, params)`; embeddings
    with `params=SamplingParams(pooling=PoolingParams())` (each result's `embedding`)."""

    def __init__(self, model: str = "smollm2-135m", loaded=None, config: EngineConfig | None = None,
                 **engine_kwargs) -> None:
        self.engine = LLMEngine(config or EngineConfig(model=model, **engine_kwargs), loaded=loaded)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None) -> list[CompletionResult]:
        """Each prompt is a string, a list of token ids, or {"messages": [...]} for chat."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            kw = {"priority": priorities[i]} if priorities else {}
            if isinstance(p, dict):
                req = self.engine.add_request(params=sp, messages=p["messages"], **kw)
            elif isinstance(p, list):
                req = self.engine.add_request(params=sp, prompt_token_ids=p, **kw)
            else:
                req = self.engine.add_request(p, sp, **kw)
            ids.append(req.request_id)
        return self.run_until_done(ids, use_tqdm)

    def run_until_done(self, ids: list[str], use_tqdm: bool = False) -> list[CompletionResult]:
        reqs = {i: self.engine.requests[i] for i in ids}
        done: dict[str, CompletionResult] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in reqs:
                    r = reqs[out.request_id]
                    done[out.request_id] = CompletionResult(
                        r.request_id, r.output_text, list(r.output_token_ids), r.finish_reason,
                        r.num_prompt_tokens, r.num_output_tokens, r.times, r.logprobs,
                        r.prompt_logprobs if r.params.prompt_logprobs is not None else None, r.embedding,
                        r.error)
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
