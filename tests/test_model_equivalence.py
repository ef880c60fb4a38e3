"""iterserve's model against transformers, token for token.

- The embedded SmolLM2-135M (Q4_1 GGUF) against `AutoModelForCausalLM.from_pretrained(folder,
  gguf_file=...)`: greedy ids for 9 chats x 64 tokens through the engine, and the logits of every
  generated position (prefill path through the runner) and the engine's per-step logprobs (decode
  path) within 1e-3.
- Tiny random-weight Hugging Face folders saved by transformers: plain (GQA 4/2, untied head,
  llama3 rope scaling), sharded safetensors, a pre-transformers-5 config (rope_theta + rope_scaling,
  list of eos ids, torch_dtype), bf16 weights, Llama with attention_bias (q/k/v/o biases), and a
  Qwen2 (q/k/v biases only, tied head).
- A step mixing full prefills, a prefill chunk and decodes gives each sequence the logits it gets alone.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TINY_CONFIG
from model_utils import chat_ids, hf_greedy, make_request, new_runner, run_step, sequence_logits

from iterserve.llm import LLM
from iterserve.model.loader import checkpoint_dtype, load_model, resolve_model
from iterserve.sampling import SamplingParams
from iterserve.testing import CHATS

NEW_TOKENS = 64
LONG_CHAT = [{"role": "user", "content": "Summarise this text. " + " ".join(
    f"Sentence {i} says that the river {i % 7} flows past the town of number {i * 13 % 97}." for i in range(30))}]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_against_hf(loaded, hf_model, chats: list[list[dict]], logit_tol: float) -> None:
    """Greedy ids equal; logits at every generated position and decode-step logprobs within tol."""
    tok = loaded[2]
    llm = LLM(loaded=loaded, kv_cache_memory="128MiB")
    prompts = [llm.engine.encode_prompt(messages=m) for m in chats]
    for m, p in zip(chats, prompts):  # the engine's template + encode == transformers' tokenising template
        assert p == chat_ids(tok, m)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    results = llm.generate([{"messages": m} for m in chats], params, use_tqdm=False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ref_ids, ref_logits = hf_greedy(hf_model, prompts, NEW_TOKENS, pad)
    for i, (res, ref) in enumerate(zip(results, ref_ids)):
        assert len(res.token_ids) == NEW_TOKENS
        assert res.token_ids == ref, f"chat {i}: first difference at token {first_difference(res.token_ids, ref)}"
    for i, (res, prompt) in enumerate(zip(results, prompts)):
        ours = sequence_logits(loaded, prompt + res.token_ids[:-1])[len(prompt) - 1:]
        diff = (ours - ref_logits[i]).abs().max().item()
        assert diff < logit_tol, f"chat {i}: logits differ by {diff:.2e}"
        ref_lp = ref_logits[i].log_softmax(-1)[torch.arange(NEW_TOKENS), torch.tensor(res.token_ids)]
        our_lp = torch.tensor([lp[0] for lp in res.logprobs])
        diff = (our_lp - ref_lp).abs().max().item()
        assert diff < logit_tol, f"chat {i}: decode logprobs differ by {diff:.2e}"


def check_mixed_batch(loaded, block_size: int, tol: float) -> None:
    """One step with two full prefills, a second prefill chunk and two decodes (then a decode-only
    step) gives every sequence the same last-token logits as a prefill of it alone."""
    tok = loaded[2]
    text = " ".join(f"item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} coins." for i in range(40))
    ids = tok.encode(text, add_special_tokens=False)
    lengths = {"a": 37, "b": 5, "c": 20, "d": 33, "e": 50}
    seqs = {k: ids[3 * j: 3 * j + n] for j, (k, n) in enumerate(lengths.items())}
    reqs = {k: make_request(k, v) for k, v in seqs.items()}
    runner = new_runner(loaded, num_blocks=-(-300 // block_size), block_size=block_size)
    run_step(runner, [(reqs["c"], 19), (reqs["d"], 32), (reqs["e"], 30)])
    mixed = run_step(runner, [(reqs["a"], 37), (reqs["b"], 5), (reqs["c"], 1), (reqs["d"], 1), (reqs["e"], 20)])
    for row, k in enumerate("abcde"):
        alone = sequence_logits(loaded, seqs[k])[-1]
        diff = (mixed[row] - alone).abs().max().item()
        assert diff < tol, f"sequence {k} in a mixed batch: logits differ by {diff:.2e} from alone"
    # every request grows by its greedy token; then one decode-only step over all five
    for row, k in enumerate("abcde"):
        reqs[k].output_token_ids.append(int(mixed[row].argmax()))
    decode = run_step(runner, [(reqs[k], 1) for k in "abcde"])
    for row, k in enumerate("abcde"):
        alone = sequence_logits(loaded, reqs[k].all_token_ids)[-1]
        diff = (decode[row] - alone).abs().max().item()
        assert diff < tol, f"sequence {k} in a decode batch: logits differ by {diff:.2e} from alone"


# ---- the embedded model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoModelForCausalLM

    src = resolve_model("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(str(src.folder), gguf_file=src.path.name,
                                                dtype=torch.float32).eval()


@pytest.mark.real_model
def test_smollm2_greedy_and_logits_match_transformers(smol_loaded, hf_smol):
    check_against_hf(smol_loaded, hf_smol, CHATS, logit_tol=1e-3)


@pytest.mark.real_model
def test_smollm2_mixed_batch_matches_each_alone(smol_loaded):
    check_mixed_batch(smol_loaded, block_size=16, tol=1e-4)


# ---- tiny random-weight Hugging Face folders ---------------------------------------------------------
def _randomise(model) -> None:
    """As conftest's tiny model: large random weights, so that greedy choices are not near-ties."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 1.0 if "embed" in name else 0.25)


def _save_variant(kind: str, base_dir, out_dir, tokenizer) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if kind == "attention_bias":  # Llama's attention_bias: biases on q, k, v and o
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "attention_bias": True}))
        _randomise(model)
        model.save_pretrained(out_dir)
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rope_theta=1e6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))
        _randomise(model)
        model.save_pretrained(out_dir)
    elif kind == "sharded":
        AutoModelForCausalLM.from_pretrained(base_dir).save_pretrained(out_dir, max_shard_size="5MB")
    elif kind == "bf16":
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).save_pretrained(out_dir)
    elif kind == "legacy_config":
        shutil.copytree(base_dir, out_dir, dirs_exist_ok=True)
        (out_dir / "generation_config.json").unlink(missing_ok=True)
        cfg = json.loads((out_dir / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        cfg["eos_token_id"] = [2, 0]
        cfg["torch_dtype"] = cfg.pop("dtype", "float32")
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def variant_dir(tiny_model_dir, tiny_loaded, tmp_path_factory):
    """variant_dir(kind) -> a folder holding that variant of the tiny model, saved once per module."""
    made = {"plain": tiny_model_dir}

    def get(kind: str):
        if kind not in made:
            made[kind] = tmp_path_factory.mktemp(f"tiny-{kind}")
            _save_variant(kind, tiny_model_dir, made[kind], tiny_loaded[2])
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["plain", "sharded", "legacy_config", "bf16", "attention_bias", "qwen2"])
def test_tiny_folder_matches_transformers(kind, variant_dir, tiny_loaded):
    from transformers import AutoModelForCausalLM

    folder = variant_dir(kind)
    if kind == "plain":
        loaded = tiny_loaded
    else:
        model, cfg, tok, _ = load_model(str(folder))
        loaded = (model, cfg, tok)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = loaded[1]
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    if kind == "qwen2":
        assert cfg.attention_bias and not cfg.o_proj_bias and cfg.tie_word_embeddings
    else:
        assert cfg.attention_bias == cfg.o_proj_bias == (kind == "attention_bias")
        assert not cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "llama3"
    if kind == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    if kind == "legacy_config":
        assert cfg.eos_token_ids == (2, 0) and cfg.rope_theta == 10000.0
    if kind == "bf16":
        assert checkpoint_dtype(resolve_model(str(folder))) == torch.bfloat16
        assert loaded[0].lm_head.weight.dtype == torch.float32  # upcast on load
    check_against_hf(loaded, hf, CHATS + [LONG_CHAT], logit_tol=1e-3)


def test_bf16_folder_loads_as_stored_when_asked(variant_dir):
    model, _, _, _ = load_model(str(variant_dir("bf16")), dtype=None)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary[0].cos.dtype == torch.float32  # rope tables stay in float32


@pytest.mark.parametrize("block_size", [1, 16])
def test_tiny_mixed_batch_matches_each_alone(tiny_loaded, block_size):
    check_mixed_batch(tiny_loaded, block_size=block_size, tol=1e-4)
