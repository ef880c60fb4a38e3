"""The drafting methods on their own: prompt lookup's incremental index against a brute-force search,
the suffix tries' counts against brute-force counting (learning, cut-off, eviction), and the draft
model's greedy drafts against the model's own token-by-token greedy choice, through rollback after
a partial acceptance and an exhausted pool."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from iterserve.config import SpeculativeConfig
from iterserve.request import Request
from iterserve.sampling import SamplingParams
from iterserve.spec_decode.ngram import NgramIndex, NgramProposer
from iterserve.spec_decode.suffix import SuffixProposer, SuffixTrie, TrieCursor

from model_utils import new_runner, sequence_logits


def request(rid: str, prompt: list[int], output: list[int] = (), prediction: list[int] | None = None) -> Request:
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=64))
    req.output_token_ids.extend(output)
    req.prediction_token_ids = prediction
    return req


# ---- prompt lookup ----------------------------------------------------------------------------------
def brute_lookup(seq: list[int], tail: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The latest occurrence (with a follower) of tail's last n tokens in seq, largest n first."""
    for n in range(min(max_n, len(tail)), min_n - 1, -1):
        gram = tail[len(tail) - n:]
        for j in range(len(seq) - n - 1, -1, -1):  # j + n <= len(seq) - 1: a token follows
            if seq[j:j + n] == gram:
                return seq[j + n:j + n + k]
    return []


def random_sequence(rng: random.Random, length: int) -> list[int]:
    """Small vocabulary plus planted repeats of earlier runs: many matches of every length."""
    seq: list[int] = []
    while len(seq) < length:
        if seq and rng.random() < 0.3:
            a = rng.randrange(len(seq))
            seq.extend(seq[a:a + rng.randint(2, 9)])
        else:
            seq.append(rng.randrange(6))
    return seq[:length]


@pytest.mark.parametrize("seed", range(6))
def test_ngram_index_incremental_equals_brute_force(seed):
    rng = random.Random(seed)
    seq = random_sequence(rng, 300)
    min_n, max_n = rng.choice([(1, 3), (2, 5), (3, 3)])
    index = NgramIndex(min_n, max_n)
    at = 0
    while at < len(seq):  # grown in chunks of random size, checked after each
        step = rng.randint(1, 7)
        index.extend(seq[at:at + step])
        at = min(len(seq), at + step)
        k = rng.randint(1, 6)
        assert index.lookup(seq[:at], k) == brute_lookup(seq[:at], seq[:at], min_n, max_n, k)
    for _ in range(50):  # a fixed sequence (a prediction) looked up with tails from elsewhere
        tail = random_sequence(rng, rng.randint(1, 8))
        assert index.lookup(tail, 4) == brute_lookup(seq, tail, min_n, max_n, 4)


def test_ngram_longest_n_wins_latest_occurrence_wins_k_respected():
    seq = [1, 2, 3, 40, 9, 2, 3, 50, 8, 2, 3, 60, 1, 2, 3]
    index = NgramIndex(2, 3, seq)
    # the 3-gram (1, 2, 3) occurs earlier (at 0) than the 2-gram (2, 3) (latest at 9): the longer n wins
    assert index.lookup(seq, 2) == [40, 9]
    assert NgramIndex(2, 2, seq).lookup(seq, 2) == [60, 1]  # only 2-grams: the latest occurrence
    assert index.lookup(seq, 1) == [40]
    assert index.lookup(seq, 0) == []
    assert index.lookup(seq, 100) == seq[3:]
    assert index.lookup([7, 7], 3) == []  # no occurrence
    assert index.match(seq, 2) == (3, [40, 9])


def test_ngram_proposer_incremental_and_prediction(monkeypatch):
    fed: list[int] = []
    real_extend = NgramIndex.extend

    def counting_extend(self, tokens):
        fed.append(len(tokens))
        real_extend(self, tokens)

    monkeypatch.setattr(NgramIndex, "extend", counting_extend)
    prop = NgramProposer.from_config(SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    req = request("a", prompt)
    assert prop.propose([(req, 3)]) == [[7, 8, 9]]
    req.output_token_ids.extend([7, 8])  # accepted two
    prop.verified(req)
    assert prop.propose([(req, 2)]) == [[9, 10]]
    assert sum(fed) == len(prompt) + 2  # each token indexed once: no rescans
    prop.finished(req)
    assert "a" not in prop._state

    # the prediction gives drafts where the context has none, and wins a tie in n
    req = request("b", [1, 2, 3, 4], prediction=[9, 3, 4, 70, 71, 72])
    assert prop.propose([(req, 2)]) == [[70, 71]]
    req = request("c", [3, 4, 80, 81, 3, 4], prediction=[3, 4, 70])
    assert prop.propose([(req, 3)]) == [[70]]
    # a longer match in the context beats the prediction's
    req = request("d", [2, 3, 4, 80, 81, 2, 3, 4], prediction=[3, 4, 70, 71])
    assert prop.propose([(req, 2)]) == [[80, 81]]


# ---- suffix decoding -------------------------------------------------------------------------------
def dump(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}

    def visit(node, path):
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            assert child.count > 0
            visit(child, path + (t,))
        if node.children:  # the kept most frequent child is one
            assert node.children[node.best].count == max(c.count for c in node.children.values())

    visit(trie.root, ())
    return out


def brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    c: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return dict(c)


@pytest.mark.parametrize("seed", range(3))
def test_suffix_trie_counts_cursor_and_eviction(seed):
    rng = random.Random(seed)
    seqs = [random_sequence(rng, rng.randint(5, 60)) for _ in range(4)]
    trie = SuffixTrie(5)
    for s in seqs:
        trie.add(s)
    assert dump(trie) == brute_counts(seqs, 5)
    cursor = TrieCursor(5)  # grown token by token: the same counts
    for i in range(0, len(seqs[0]), 3):
        cursor.extend(seqs[0][i:i + 3])
    assert dump(cursor.trie) == brute_counts([seqs[0]], 5)
    trie.add(seqs[0], -1)
    trie.add(seqs[2], -1)
    assert dump(trie) == brute_counts([seqs[1], seqs[3]], 5)
    assert trie.root.count == len(seqs[1]) + len(seqs[3])


def test_suffix_learns_from_finished_outputs_and_evicts():
    prop = SuffixProposer(depth=8, max_cached_requests=1, spec_factor=4.0, min_token_prob=0.1)
    done = request("a", [1, 2], output=[30, 31, 32, 33, 34, 35])
    prop.finished(done)
    req = request("b", [7, 8, 30, 31])  # its own tokens say nothing about what follows 31
    assert prop.propose([(req, 3)]) == [[32, 33, 34]]
    assert prop.propose([(req, 10)]) == [[32, 33, 34, 35]]  # the learnt output ends there
    # spec_factor caps a draft at ceil(factor x matched length)
    short = SuffixProposer(depth=8, max_cached_requests=1, spec_factor=0.5)
    short.finished(done)
    assert short.propose([(request("c", [9, 31]), 4)]) == [[32]]
    assert short.propose([(request("c2", [30, 31]), 4)]) == [[32]]
    # the next finished output evicts the first: its counts leave the trie
    prop.finished(request("e", [1], output=[50, 51, 52]))
    assert prop.global_trie.find([30]) is None and prop.global_trie.find([31, 32]) is None
    assert dump(prop.global_trie) == brute_counts([[50, 51, 52]], 8)
    assert prop.propose([(request("f", [30, 31]), 3)]) == [[]]


def test_suffix_min_token_prob_cutoff():
    outputs = [[10, 11, 12, 20, 21], [10, 11, 12, 20, 21], [10, 11, 12, 25, 26]]

    def draft(min_prob: float) -> list[int]:
        prop = SuffixProposer(depth=8, spec_factor=4.0, min_token_prob=min_prob)
        for i, o in enumerate(outputs):
            prop.finished(request(f"o{i}", [1], output=o))
        return prop.propose([(request("q", [99, 10, 11, 12]), 4)])[0]

    # after 10 11 12: 20 twice out of three (p = 2/3), then 21 always
    assert draft(0.5) == [20, 21]
    assert draft(0.7) == []
    prop = SuffixProposer(depth=8, max_cached_requests=0)  # no global trie at all
    prop.finished(request("o", [1], output=outputs[0]))
    assert prop.propose([(request("q", [10, 11, 12]), 4)]) == [[]]


def test_suffix_own_context_and_prediction():
    prop = SuffixProposer(depth=8, spec_factor=2.0, min_token_prob=0.6)
    # the request's own prompt: after 5 6 7 came 8 9 once before; the current end, which has no
    # follower yet, does not halve that estimate (p = 1, not 1/2 < min_token_prob)
    req = request("a", [5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert prop.propose([(req, 2)]) == [[8, 9]]
    req.output_token_ids.extend([8, 9])
    prop.verified(req)
    assert prop.propose([(req, 3)]) == [[1, 5, 6]]
    req = request("p", [4, 3, 2], prediction=[3, 2, 60, 61, 62])
    assert prop.propose([(req, 3)]) == [[60, 61, 62]]
    prop.finished(req)
    assert not prop._state.get("p")


# ---- draft model -----------------------------------------------------------------------------------
def reference_greedy(loaded, tokens: list[int], k: int) -> list[int]:
    """The model's own greedy continuation, each token from a fresh full-sequence prefill."""
    seq = list(tokens)
    for _ in range(k):
        seq.append(int(sequence_logits(loaded, seq)[-1].argmax()))
    return seq[len(tokens):]


def draft_proposer(loaded, num_blocks: int = 32, block_size: int = 4):
    from iterserve.spec_decode.draft_model import DraftModelProposer

    pr = new_runner(loaded, num_blocks=num_blocks, block_size=block_size)
    return DraftModelProposer(pr.runner, pr.pool)


def test_draft_model_greedy_batched_and_rollback(tiny_loaded):
    prop = draft_proposer(tiny_loaded)
    rng = random.Random(0)
    a = request("a", [rng.randrange(1000) for _ in range(11)])
    b = request("b", [rng.randrange(1000) for _ in range(6)], output=[7, 8])
    da, db = prop.propose([(a, 4), (b, 2)])  # one batch, different k: b stops early
    assert da == reference_greedy(tiny_loaded, a.all_token_ids, 4)
    assert db == reference_greedy(tiny_loaded, b.all_token_ids, 2)
    assert prop.num_computed("a") == 11 + 3  # its prompt and the three drafts it fed itself

    # the target accepts two of a's drafts and samples another token than the third
    other = (da[2] + 1) % 1000
    a.output_token_ids.extend(da[:2] + [other])
    prop.verified(a)
    assert prop.num_computed("a") == 11 + 2
    # b accepts both and its bonus token; the draft caught up on both in one step
    b.output_token_ids.extend(db + [db[0]])
    prop.verified(b)
    assert prop.num_computed("b") == 8 + 1
    da, db = prop.propose([(a, 3), (b, 3)])
    assert da == reference_greedy(tiny_loaded, a.all_token_ids, 3)
    assert db == reference_greedy(tiny_loaded, b.all_token_ids, 3)

    # a step without drafts for b (speculation switched off), then drafts again
    b.output_token_ids.append(db[0] + 1)
    prop.verified(b)
    assert prop.propose([(b, 2)]) == [reference_greedy(tiny_loaded, b.all_token_ids, 2)]

    prop.finished(a)
    prop.finished(b)
    assert prop.pool.num_free == prop.pool.num_blocks and not prop.pool.tables


def test_draft_model_pool_exhaustion_gives_no_drafts(tiny_loaded):
    prop = draft_proposer(tiny_loaded, num_blocks=4, block_size=4)  # 16 positions in all
    big = request("big", list(range(100, 120)))
    small = request("small", [3, 4, 5])
    assert prop.propose([(big, 3), (small, 3)]) == [[], reference_greedy(tiny_loaded, small.all_token_ids, 3)]
    assert "big" not in prop.pool.tables
    prop.finished(big)
    prop.finished(small)
    assert prop.pool.num_free == 4


def test_draft_model_vocab_mismatch_refused(tiny_loaded, tiny_model_dir):
    from iterserve.config import EngineConfig
    from iterserve.platform.selector import get_platform
    from iterserve.spec_decode.draft_model import DraftModelProposer, check_vocab

    _, cfg, tok = tiny_loaded
    other = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        check_vocab(other, cfg)

    class OtherTokenizer:
        def get_vocab(self):
            return {"x": 0}

    with pytest.raises(ValueError, match="tokenizer"):
        check_vocab(cfg, cfg, OtherTokenizer(), tok)
    check_vocab(cfg, cfg, tok, tok)
    spec = SpeculativeConfig(method="draft_model", model=str(tiny_model_dir), draft_kv_cache_memory="1MiB")
    platform = get_platform(EngineConfig(device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="vocab_size"):
        DraftModelProposer.load(spec, platform, other, block_size=16)
    prop = DraftModelProposer.load(spec, platform, cfg, block_size=16, target_tokenizer=tok, max_model_len=256)
    # a block: K and V x 2 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB; 1 MiB holds 128
    assert prop.pool.num_blocks == 128
    req = request("r", [11, 12, 13, 14, 15])
    assert prop.propose([(req, 2)]) == [reference_greedy(tiny_loaded, req.all_token_ids, 2)]
    with pytest.raises(ValueError, match="holds no KV block"):
        DraftModelProposer.load(dataclasses.replace(spec, draft_kv_cache_memory="1KiB"), platform, cfg, 16)
