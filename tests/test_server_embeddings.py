"""/v1/embeddings, and /v1/completions' echo + logprobs and prompt_logprobs, with the official openai
client against the app `iterserve serve` builds (tests/app_server.py), on the tiny random-weight model
in float32.

- Each embedding equals transformers' final hidden state pooled the same way (last token by default;
  mean from the model folder's own sentence-transformers config), L2-normalised, within 1e-5 cosine;
  `dimensions` truncates then normalises again where the model says it may; base64 and float agree.
- Embeddings and generation mixed in one 16-request burst all complete, share steps, stay within the
  token budget, free every block, and leave the generated texts as they are alone.
- echo + logprobs: the prompt's tokens with transformers' per-token log-softmax (the first null),
  then the completion's, streamed or not; prompt_logprobs in vLLM's format; a prompt whose blocks are
  cached is computed again for the logits it needs.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from app_server import AppServer

from iterserve.llm import LLM
from iterserve.sampling import SamplingParams

MODEL = "tiny"
BUDGET = 64  # --max-num-batched-tokens: long inputs are computed in several chunks
SERVE_ARGS = ["--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--max-model-len", "512",
              "--max-num-batched-tokens", str(BUDGET)]
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.",
         " ".join(f"sentence {i} about the river and the town." for i in range(20))]  # ~180 tokens: 3 chunks


def tokens(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


@torch.inference_mode()
def hf_pooled(hf, ids: list[int], method: str) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) pooled and L2-normalised."""
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    vec = hidden[-1] if method == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vec.float(), dim=0)


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32),
                                                 torch.as_tensor(b, dtype=torch.float32), dim=0).item()


def wait_idle(http: httpx.Client) -> dict:
    for _ in range(250):
        snap = http.get("/v1/scheduler").json()
        if snap["running"] == 0 and snap["waiting"] == 0 and snap["kv_cache"]["used_blocks"] == 0:
            return snap
        time.sleep(0.02)
    raise AssertionError(f"server not idle: {snap}")


# ---- embeddings ---------------------------------------------------------------------------------------------
def test_embeddings_equal_transformers_last_token(client, http, hf_tiny):
    out = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in out.data] == [0, 1, 2]
    ids = [tokens(http, t) for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    assert len(ids[2]) > 2 * BUDGET
    for d, one in zip(out.data, ids):
        assert len(d.embedding) == 64 and abs(np.linalg.norm(d.embedding) - 1) < 1e-5
        assert cosine(d.embedding, hf_pooled(hf_tiny, one, "last")) > 1 - 1e-5
    # the same vectors as floats, from token ids, one by one or as a batch
    floats = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    single = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert np.allclose(np.frombuffer(__import__("base64").b64decode(raw["data"][0]["embedding"]), "<f4"),
                       floats.data[0].embedding, atol=1e-6)
    for a, b in zip(out.data, floats.data):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    assert np.allclose(single.data[0].embedding, floats.data[1].embedding, atol=1e-6)
    wait_idle(http)


@pytest.mark.parametrize("body,status,param,message", [
    ({"input": ""}, 400, "input", "empty"),
    ({"input": ["ok", ""]}, 400, "input", "input[1]"),
    ({"input": []}, 400, "input", "empty"),
    ({"input": [[]]}, 400, "input", "empty"),
    ({"input": [5, 10**9]}, 400, "input", "outside the vocabulary"),
    ({"input": list(range(600))}, 400, "input", "512"),
    ({"input": "x", "dimensions": 8}, 400, "dimensions", "does not support dimensions"),
    ({"input": "x", "encoding_format": "binary"}, 400, "encoding_format", None),
    ({"input": "x", "model": "other"}, 404, "model", None),
    ({"input": 5}, 400, "input", None),
])
def test_embedding_errors(http, body, status, param, message):
    resp = http.post("/v1/embeddings", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"].startswith(param) and (message is None or message in err["message"]), err


def test_model_pooling_config_mean_and_matryoshka(tiny_model_dir, tiny_loaded, tmp_path, hf_tiny):
    """A folder with sentence-transformers' modules.json and 1_Pooling/config.json (mean) and a
    matryoshka config: the server pools by the model's own config, and `dimensions` truncates then
    normalises again."""
    folder = tmp_path / "tiny-embed"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 32, 64]}))
    with AppServer([str(folder), *SERVE_ARGS], tiny_loaded) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0,
                               http_client=srv.client(timeout=60))
        full = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        short = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16)
        with srv.client() as http:
            ids = [tokens(http, t) for t in TEXTS]
            bad = http.post("/v1/embeddings", json={"input": "x", "dimensions": 20})
            assert http.get("/v1/scheduler").json()["config"]["embedding_pooling"] == "mean"
    assert bad.status_code == 400 and "[16, 32, 64]" in bad.json()["error"]["message"]
    for f, s, one in zip(full.data, short.data, ids):
        ref = hf_pooled(hf_tiny, one, "mean")
        assert cosine(f.embedding, ref) > 1 - 1e-5
        assert len(s.embedding) == 16 and abs(np.linalg.norm(s.embedding) - 1) < 1e-5
        assert cosine(s.embedding, ref[:16]) > 1 - 1e-5


def test_pooling_flag_and_unsupported_pooling(tiny_loaded, tmp_path):
    """--pooling wins over the folder's config; a pooling iterserve cannot compute refuses embeddings
    (and nothing else)."""
    from iterserve.pooling import resolve_pooling

    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    assert resolve_pooling(None, tmp_path).method is None and "pooling_mode_max_tokens" in \
        resolve_pooling(None, tmp_path).error
    assert resolve_pooling("last", tmp_path).method == "last"
    assert resolve_pooling(None, None).method == "last"
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    assert "Dense" in resolve_pooling(None, tmp_path).error and resolve_pooling("mean", tmp_path).method is None
    llm = LLM(loaded=tiny_loaded, kv_cache_memory="16MiB", pooling="cls")
    from iterserve.pooling import PoolingParams

    llm.engine.add_request(params=SamplingParams(max_tokens=1, pooling=PoolingParams()), prompt_token_ids=[5, 6, 7],
                           request_id="e")
    outs = [o for _ in range(5) for o in llm.engine.step()]
    assert outs[-1].finished and len(outs[-1].embedding) == 64 and outs[-1].num_output_tokens == 0


def test_embeddings_and_generation_in_one_burst(server, client, http):
    """16 requests at once, 8 generating and 8 embedding: every one completes, steps hold both kinds,
    no step exceeds the token budget, every block is free afterwards, and the generated texts are
    those each prompt gets alone."""
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    embed_alone = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data
    before = http.get("/v1/scheduler").json()["step"]

    async def burst():
        async with server.async_client(timeout=60) as aclient:
            gen = [asyncio.ensure_future(aclient.post("/v1/completions", json={"prompt": p, "max_tokens": 24,
                                                                               "temperature": 0, "ignore_eos": True}))
                   for p in prompts]
            await asyncio.sleep(0.05)  # the generations decode while the embeddings arrive
            emb = [asyncio.ensure_future(aclient.post("/v1/embeddings", json={"input": TEXTS[i % 3],
                                                                             "encoding_format": "float"}))
                   for i in range(8)]
            return await asyncio.gather(*gen), await asyncio.gather(*emb)

    gen, emb = server.run(burst())
    assert all(r.status_code == 200 for r in gen + emb), [r.text for r in gen + emb if r.status_code != 200]
    assert [r.json()["choices"][0]["text"] for r in gen] == alone
    for i, r in enumerate(emb):
        assert np.allclose(r.json()["data"][0]["embedding"], embed_alone[i % 3].embedding, atol=1e-5)
    snap = wait_idle(http)
    steps = [s for s in http.get("/v1/scheduler", params={"since_step": before}).json()["steps"]]
    assert all(s["prefill_tokens"] + s["decode_tokens"] <= BUDGET for s in steps)
    shared = [s for s in steps if s["decode_tokens"] and any(a["request_id"].startswith("embd-")
                                                             for a in s["admitted"])]
    assert shared, "no step ran an embedding's prompt next to decoding requests"
    assert snap["kv_cache"]["used_blocks"] == 0


# ---- echo, logprobs and prompt logprobs --------------------------------------------------------------------
@torch.inference_mode()
def hf_token_logprobs(hf, ids: list[int]) -> list[float]:
    lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[p, ids[p + 1]].item() for p in range(len(ids) - 1)]


def test_echo_logprobs_equal_transformers(client, http, hf_tiny):
    prompt = TEXTS[2]
    ids = tokens(http, prompt)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    out = client.completions.create(**kw)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_token_logprobs(hf_tiny, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], ref)) < 1e-4
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens[len(ids):]) == choice.text[len(prompt):]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4
    # streamed: the echo comes first, then the same tokens and logprobs
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    # echo without logprobs; as lm-evaluation-harness sends it (token ids, one token, logprobs 1)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    harness = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                        logprobs=1, seed=1234)
    assert harness.choices[0].logprobs.token_logprobs[:len(ids)] == lp.token_logprobs[:len(ids)]
    assert harness.choices[0].text.startswith(prompt)


def test_prompt_logprobs_vllm_format_and_prefix_cache(client, http, hf_tiny):
    """prompt_logprobs: null first, then the prompt token's logprob and rank and the top k. The prompt's
    blocks are in the prefix cache after the first request; the second still computes every logit."""
    prompt = TEXTS[2] + " and more"
    ids = tokens(http, prompt)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # caches the prompt's blocks
    before = http.get("/v1/scheduler").json()["prefix_cache"]["hits"]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 3})
    assert http.get("/v1/scheduler").json()["prefix_cache"]["hits"] == before  # took no cached block
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = hf_token_logprobs(hf_tiny, ids)
    for i, entry in enumerate(plp[1:]):
        mine = entry[str(ids[i + 1])]
        assert abs(mine["logprob"] - ref[i]) < 1e-4 and mine["rank"] >= 1
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:3] == [1, 2, 3] or mine["rank"] <= 3
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 3})
    assert again.choices[0].model_extra["prompt_logprobs"] == plp
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) == \
        chat.usage.prompt_tokens
    wait_idle(http)
