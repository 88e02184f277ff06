"""Serving engine (SPEC 11): greedy output and logits equal model.generate / model.step per request,
for every mixer kind, with chunked prefill and continuous batching; blocks come back; prefix sharing
uses fewer blocks with identical outputs; windows free blocks; the paged attention op."""
import pytest
import torch

import kernels
from engine import Engine, EngineError, Request
from tests.test_model import make_model

GLOBAL = {"kind": "attn", "n_heads": 4, "n_kv_heads": 2}
MLA = {"kind": "mla", "n_heads": 4, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 6}
KINDS = {
    "attn_global": GLOBAL,
    "attn_window": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "window": 7},
    "attn_sinks": {"kind": "attn", "n_heads": 4, "n_kv_heads": 1, "window": 6, "sinks": True},
    "mla": MLA,
    "mla_dsa": {**MLA, "q_lora_rank": 12, "dsa": {"n_heads": 3, "head_dim": 8, "rope_dim": 4, "top_k": 6}},
    "kda": {"kind": "kda", "n_heads": 2, "head_dim": 8},
    "gdn": {"kind": "gdn", "n_heads": 2, "head_dim": 8},
    "linear": {"kind": "linear", "n_heads": 2, "head_dim": 8},
    # Qwen3-Next / gpt-oss layer options: output gate, partial RoPE, biases, grouped value heads
    "attn_gated": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "output_gate": True, "rope_fraction": 0.5,
                   "bias": True},
    "gdn_grouped": {"kind": "gdn", "n_heads": 2, "n_v_heads": 4, "head_dim": 8},
    # NSA: per-request slot caches (sparse selection over 4-token blocks, 2-stride compression, window 6);
    # MFA: one key and one value head in the paged pool
    "nsa": {"kind": "nsa", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "cmp_block": 4, "cmp_stride": 2,
            "sel_block": 4, "n_sel": 3, "window": 6},
    "mfa": {"kind": "mfa", "n_heads": 4, "head_dim": 16, "share_q_dim": 12},
    "mfa_kr": {"kind": "mfa", "n_heads": 4, "head_dim": 16, "share_q_dim": 12, "key_reuse": True},
}
SHAPES = [(5, 9), (37, 4), (1, 12), (20, 20), (16, 3), (9, 1)]  # (prompt, new tokens): a mix


def requests(shapes, seed=0, vocab=61, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [Request(list(prefix) + torch.randint(0, vocab, (P,), generator=g).tolist(), N, rid=i)
            for i, (P, N) in enumerate(shapes)]


def step_logits(model, r):
    """Reference: model.step on request r alone, fed its own generated tokens -> [N, vocab]."""
    cache = model.new_cache(1, len(r.prompt) + r.max_new_tokens)
    out = [model.step(torch.tensor([r.prompt]), cache)[0, -1]]
    for t in r.out[:-1]:
        out.append(model.step(torch.tensor([[t]]), cache)[0, -1])
    return torch.stack(out)


def check_contract(model, reqs):
    for r in reqs:
        ref = model.generate(torch.tensor([r.prompt]), r.max_new_tokens, temperature=0)[0, len(r.prompt):]
        assert r.out == ref.tolist(), f"request {r.rid}"
        diff = (torch.stack(r.logits) - step_logits(model, r)).abs().max().item()
        assert diff <= 1e-4, f"request {r.rid}: logits differ from model.step by {diff}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_equals_generate(kind):
    model = make_model({kind: KINDS[kind], "global": GLOBAL}, pattern=[kind, "global"], n_layer=2)
    engine = Engine(model, max_batch=3, prefill_chunk=8, block_size=4, keep_logits=True)
    reqs = engine.run(requests(SHAPES))
    check_contract(model, reqs)
    for g in engine.groups.values():  # every block back in the pool
        assert len(g.pool.free) == g.pool.n_blocks and not g.pool.prefix
    assert sorted(engine.free_slots) == list(range(3))


def test_window_layers_free_blocks():
    model = make_model({"w": KINDS["attn_window"]}, n_layer=1)
    engine = Engine(model, max_batch=1, prefill_chunk=4, block_size=4, keep_logits=True)
    reqs = engine.run(requests([(30, 30)]))
    check_contract(model, reqs)
    # window 7 + a chunk of 4 + a block: at most 4 live blocks ever, for a 60-token context
    assert engine.groups[7].pool.peak <= 4


@pytest.mark.parametrize("pattern", [["g"], ["kda", "g"], ["mfa", "g"]])
def test_prefix_sharing(pattern):
    """8 requests, a 21-token common prefix (5 full blocks of 4 + 1), and two identical prompts (a
    fork: they share the partial last block, copied on the first divergent write)."""
    model = make_model({"g": GLOBAL, "kda": KINDS["kda"], "mfa": KINDS["mfa_kr"]}, pattern=pattern, n_layer=2)
    prefix = torch.randint(0, 61, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    shapes = [(3, 6), (0, 5), (9, 8), (5, 7), (1, 3), (12, 5)]
    allocs = {}
    for sharing in (True, False):
        reqs = requests(shapes, seed=1, prefix=prefix)
        reqs.insert(3, Request(list(reqs[2].prompt), 6, rid="fork"))
        engine = Engine(model, max_batch=8, prefill_chunk=8, block_size=4, keep_logits=True, prefix_sharing=sharing)
        engine.run(reqs)
        check_contract(model, reqs)
        pool = engine.groups[None].pool
        assert len(pool.free) == pool.n_blocks and not pool.prefix
        if sharing:
            shares, copies = pool.shares, pool.copies
        allocs[sharing] = pool.allocs
    # 5 requests re-use the 5 prefix blocks; the fork re-uses all 8 blocks of its twin and copies the
    # partial one when it writes its first token (or its twin does, whichever writes second)
    assert pool.shares == 0 and pool.copies == 0  # (the run without sharing)
    assert shares == 5 * 5 + 8 and copies >= 1
    assert allocs[True] == allocs[False] - shares + copies


def test_unsupported_and_bad_requests():
    model = make_model({"g": GLOBAL}, n_layer=1)
    model.blocks[0].mixer.cfg.kind = "mamba"
    with pytest.raises(EngineError, match="layer 0: mixer kind 'mamba' is not supported"):
        Engine(model)
    model.blocks[0].mixer.cfg.kind = "attn"
    engine = Engine(model, max_batch=2, max_len=20, keep_logits=True)
    reqs = [Request([], 3, rid="a"), Request([1, 2, 99], 3, rid="b"), Request([1] * 18, 5, rid="c"),
            Request([3, 4, 5], 4, rid="d")]
    engine.run(reqs)
    assert reqs[0].error == "empty prompt" and "vocabulary" in reqs[1].error and "exceeds the cache" in reqs[2].error
    assert reqs[3].error is None and len(reqs[3].out) == 4
    check_contract(model, reqs[3:])


def naive_paged(q, k_pool, v_pool, table, lens, window, sinks):
    """Token by token: gather each row's keys in order and run kernels.attention's torch path."""
    B, T = q.shape[:2]
    bs = k_pool.shape[1]
    outs = []
    for b in range(B):
        n = int(lens[b])
        k = torch.stack([k_pool[table[b, p // bs], p % bs] for p in range(n)])[None]
        v = torch.stack([v_pool[table[b, p // bs], p % bs] for p in range(n)])[None]
        outs.append(kernels.attention(q[b:b + 1], k, v, window=window, sinks=sinks, backend="torch"))
    return torch.cat(outs)


@pytest.mark.parametrize("window,sinks", [(None, False), (5, True), (None, True)])
def test_paged_attention_op(window, sinks):
    g = torch.Generator().manual_seed(0)
    N, bs, Hq, Hkv, D = 12, 4, 4, 2, 8
    k_pool, v_pool = torch.randn(N, bs, Hkv, D, generator=g), torch.randn(N, bs, Hkv, D, generator=g)
    table = torch.randperm(N, generator=g)[:9].view(3, 3)
    lens = torch.tensor([12, 7, 3])
    s = torch.randn(Hq, generator=g) if sinks else None
    for T in (1, 3):
        q = torch.randn(3, T, Hq, D, generator=g)
        ref = naive_paged(q, k_pool, v_pool, table, lens, window, s)
        out = kernels.paged_attention(q, k_pool, v_pool, table, lens, window=window, sinks=s, backend="torch")
        assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("window,sinks,mla", [(None, False, False), (5, True, False), (None, True, False), (None, False, True)])
def test_paged_decode_triton(window, sinks, mla):
    """The Triton paged decode kernel (under the interpreter on CPU) == the torch path == the naive loop."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    N, bs, Hq, Hkv, D = 10, 4, 4, 1 if mla else 2, 12 if mla else 8
    k_pool = torch.randn(N, bs, Hkv, D, generator=g)
    v_pool = k_pool[..., :8] if mla else torch.randn(N, bs, Hkv, D, generator=g)  # MLA: values are a view
    table = torch.randperm(N, generator=g)[:9].view(3, 3)
    lens = torch.tensor([11, 5, 1])
    q = torch.randn(3, 1, Hq, D, generator=g)
    s = torch.randn(Hq, generator=g) if sinks else None
    ref = naive_paged(q, k_pool, v_pool, table, lens, window, s)
    out = kernels.paged_attention(q, k_pool, v_pool, table, lens, window=window, sinks=s, backend="triton")
    assert (out - ref).abs().max() < 1e-5
