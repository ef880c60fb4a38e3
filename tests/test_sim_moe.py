"""The simulator and planner on mixture-of-experts models (sim/moe.py): a step reads each distinct
expert its tokens were routed to once, so decode step time grows with the distinct experts B rows
touch. Checked here: the uniform-routing expectation against a Monte-Carlo of that routing; the
measured curve's interpolation; `profile` on a tiny random MoE (made by transformers, as
tests/test_moe.py makes them) counting the router's experts per step; the step models' MoE term
(fitted, roofline) and a dense model of the same active size without it; `simulate` and `plan`
end to end on an MoE profile; profiles written before the term still loading.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_model_families import _save_family
from test_moe import MOE_FAMILIES

from iterserve.cli import main
from iterserve.config import EngineConfig
from iterserve.bench.workload import poisson
from iterserve.model.loader import load_model
from iterserve.sim.analytic import MODEL_SHAPES, analytic_profile, shape_config
from iterserve.sim.measure import ProfileGrid, measure_profile
from iterserve.sim.moe import MoeRouting, uniform_distinct
from iterserve.sim.profile import Profile
from iterserve.sim.simulator import simulate
from iterserve.sim.step_model import FEATURES, SHARED_FEATURES, LinearStepModel, StepFeatures, model_from_dict


@pytest.mark.parametrize("experts,k", [(8, 2), (40, 8), (64, 8), (128, 8)])
def test_uniform_distinct_experts_match_a_monte_carlo_of_uniform_routing(experts, k):
    rng = np.random.default_rng(0)
    trials = 1000
    for rows in (1, 2, 4, 16, 64):
        # each row's k experts: the k smallest of E uniform keys (every k-subset alike)
        ids = np.argpartition(rng.random((trials * rows, experts)), k, axis=1)[:, :k]
        hit = np.zeros((trials, experts), dtype=bool)
        hit[np.repeat(np.arange(trials), rows)[:, None], ids] = True
        seen = hit.sum(axis=1)
        mean, sem = seen.mean(), seen.std() / np.sqrt(trials)
        expect = uniform_distinct(rows, experts, k)
        assert abs(mean - expect) <= 4 * sem + 1e-3 * experts, (rows, mean, expect)
    assert uniform_distinct(1, experts, k) == pytest.approx(k) and uniform_distinct(0, experts, k) == 0
    assert uniform_distinct(10_000, experts, k) == pytest.approx(experts)


def test_measured_curve_scales_the_uniform_expectation_and_never_exceeds_the_experts():
    moe = MoeRouting(num_experts=40, top_k=8, moe_layers=2, expert_bytes=1.0,
                     curve=[[1.0, 8.0], [8.0, 0.8 * uniform_distinct(8, 40, 8)]])
    assert moe.per_layer(1) == pytest.approx(8.0)
    assert moe.per_layer(8) == pytest.approx(0.8 * uniform_distinct(8, 40, 8))
    between = (1.0 + 0.8) / 2  # halfway in tokens, halfway in the ratio
    assert moe.per_layer(4.5) == pytest.approx(between * uniform_distinct(4.5, 40, 8))
    assert moe.per_layer(1000) == pytest.approx(0.8 * 40)  # the last ratio holds beyond the curve
    assert moe.step_experts(8) == pytest.approx(2 * moe.per_layer(8))  # summed over the MoE layers
    skewed_up = MoeRouting(40, 8, 1, 1.0, curve=[[4.0, 1.5 * uniform_distinct(4, 40, 8)]])
    assert skewed_up.per_layer(1000) == 40  # at most E
    assert MoeRouting.from_dict(json.loads(json.dumps(moe.to_dict()))) == moe
    # a step's decode rows and prompt tokens: independent sets, E - (E - d)(E - p)/E per layer
    chunked = MoeRouting(40, 8, 1, 1.0, prefill_curve=[[64.0, 20.0]])
    assert chunked.per_layer(64, chunked.prefill_curve) == pytest.approx(20.0)
    d = chunked.per_layer(4)
    assert chunked.step_experts(4, 64) == pytest.approx(40 - (40 - d) * (40 - 20) / 40)
    assert chunked.step_experts(0, 64) == pytest.approx(20.0) and chunked.step_experts(4, 0) == pytest.approx(d)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """Qwen3-MoE, 3 layers (layer 1 dense), 8 experts, top-2: two MoE layers."""
    folder = tmp_path_factory.mktemp("qwen3_moe_sim")
    _save_family(folder, *MOE_FAMILIES["qwen3_moe"])
    return folder


def test_expert_counter_is_off_unless_turned_on(tiny_moe_dir):
    from iterserve.model.moe import count_experts

    model, cfg, _, _ = load_model(str(tiny_moe_dir), torch.float32)
    block = model.layers[0].mlp
    with torch.inference_mode():
        block(torch.randn(3, cfg.hidden_size))
        assert block.expert_counts is None
        counters = count_experts(model)
        assert len(counters) == 2  # the dense layer has none
        block(torch.randn(1, cfg.hidden_size))
    assert counters[0] == [2] and counters[1] == []


def test_profile_of_a_tiny_moe_records_the_routers_experts(tiny_moe_dir, tmp_path):
    grid = ProfileGrid(decode_batches=[1, 2, 4, 8], context_lens=[16, 48], prefill_chunks=[16], chunk_context=16,
                       mixed_decode=[2], mixed_chunks=[16], later_chunks=[16], shared_prefix=0)
    cfg = EngineConfig(model=str(tiny_moe_dir), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    prof = measure_profile(cfg, grid, repeats=1, progress=False)
    moe = prof.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.moe_layers) == (8, 2, 2)
    hidden, inter = prof.model_shape["hidden_size"], prof.model_shape["moe_intermediate_size"]
    assert moe.expert_bytes == 3 * hidden * inter * 4  # float32
    for s in prof.samples:  # every step: between k and E experts in each of the two MoE layers
        assert 2 * min(2, s["tokens"]) <= s["moe_experts"] <= 2 * min(8, 2 * s["tokens"]), s
    one_row = [s["moe_experts"] for s in prof.samples if s["seqs"] == 1 and not s["prefill_tokens"]]
    assert one_row and all(e == 4 for e in one_row)  # one token: its k experts in each layer, exactly
    # the curve: one point per decode batch size, growing with the rows, k at one row
    assert [b for b, _ in moe.curve] == [1, 2, 4, 8]
    per_layer = [d for _, d in moe.curve]
    assert per_layer[0] == 2 and all(a <= b for a, b in zip(per_layer, per_layer[1:])) and per_layer[-1] <= 8
    assert [t for t, _ in moe.prefill_curve] == [16] and 2 < moe.prefill_curve[0][1] <= 8  # the 16-token chunks
    assert "moe_experts" in prof.step_model.to_dict()["features"]
    prof.save(tmp_path / "moe.json")
    back = Profile.load(tmp_path / "moe.json")
    assert back.moe == moe and back.to_dict() == json.loads(json.dumps(prof.to_dict()))


def dense_twin(shape: dict) -> dict:
    """A dense shape of the same active size: one MLP as wide as the k experts a token uses."""
    d = {k: v for k, v in shape.items() if k not in ("num_local_experts", "num_experts", "num_experts_per_tok")}
    return {**d, "intermediate_size": shape["num_experts_per_tok"] * shape["intermediate_size"]}


def test_decode_step_time_grows_with_distinct_experts_and_a_dense_twin_has_no_such_term(tmp_path):
    shape = MODEL_SHAPES["granite-3b-a800m"]
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(dense_twin(shape)))
    moe_cfg, dense_cfg = shape_config(shape), shape_config(dense_twin(shape))
    router = moe_cfg.num_layers * moe_cfg.num_experts * moe_cfg.hidden_size
    assert moe_cfg.param_counts()[1] - router == dense_cfg.param_counts()[1]  # the same active parameters
    moe = analytic_profile("h100-80gb", "granite-3b-a800m")
    dense = analytic_profile("h100-80gb", str(tmp_path / "dense"))
    assert dense.moe is None and moe.moe is not None and moe.moe.curve == []  # analytic: uniform routing

    def decode(prof: Profile, rows: int) -> float:
        experts = prof.moe.step_experts(rows) if prof.moe else 0.0
        return prof.step_model.predict(StepFeatures(rows, rows, 0, rows * 256, 0.0, moe_experts=experts))

    # one row: both read the same weights (the k experts = the dense MLP); 32 rows: the MoE reads ~all 40
    assert decode(moe, 1) == pytest.approx(decode(dense, 1), rel=0.02)
    m = moe.step_model
    more_experts = moe.moe.step_experts(32) - moe.moe.step_experts(1)
    extra = m.expert_bytes * more_experts / (m.bandwidth * m.bandwidth_efficiency)
    assert decode(moe, 32) - decode(moe, 1) == pytest.approx(extra + (decode(dense, 32) - decode(dense, 1)), rel=0.01)
    assert decode(moe, 32) / decode(moe, 1) > 1.5 > 1.1 > decode(dense, 32) / decode(dense, 1)
    # saturated: beyond ~all experts, added rows read no more expert weights
    assert moe.moe.step_experts(256) == pytest.approx(moe.moe.step_experts(64), rel=1e-3)


def test_linear_fit_recovers_the_per_expert_price():
    """Steps generated with a known per-distinct-expert cost (decode batches, prompt chunks): the fit
    gives it back; a dense profile's column is all zero and its price 0."""
    moe = MoeRouting(num_experts=64, top_k=8, moe_layers=16, expert_bytes=1.0)
    truth = dict(const=2e-3, seqs=5e-5, tokens=2e-5, decode_kv=1e-7, moe_experts=4e-6)
    rows, secs = [], []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (128, 1024):
            rows.append(StepFeatures(b, b, 0, b * ctx, 0.0, moe_experts=moe.step_experts(b)))
    for chunk in (16, 64, 256, 1024):
        rows.append(StepFeatures(1, chunk, chunk, 0, chunk * chunk / 2e3, moe_experts=moe.step_experts(0, chunk)))
    for r in rows:
        secs.append(sum(c * r.row()[FEATURES.index(n)] for n, c in truth.items()))
    fit = LinearStepModel.fit(rows, secs)
    assert fit.coef[FEATURES.index("moe_experts")] == pytest.approx(truth["moe_experts"], rel=1e-3)
    dense_rows = [StepFeatures(r.seqs, r.tokens, r.prefill_tokens, r.decode_kv, r.prefill_kv_k) for r in rows]
    dense = LinearStepModel.fit(dense_rows, [s - truth["moe_experts"] * r.moe_experts for s, r in zip(secs, rows)])
    assert dense.coef[FEATURES.index("moe_experts")] == 0


def test_simulate_charges_each_step_its_expected_experts(monkeypatch):
    moe = MoeRouting(num_experts=40, top_k=8, moe_layers=32, expert_bytes=1.0)
    coef = [0.003, 1e-4, 1e-5, 0.0, 1e-8, 0.0, 0.0, 0.0, 1e-8, 0.0, 5e-6]
    with_moe = Profile(kind="measured", model="m", dtype="bfloat16", step_model=LinearStepModel(coef),
                       kv_bytes_per_token=1024, max_model_len=2048, moe=moe)
    seen = []
    real = LinearStepModel.predict
    monkeypatch.setattr(LinearStepModel, "predict", lambda self, f: seen.append(f) or real(self, f))
    specs = poisson(60, 20.0, seed=2, input_len=(16, 256), output_len=(8, 64))
    slow = simulate(specs, EngineConfig(max_num_seqs=16), with_moe).result.summary()
    assert seen and all(f.moe_experts == pytest.approx(moe.step_experts(f.tokens - f.prefill_tokens, f.prefill_tokens))
                        for f in seen)
    assert any(f.prefill_tokens and f.tokens > f.prefill_tokens for f in seen)  # mixed steps among them
    seen.clear()
    without = Profile(kind="measured", model="m", dtype="bfloat16", step_model=LinearStepModel(coef),
                      kv_bytes_per_token=1024, max_model_len=2048)
    fast = simulate(specs, EngineConfig(max_num_seqs=16), without).result.summary()
    assert all(f.moe_experts == 0 for f in seen)
    assert slow["e2e_ms"]["mean"] > fast["e2e_ms"]["mean"]


def test_simulate_and_plan_run_on_an_moe_profile(tmp_path, capsys):
    prof_path = tmp_path / "granite.json"
    assert main(["profile", "--analytic", "--gpu", "h100-80gb", "--model-shape", "granite-3b-a800m",
                 "--out", str(prof_path)]) == 0
    out = capsys.readouterr().out
    assert "MoE 40 experts top-8" in out and "experts: 40 experts, top-8, 32 MoE layers" in out
    assert main(["simulate", "--profile", str(prof_path), "--workload", "poisson", "--rate", "20",
                 "--num-requests", "80", "--input-len", "16:512", "--output-len", "8:64", "--max-num-seqs", "32",
                 "--result-json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["completed"] == 80
    assert main(["plan", "--profile", str(prof_path), "--workload", "poisson", "--num-requests", "150",
                 "--input-len", "16:512", "--output-len", "8:64", "--max-model-len", "2048", "--target-rate", "40",
                 "--seqs-grid", "4,32", "--max-replicas", "16", "--slo", "e2e_p95=1s"]) == 0
    out = capsys.readouterr().out
    assert "| 4 |" in out and "| 32 |" in out and "replicas x max-num-seqs" in out


def test_profiles_written_before_the_moe_term_still_load(tmp_path):
    coef = [0.004, 0.0002, 0.00002, 0.0, 1e-7, 0.0, 0.0, 0.0, 5e-8, 0.0]
    d = Profile(kind="measured", model="old", dtype="float32", step_model=LinearStepModel(coef + [0.0]),
                kv_bytes_per_token=1024, max_model_len=2048).to_dict()
    d.pop("moe")
    d["step_model"] = {"form": "linear", "features": list(FEATURES[:SHARED_FEATURES]), "coef": coef}
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = Profile.load(tmp_path / "old.json")
    assert old.moe is None and old.step_model.coef[SHARED_FEATURES:] == [0.0]
    assert old.step_model.coef[FEATURES.index("decode_kv_shared")] == 5e-8  # its own shared-KV price kept
    roofline = analytic_profile("a100-80gb", "llama-2-7b").step_model.to_dict()
    roofline.pop("expert_bytes")
    assert model_from_dict(roofline).expert_bytes == 0.0
