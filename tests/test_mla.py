"""MLA and DSA (SPEC 2, 3): step == forward, absorbed == expanded, the indexer and its loss against
naive loops, gradient routing, cache bytes, bounded memory at T=8192, the two training stages."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

import cost

import model as M
from config import ROOT, load_config
from tests.test_model import check_step_equals_forward, make_model
from train import train

D = 32  # d_model of the test models


def mla(**kw):
    spec = {"kind": "mla", "n_heads": 4, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 6}
    return {**spec, **kw}


def dsa(**kw):
    return {"n_heads": 3, "head_dim": 8, "rope_dim": 4, "top_k": 6, "stage": "sparse", **kw}


MLA = {
    "direct_q": mla(),
    "q_lora": mla(q_lora_rank=12),
    "nope": mla(qk_rope_dim=0, rope=False),
    "nope_keeps_unrotated_rope_part": mla(q_lora_rank=12, rope=False),
    "dsa_sparse": mla(q_lora_rank=12, dsa=dsa()),
    "dsa_sparse_direct_q": mla(dsa=dsa(top_k=3, rope_dim=0)),
    "dsa_warmup": mla(q_lora_rank=12, dsa=dsa(stage="dense_warmup")),
}


@pytest.mark.parametrize("name", list(MLA))
def test_step_equals_forward(name):
    model = make_model({name: MLA[name]}, n_layer=2)
    for seed in range(2):
        check_step_equals_forward(model, seed=seed)
    check_step_equals_forward(model, splits=[41])
    check_step_equals_forward(model, T=12, splits=[1] * 12)


@pytest.mark.parametrize("name", ["q_lora", "nope"])
def test_absorbed_decode_equals_expanded(name):
    model = make_model({name: MLA[name]}, n_layer=2)
    idx = torch.randint(0, 61, (2, 20))
    outs = {}
    for absorb in (True, False):
        for block in model.blocks:
            block.mixer.absorb = absorb
        cache = model.new_cache(2, 20)
        outs[absorb] = torch.cat([model.step(idx[:, :7], cache)] + [model.step(idx[:, t:t + 1], cache)
                                                                     for t in range(7, 20)], 1)
    assert (outs[True] - outs[False]).abs().max() < 1e-4


def naive_mla(mixer, x):
    """SPEC 2 written out with explicit weights: returns o [B,T,d_model] and probs [B,H,T,T]."""
    c = mixer.cfg
    B, T, _ = x.shape
    H, dc, dn, dr, dv = c.n_heads, c.kv_lora_rank, c.qk_nope_dim, c.rope_dim, c.v_head_dim
    if c.q_lora_rank is None:
        q = x @ mixer.wq.weight.T
    else:
        q = mixer.q_norm(x @ mixer.wq_a.weight.T) @ mixer.wq_b.weight.T
    q = q.view(B, T, H, dn + dr)
    ckr = x @ mixer.wkv_a.weight.T
    ckv, kr = mixer.kv_norm(ckr[..., :dc]), ckr[..., dc:]
    if dr and c.rope:  # NoPE (Kimi Linear) keeps the dr part unrotated, still in the scale
        cos, sin = M.rope_angles(torch.arange(T), dr, c.rope_theta)
        q = torch.cat([q[..., :dn], M.apply_rope(q[..., dn:], cos, sin)], -1)
        kr = M.apply_rope(kr[:, :, None], cos, sin)[:, :, 0]
    kv = (ckv @ mixer.wkv_b.weight.T).view(B, T, H, dn + dv)
    k = torch.cat([kv[..., :dn], kr[:, :, None].expand(B, T, H, dr)], -1)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * (dn + dr) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = scores.softmax(-1)
    o = torch.einsum("bhts,bshv->bthv", p, kv[..., dn:]).reshape(B, T, H * dv)
    return o @ mixer.wo.weight.T, p


def naive_index_scores(indexer, x, q_in):
    """I[b, t, s] for s <= t (else -inf), one (t, s) pair at a time."""
    c = indexer.cfg
    B, T, _ = x.shape
    q = (q_in @ indexer.wq.weight.T).view(B, T, c.n_heads, c.head_dim)
    k = F.layer_norm(x @ indexer.wk.weight.T, (c.head_dim,), indexer.k_norm.weight, indexer.k_norm.bias,
                     indexer.k_norm.eps)
    if c.rope_dim:
        cos, sin = M.rope_angles(torch.arange(T), c.rope_dim, indexer.rope_theta)
        q = torch.cat([M.apply_rope(q[..., :c.rope_dim], cos, sin), q[..., c.rope_dim:]], -1)
        k = torch.cat([M.apply_rope(k[:, :, None, :c.rope_dim], cos, sin)[:, :, 0], k[..., c.rope_dim:]], -1)
    w = (x @ indexer.ww.weight.T) * c.n_heads ** -0.5
    out = torch.full((B, T, T), float("-inf"))
    for b in range(B):
        for t in range(T):
            for s in range(t + 1):
                out[b, t, s] = sum(w[b, t, h] * torch.relu(q[b, t, h] @ k[b, s]) for h in range(c.n_heads)) \
                    * c.head_dim ** -0.5
    return out


def naive_selection(I, top_k):
    """Per query: the top_k keys by (score, position) descending (ties to the most recent key)."""
    B, T, _ = I.shape
    sel = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            order = sorted(range(t + 1), key=lambda s: (I[b, t, s].item(), s), reverse=True)
            sel[b, t, order[:top_k]] = True
    return sel


def naive_kl(p, I, keep):
    """sum_t KL(p_t || softmax(I_t)) over the kept keys; p [B,H,T,T] per-head attention."""
    target = p.sum(1) * keep
    target = target / target.sum(-1, keepdim=True)
    logq = I.masked_fill(~keep, float("-inf")).log_softmax(-1)
    total = 0.0
    for b in range(I.shape[0]):
        for t in range(I.shape[1]):
            s = keep[b, t]
            total += (target[b, t, s] * (target[b, t, s].log() - logq[b, t, s])).sum()
    return total


def one_mixer(spec, T=13, seed=0):
    torch.manual_seed(seed)
    cfg = M.ModelConfig.from_dict({"vocab_size": 8, "d_model": D, "n_layer": 1, "pattern": ["a"], "layers": {"a": spec}})
    mixer = M.MLA(cfg.layers["a"], cfg)
    for p in mixer.parameters():  # larger weights than the model init, so scores are not all ~0
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0, 0.3)
    return mixer, torch.randn(2, T, D)


@pytest.mark.parametrize("q_lora", [None, 12])
def test_expanded_form_and_indexer_scores_match_naive_loops(q_lora):
    mixer, x = one_mixer(mla(q_lora_rank=q_lora, dsa=dsa(stage="dense_warmup")))
    o, _ = naive_mla(mixer, x)
    with torch.no_grad():
        assert (mixer(x) - o).abs().max() < 1e-4
        q_in = x if q_lora is None else mixer.q_norm(mixer.wq_a(x))
        iq, iw, ik = mixer.indexer(x, q_in, torch.arange(x.shape[1]))
        I = M.index_scores(iq, iw, ik)
    ref = naive_index_scores(mixer.indexer, x, q_in)
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    assert (I[:, causal] - ref[:, causal]).abs().max() < 1e-4


def test_topk_selection_breaks_ties_toward_recent_keys():
    scores = torch.tensor([[[0.0, 0.0, 1.0, 0.0, -0.0, 5.0]]]).expand(1, 6, 6)  # ties at 0 and -0
    sel = M.topk_select(scores, torch.arange(6), 3)
    assert sorted(sel[0, 5].tolist()) == [2, 4, 5]   # 5.0, 1.0, then the latest zero
    assert sorted(sel[0, 3].tolist()) == [1, 2, 3]   # s <= 3 only: 1.0, zeros at 3 then 1
    assert sorted(sel[0, 1].tolist())[:2] == [0, 1]  # fewer than k visible: both, plus a masked one
    assert (sel[0, 1] > 1).sum() == 1


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_kl_loss_matches_naive(stage):
    top_k = 5
    mixer, x = one_mixer(mla(q_lora_rank=12, dsa=dsa(stage=stage, top_k=top_k, loss_weight=0.5)))
    mixer.train()
    out = mixer(x)
    name, loss = mixer.aux_loss
    assert name == "indexer_kl"
    with torch.no_grad():
        I = naive_index_scores(mixer.indexer, x, mixer.q_norm(mixer.wq_a(x)))
        _, p = naive_mla(mixer, x)
        keep = torch.ones(2, 13, 13, dtype=torch.bool).tril()
        if stage == "sparse":
            keep = naive_selection(I, top_k)
            mask = ~keep[:, None]
            # the main attention restricted to the selection: renormalise the dense probabilities
            p = p.masked_fill(mask, 0)
            p = p / p.sum(-1, keepdim=True)
            ref_out = mixer.wo(torch.einsum("bhts,bshv->bthv", p, (mixer.kv_norm(mixer.wkv_a(x)[..., :16]) @
                               mixer.wkv_b.weight.T).view(2, 13, 4, 14)[..., 8:]).reshape(2, 13, -1))
            assert (out - ref_out).abs().max() < 1e-4
        ref = 0.5 * naive_kl(p, I, keep) / (2 * 13)
    assert abs(loss.item() - ref.item()) < 1e-5 * max(1.0, ref.item()), (loss.item(), ref.item())
    assert loss.item() > 0


def test_top_k_at_least_T_equals_dense_mla():
    sparse = make_model({"a": mla(q_lora_rank=12, dsa=dsa(top_k=41))}, n_layer=2)
    dense = make_model({"a": mla(q_lora_rank=12)}, n_layer=2)
    dense.load_state_dict(sparse.state_dict(), strict=False)  # the same MLA weights, no indexer
    idx = torch.randint(0, 61, (2, 41))
    with torch.no_grad():
        assert (sparse(idx)[0] - dense(idx)[0]).abs().max() < 1e-4
    # and with top_k < T selection matters, yet step still equals forward
    small = make_model({"a": mla(q_lora_rank=12, dsa=dsa(top_k=4))}, n_layer=2)
    small.load_state_dict(sparse.state_dict())
    with torch.no_grad():
        assert (small(idx)[0] - dense(idx)[0]).abs().max() > 1e-3
    check_step_equals_forward(small)


def grads(loss, params):
    gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return [g is not None and g.abs().sum().item() > 0 for g in gs]


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_gradient_routing(stage):
    model = make_model({"a": mla(q_lora_rank=12, dsa=dsa(stage=stage, top_k=4))}, n_layer=2).train()
    idx = torch.randint(0, 61, (2, 17))
    logits, total = model(idx, idx)
    lm = F.cross_entropy(logits.view(-1, 61), idx.view(-1))
    assert abs(total.item() - lm.item() - sum(b.mixer.aux_loss[1].item() for b in model.blocks)) < 1e-5
    assert abs(model.lm_loss.item() - lm.item()) < 1e-6
    kl = sum(b.mixer.aux_loss[1] for b in model.blocks)
    names, params = zip(*model.named_parameters())
    is_indexer = [".indexer." in n for n in names]
    lm_g, kl_g = grads(lm, params), grads(kl, params)
    for name, i, g_lm, g_kl in zip(names, is_indexer, lm_g, kl_g):
        if i:   # the indexer learns from its KL loss only
            assert g_kl and not g_lm, name
        else:   # everything else from the LM loss only; the KL loss does not reach the layers below
            assert g_lm and not g_kl, name


def test_cache_bytes_per_token():
    for spec, per_token in [(mla(), 16 + 4), (mla(rope=False), 16 + 4), (mla(dsa=dsa()), 16 + 4 + 8)]:
        model = make_model({"a": spec}, n_layer=3)
        cache = model.new_cache(1, 100)
        assert cache.nbytes() == 3 * 100 * per_token * 4
        layer, d = model.config.layers["a"], model.config.d_model
        assert cost.mixer_cost(layer, d, 1, 100, 4)["cache_bytes_per_token"] == per_token * 4
        assert cost.mixer_cost(layer, d, 1, 100, 2)["cache_bytes_per_token"] == per_token * 2
    gqa = make_model({"g": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2}}).config
    assert cost.mixer_cost(gqa.layers["g"], gqa.d_model, 1, 100, 4)["cache_bytes_per_token"] == 2 * 2 * 8 * 4


def test_sparse_forward_memory_is_bounded_at_8192():
    """What autograd keeps for a DSA sparse forward at T=8192 is O(T * top_k), not T x T."""
    T = 8192
    mixer, _ = one_mixer(mla(n_heads=2, kv_lora_rank=8, qk_nope_dim=4, v_head_dim=4,
                             dsa=dsa(n_heads=2, head_dim=8, top_k=16)))
    mixer.train()
    x = torch.randn(1, T, D, requires_grad=True)
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixer(x)
    assert total[0] < T * T * 4 / 8, f"{total[0] / 2**20:.0f} MiB saved"  # ~19 MiB vs 256 MiB


def test_deepseek_v32_trains_then_resumes_sparse(tmp_path):
    path = os.path.join(ROOT, "configs", "deepseek_v32.yaml")
    small = ["--model.d_model=64", "--model.n_layer=2", "--model.mlp.hidden=128", "--model.layers.mla.dsa.top_k=8",
             "--train.batch_size=2", "--train.seq_len=32", "--train.log_interval=1", "--train.eval_batches=1",
             f"--train.out_dir={tmp_path}", "--train.warmup_steps=1"]
    os.environ.setdefault("HYBRID_CACHE", str(tmp_path / "cache"))
    cfg = load_config(path, small + ["--train.max_steps=2"])
    assert cfg.model.layers["mla"].dsa.stage == "dense_warmup"
    train(cfg, quiet=True)
    cfg = load_config(path, small + ["--train.max_steps=4", "--model.layers.mla.dsa.stage=sparse"])
    train(cfg, resume=True, quiet=True)
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["indexer_kl"] > 0 and r["loss"] > 0 for r in rows)
