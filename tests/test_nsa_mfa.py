"""NSA and MFA (SPEC 5): every NSA branch and the whole layer against a naive per-query reference (forward
and gradients), the block selection, MFA and MFA-KR against a naive per-head reference, cache bytes,
step == forward (alone and in hybrids), bounded memory at T=8192, config errors."""

import pytest
import torch
import torch.nn.functional as F

import cost
import model as M
from tests.test_model import check_step_equals_forward, make_model

D_MODEL = 32
NSA = {"kind": "nsa", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "cmp_block": 4, "cmp_stride": 2,
       "sel_block": 8, "n_sel": 3, "window": 6}
MFA = {"kind": "mfa", "n_heads": 4, "head_dim": 16, "share_q_dim": 12}


def one_mixer(spec, seed=0):
    torch.manual_seed(seed)
    cfg = M.ModelConfig.from_dict({"vocab_size": 8, "d_model": D_MODEL, "n_layer": 1, "pattern": ["a"],
                                   "layers": {"a": spec}})
    mixer = M.MIXERS[spec["kind"]][1](cfg.layers["a"], cfg)
    for p in mixer.parameters():  # larger weights than the model init, so softmaxes are not flat
        torch.nn.init.normal_(p, 0, 0.3)
    return mixer


def rope(x, t, theta=10000.0):
    """RoPE of one vector x [D] at position t: pair (x[i], x[i + D/2]) turned by t * theta**(-2i/D)."""
    D = x.shape[-1]
    a = t * theta ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    cos, sin = a.cos().float(), a.sin().float()
    x1, x2 = x[:D // 2], x[D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def attend(q, keys, values, scale):
    """softmax(q . k * scale) v over a list of keys; an empty list gives 0."""
    if not keys:
        return torch.zeros_like(values[0]) if values else torch.zeros_like(q)
    p = (torch.stack(keys) @ q * scale).softmax(0)
    return p @ torch.stack(values)


# ------------------------------------------------------------------------------------------- NSA


def naive_nsa(mixer, x):
    """The paper's NSA for one sequence batch, query by query. Returns o_cmp, o_slc, o_win [B,T,Hq,D],
    the selected blocks {(b, t, kv head): set} and the layer output [B, T, d_model]."""
    c = mixer.cfg
    B, T, _ = x.shape
    Hq, Hkv, D, l, d, ls = c.n_heads, c.n_kv_heads, c.head_dim, c.cmp_block, c.cmp_stride, c.sel_block
    G, scale = Hq // Hkv, D ** -0.5
    q = (x @ mixer.wq.weight.T).view(B, T, Hq, D)
    kc, vc, ks, vs, kw, vw = (x @ mixer.wkv.weight.T).view(B, T, 6, Hkv, D).unbind(2)

    def phi(mlp, rows, pos_emb):  # one block [l, D] -> [D]
        h = F.silu(mlp[0].weight @ (rows + pos_emb).flatten())
        return mlp[2].weight @ h
    N = max(0, (T - l) // d + 1)
    ck = [[[phi(mixer.cmp_k, kc[b, i * d:i * d + l, h], mixer.cmp_pos[0]) for h in range(Hkv)] for i in range(N)]
          for b in range(B)]
    cv = [[[phi(mixer.cmp_v, vc[b, i * d:i * d + l, h], mixer.cmp_pos[1]) for h in range(Hkv)] for i in range(N)]
          for b in range(B)]
    ks_rot = [[[rope(ks[b, s, h], s) for h in range(Hkv)] for s in range(T)] for b in range(B)]
    kw_rot = [[[rope(kw[b, s, h], s) for h in range(Hkv)] for s in range(T)] for b in range(B)]
    o_cmp, o_slc, o_win = (torch.zeros(B, T, Hq, D) for _ in range(3))
    selected = {}
    for b in range(B):
        for t in range(T):
            seen = [i for i in range(N) if i * d + l - 1 <= t]
            for kv in range(Hkv):
                importance = {}                      # selection block -> summed over the group's heads
                for h in range(kv * G, (kv + 1) * G):
                    o_cmp[b, t, h] = attend(q[b, t, h], [ck[b][i][kv] for i in seen],
                                            [cv[b][i][kv] for i in seen], scale)
                    p = (torch.stack([ck[b][i][kv] for i in seen]) @ q[b, t, h] * scale).softmax(0) if seen else []
                    for j in range(t // ls + 1):
                        importance[j] = importance.get(j, 0.0) + sum(
                            float(p[j * ls // d + m - n].detach()) for m in range(ls // d) for n in range(l // d)
                            if 0 <= j * ls // d + m - n < len(seen))
                forced = {0, t // ls, t // ls - 1} - {-1}
                order = sorted(importance, key=lambda j: (j in forced, importance[j], j), reverse=True)
                blocks = set(order[:c.n_sel])
                selected[b, t, kv] = blocks
                keys = [s for s in range(t + 1) if s // ls in blocks]
                window = range(max(0, t - c.window + 1), t + 1)
                for h in range(kv * G, (kv + 1) * G):
                    qr = rope(q[b, t, h], t)
                    o_slc[b, t, h] = attend(qr, [ks_rot[b][s][kv] for s in keys], [vs[b, s, kv] for s in keys], scale)
                    o_win[b, t, h] = attend(qr, [kw_rot[b][s][kv] for s in window], [vw[b, s, kv] for s in window],
                                            scale)
    g = torch.sigmoid(x @ mixer.gate.weight.T).view(B, T, Hq, 3, 1)
    o = g[:, :, :, 0] * o_cmp + g[:, :, :, 1] * o_slc + g[:, :, :, 2] * o_win
    return o_cmp, o_slc, o_win, selected, o.reshape(B, T, -1) @ mixer.wo.weight.T


def grads_of(outputs, params, seed=0):
    """Gradients of sum(out * R) (fixed random R per output) w.r.t. params, one list per output."""
    g = torch.Generator().manual_seed(seed)
    result = []
    for out in outputs:
        R = torch.randn(out.shape, generator=g)
        result.append(torch.autograd.grad((out * R).sum(), params, retain_graph=True, allow_unused=True))
    return result


@pytest.mark.parametrize("spec", [NSA, {**NSA, "n_kv_heads": 1, "cmp_block": 6, "sel_block": 4, "n_sel": 4,
                                        "window": 3}])
def test_nsa_branches_and_layer_match_naive(spec):
    """T = 19 crosses compression strides and selection blocks and is a multiple of none of them."""
    mixer = one_mixer(spec)
    x = torch.randn(2, 19, D_MODEL, requires_grad=True)
    o_cmp, o_slc, o_win = mixer.branches(x)
    out = mixer(x)
    ref = naive_nsa(mixer, x)
    blocks = mixer.select_blocks(mixer.wq(x).view(2, 19, spec["n_heads"], 8), mixer.compress(
        *(mixer.wkv(x).view(2, 19, 6, spec["n_kv_heads"], 8).unbind(2)[:2]))[0], 0, 19)
    for (b, t, kv), want in ref[3].items():
        got = set(blocks[b, t, kv].tolist()) - {-1}
        assert got == want, (b, t, kv, got, want)
    params = [x] + list(mixer.parameters())
    ours = [o_cmp, o_slc, o_win, out]
    theirs = [ref[0], ref[1], ref[2], ref[4]]
    for name, a, r in zip(["cmp", "slc", "win", "layer"], ours, theirs):
        assert (a - r).abs().max() < 1e-5, (name, (a - r).abs().max().item())
    for name, ga, gr in zip(["cmp", "slc", "win", "layer"], grads_of(ours, params), grads_of(theirs, params)):
        for p, a, r in zip(params, ga, gr):
            if a is None or r is None:
                assert (a is None or not a.abs().any()) and (r is None or not r.abs().any()), name
                continue
            assert (a - r).abs().max() < 1e-4, (name, tuple(p.shape), (a - r).abs().max().item())


def test_block_importance_is_the_papers_sum():
    """p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[j l'/d + m - n], written as loops."""
    for l, d, ls in [(4, 2, 8), (6, 2, 4), (2, 2, 2), (32, 16, 64)]:
        mixer = one_mixer({**NSA, "cmp_block": l, "cmp_stride": d, "sel_block": ls})
        p = torch.rand(3, 11)
        n_blocks = -(-(11 * d) // ls) + 1
        got = mixer.block_importance(p, n_blocks)
        for j in range(n_blocks):
            want = sum(p[:, j * ls // d + m - n] for m in range(ls // d) for n in range(l // d)
                       if 0 <= j * ls // d + m - n < 11)
            assert torch.allclose(got[:, j], torch.as_tensor(want) + torch.zeros(3)), (l, d, ls, j)


def test_selection_ties_go_to_the_most_recent_block():
    """Zero compressed keys: uniform probabilities, so the blocks before the query's tie exactly; the
    most recent win, whatever the chunking (one query at a time, as in decode == forward)."""
    mixer = one_mixer({**NSA, "n_sel": 5})
    T = 100
    q = torch.randn(1, T, 4, 8)
    ck = torch.zeros(1, (T - 4) // 2 + 1, 2, 8)
    blocks = mixer.select_blocks(q, ck, 0, T)
    for t in range(T):
        cur = t // 8
        want = set(range(cur + 1)) if cur < 5 else {0, cur - 3, cur - 2, cur - 1, cur}
        one = mixer.select_blocks(q[:, t:t + 1], ck[:, :max(0, (t + 1 - 4) // 2 + 1)], t, t + 1)
        for kv in range(2):
            assert set(blocks[0, t, kv].tolist()) - {-1} == want == set(one[0, 0, kv].tolist()) - {-1}, t


def test_selection_of_every_block_is_full_attention():
    """n_sel >= the number of blocks: the selection branch is causal attention over all keys."""
    T = 21
    mixer = one_mixer({**NSA, "n_sel": 3 + T // 8})
    x = torch.randn(2, T, D_MODEL, requires_grad=True)
    o_slc = mixer.branches(x)[1]
    q = M.apply_rope(mixer.wq(x).view(2, T, 4, 8), *M.rope_angles(torch.arange(T), 8, 10000.0))
    k, v = mixer.wkv(x).view(2, T, 6, 2, 8).unbind(2)[2:4]
    k = M.apply_rope(k, *M.rope_angles(torch.arange(T), 8, 10000.0))
    full = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                          v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    assert (o_slc - full).abs().max() < 1e-5
    params = [x] + list(mixer.wq.parameters()) + list(mixer.wkv.parameters())
    for a, f in zip(grads_of([o_slc], params)[0], grads_of([full], params)[0]):
        assert (a - f).abs().max() < 1e-4


def test_nsa_forward_memory_is_bounded_at_8192():
    """What autograd keeps is O(T * attended keys * D) (the torch path keeps the gathered K/V of the
    selected blocks): from T=4096 to 8192 it doubles (T x T would quadruple), and at T=8192 it stays
    below a single head's T x T fp32 score matrix (256 MiB; the layer has 2 heads)."""
    saved = {}
    for T in (4096, 8192):
        mixer = one_mixer({"kind": "nsa", "n_heads": 2, "n_kv_heads": 1, "head_dim": 8, "cmp_block": 32,
                           "cmp_stride": 16, "sel_block": 64, "n_sel": 4, "window": 64})
        x = torch.randn(1, T, D_MODEL, requires_grad=True)
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total[0] += key[1]
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mixer(x)
        saved[T] = total[0]
    assert saved[8192] < 2.2 * saved[4096], saved
    assert saved[8192] < 8192 * 8192 * 4, f"{saved[8192] / 2**20:.0f} MiB saved"  # ~200 MiB


# ------------------------------------------------------------------------------------------- MFA


def naive_mfa(mixer, x):
    """Step-3's MFA written per head: q_h = RMSNorm(x S_Q) Q_h, one key and value head, RoPE."""
    c = mixer.cfg
    B, T, _ = x.shape
    H, C = c.n_heads, c.head_dim
    cq = x @ mixer.wq_a.weight.T
    cq = cq * torch.rsqrt(cq.pow(2).mean(-1, keepdim=True) + mixer.q_norm.eps) * mixer.q_norm.weight
    k = x @ mixer.wk.weight.T                                             # [B, T, C]
    if c.key_reuse:  # S_V = (I + diag(alpha) N) S_K in the key's space: v = k + alpha * (N k)
        v = k + mixer.kr_alpha * (k @ mixer.kr_n.weight.T)
    else:
        v = x @ mixer.wv.weight.T
    keys = [[rope(k[b, s], s) if c.rope else k[b, s] for s in range(T)] for b in range(B)]
    heads = []
    for h in range(H):
        qh = cq @ mixer.wq_b.weight[h * C:(h + 1) * C].T                  # [B, T, C]
        oh = torch.zeros(B, T, C)
        for b in range(B):
            for t in range(T):
                qr = rope(qh[b, t], t) if c.rope else qh[b, t]
                oh[b, t] = attend(qr, keys[b][:t + 1], [v[b, s] for s in range(t + 1)], C ** -0.5)
        heads.append(oh)
    return torch.cat(heads, -1) @ mixer.wo.weight.T


@pytest.mark.parametrize("spec", [MFA, {**MFA, "key_reuse": True}, {**MFA, "rope": False, "share_q_dim": 40}])
def test_mfa_matches_naive_per_head(spec):
    mixer = one_mixer(spec)
    x = torch.randn(2, 11, D_MODEL, requires_grad=True)
    out, ref = mixer(x), naive_mfa(mixer, x)
    assert (out - ref).abs().max() < 1e-4
    params = [x] + list(mixer.parameters())
    for a, r in zip(grads_of([out], params)[0], grads_of([ref], params)[0]):
        assert (a - r).abs().max() < 1e-3


def test_cache_bytes():
    """MFA: 2 x head_dim numbers per token (head_dim with key reuse), whatever the head count; NSA:
    raw K/V + compressed K/V + pending compression rows + window ring (SPEC 6)."""
    L = 100
    for spec, per_token in [(MFA, 2 * 16), ({**MFA, "key_reuse": True}, 16)]:
        for H in (2, 8):
            m = make_model({"a": {**spec, "n_heads": H}}, n_layer=3)
            assert m.new_cache(1, L).nbytes() == 3 * L * per_token * 4
            layer = m.config.layers["a"]
            c = cost.mixer_cost(layer, D_MODEL, 1, L, 4)
            assert c["cache_bytes_per_token"] == per_token * 4 and c["cache_bytes"] == L * per_token * 4
    m = make_model({"n": NSA}, n_layer=1)
    row = 2 * 2 * 8 * 4                                   # K and V of 2 kv heads of 8, fp32
    n_cmp = (L - 4) // 2 + 1
    assert m.new_cache(1, L).nbytes() == (L + n_cmp + 3 + 6) * row
    assert cost.mixer_cost(m.config.layers["n"], D_MODEL, 1, L, 4)["cache_bytes"] == (L + n_cmp + 3 + 6) * row


SPLITS = {"nsa": NSA, "nsa_mqa_odd": {**NSA, "n_kv_heads": 1, "cmp_block": 6, "sel_block": 4, "n_sel": 4, "window": 3},
          "mfa": MFA, "mfa_kr": {**MFA, "key_reuse": True}}


@pytest.mark.parametrize("name", list(SPLITS))
def test_step_equals_forward(name):
    model = make_model({name: SPLITS[name]}, n_layer=2)
    if name == "mfa_kr":  # alpha starts at 0 (v = k); make the value map matter
        for block in model.blocks:
            torch.nn.init.normal_(block.mixer.kr_alpha)
    for seed in range(3):
        check_step_equals_forward(model, seed=seed)
    check_step_equals_forward(model, T=30, splits=[1] * 30)
    check_step_equals_forward(model, T=41, splits=[41])


@pytest.mark.parametrize("other", ["nsa", "mfa_kr"])
def test_step_equals_forward_in_a_hybrid(other):
    """3 KDA : 1 NSA (or MFA-KR), random chunk splits."""
    layers = {"kda": {"kind": "kda", "n_heads": 2}, other: SPLITS[other]}
    model = make_model(layers, pattern=["kda", "kda", "kda", other], n_layer=4)
    for seed in range(2):
        check_step_equals_forward(model, T=45, seed=seed)


@pytest.mark.parametrize("spec", [NSA, MFA])
def test_packed_documents_with_a_cache_are_refused(spec):
    """Packed documents are for the parallel path (tests/test_varlen.py: packed == separate); with a
    cache: one clear error, the cache untouched."""
    mixer = one_mixer(spec)
    cache = mixer.new_cache(1, 10, "cpu", torch.float32)
    with pytest.raises(ValueError, match="cache=None"):
        mixer(torch.randn(1, 10, D_MODEL), cache, 0, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    assert all(not t.any() for t in vars(cache).values() if torch.is_tensor(t))


@pytest.mark.parametrize("spec,key,message", [
    ({**NSA, "cmp_block": 5}, "cmp_block", "a multiple of cmp_stride=2"),
    ({**NSA, "cmp_block": 1}, "cmp_block", "a multiple of cmp_stride=2"),
    ({**NSA, "sel_block": 6, "cmp_stride": 4, "cmp_block": 4}, "sel_block", "a multiple of cmp_stride=4"),
    ({**NSA, "n_sel": 2}, "n_sel", "an integer >= 3"),
    ({**NSA, "window": 0}, "window", "an integer >= 1"),
    ({**NSA, "n_kv_heads": 3}, "n_kv_heads", "a divisor of n_heads=4"),
    ({**NSA, "cmp_stride": 0}, "cmp_stride", "an integer >= 1"),
    ({**NSA, "topk": 3}, "topk", "unknown key"),
    ({**MFA, "share_q_dim": 0}, "share_q_dim", "an integer >= 1"),
    ({**MFA, "head_dim": 7}, "head_dim", "even when rope is true"),
    ({**MFA, "n_kv_heads": 2}, "n_kv_heads", "unknown key"),
    ({**MFA, "key_reuse": "yes"}, "key_reuse", "true or false"),
])
def test_config_errors_are_one_line(spec, key, message):
    with pytest.raises(M.ConfigError) as e:
        M.ModelConfig.from_dict({"d_model": D_MODEL, "pattern": ["a"], "layers": {"a": spec}})
    text = str(e.value)
    assert text.startswith(f"model.layers.a.{key}:") and message in text and "\n" not in text, text


# ------------------------------------------------------------------------------------------- cost


def test_mfa_cost_by_hand():
    from types import SimpleNamespace as NS
    d, H, C, r = 64, 8, 32, 48
    lc = NS(kind="mfa", n_heads=H, head_dim=C, share_q_dim=r, key_reuse=False)
    c = cost.mixer_cost(lc, d, seq_len=8, ctx=100, dtype_bytes=2)
    mm = 64 * 48 + 48 * 8 * 32 + 64 * 32 + 64 * 32 + 8 * 32 * 64     # S_Q, Q_h, S_K, S_V, O_h
    assert mm == 35840 and c["params"] == mm + 48                    # + RMSNorm of the query latent
    assert c["train_flops"] == 3 * (2 * mm + 4 * 8 * 32 * 4.5)       # keys seen: (1 + .. + 8) / 8
    assert c["cache_bytes"] == 100 * 2 * 32 * 2 and c["cache_bytes_per_token"] == 128
    assert c["decode_flops"] == 2 * mm + 4 * 8 * 32 * 100
    assert c["decode_bytes"] == c["params"] * 2 + 12800
    kr = cost.mixer_cost(NS(**{**vars(lc), "key_reuse": True}), d, 8, 100, 2)
    assert kr["params"] == mm - 64 * 32 + 48 + 32 * 32 + 32          # no S_V; + N and alpha
    assert kr["train_flops"] == 3 * (2 * (mm - 2048) + 2 * 8 * 32 * 32 + 4 * 8 * 32 * 4.5)
    assert kr["cache_bytes"] == 100 * 32 * 2                         # the key only
    more_heads = cost.mixer_cost(NS(**{**vars(lc), "n_heads": 64}), d, 8, 100, 2)
    assert more_heads["cache_bytes"] == c["cache_bytes"]             # independent of the head count


def test_nsa_cost_by_hand():
    from types import SimpleNamespace as NS
    lc = NS(kind="nsa", n_heads=4, n_kv_heads=2, head_dim=16, cmp_block=8, cmp_stride=4, sel_block=8, n_sel=3,
            window=6)
    d, T, L = 64, 20, 100
    c = cost.mixer_cost(lc, d, seq_len=T, ctx=L, dtype_bytes=2)
    mm = 64 * 64 + 6 * 64 * 32 + 3 * 64 * 4 + 64 * 64               # q, 3 x (K, V), gates, out
    mlp = 2 * (8 * 16 * 16 + 16 * 16)                                # key and value MLP
    assert c["params"] == mm + mlp + 2 * 8 * 16                      # + position embeddings
    cmp_seen = sum(max(0, (t + 1 - 8) // 4 + 1) for t in range(T)) / T   # compressed keys of query t
    slc_seen = sum(min(t + 1, 24) for t in range(T)) / T
    win_seen = sum(min(t + 1, 6) for t in range(T)) / T
    assert cost.compressed_seen_avg(T, 8, 4) == cmp_seen == (0 * 7 + 1 * 4 + 2 * 4 + 3 * 4 + 4 * 1) / 20
    want = 3 * (2 * mm + 2 * mlp * 2 / 4 + 4 * 4 * 16 * (cmp_seen + slc_seen + win_seen)) + 2 * 4 * 16 * cmp_seen
    assert c["train_flops"] == pytest.approx(want)
    row = 2 * 2 * 16 * 2
    n_cmp = (100 - 8) // 4 + 1
    assert c["cache_bytes"] == row * (100 + n_cmp + 6 + 7)           # raw + compressed + ring + pending
    assert c["decode_flops"] == pytest.approx(2 * mm + mlp + 4 * 4 * 16 * (n_cmp + 24 + 6) + 2 * 4 * 16 * n_cmp)
    assert c["decode_bytes"] == c["params"] * 2 + row * (n_cmp + 24 + 6 + 7)
    for T in range(1, 60):
        assert cost.compressed_seen_avg(T, 8, 4) == pytest.approx(
            sum(max(0, (t + 1 - 8) // 4 + 1) for t in range(T)) / T)


@pytest.mark.parametrize("layers", [{"n": NSA, "k": {"kind": "kda", "n_heads": 2}}, {"m": MFA},
                                    {"m": {**MFA, "key_reuse": True}}])
def test_cost_params_and_cache_match_the_model(layers):
    model = make_model(layers, n_layer=len(layers) * 2)
    assert cost.num_params(model.config) == model.num_params()
    for L in (5, 40):
        assert cost.cache_bytes(model.config, L, dtype_bytes=4) == model.new_cache(1, L).nbytes()


def test_step_equals_forward_at_the_papers_sizes():
    """l 32, d 16, l' 64, n 16, w 512 (the defaults) over 1300 tokens: chunks end inside strides and
    blocks, and past 1024 keys the 16 blocks are a real choice."""
    model = make_model({"a": {"kind": "nsa", "n_heads": 4, "n_kv_heads": 1, "head_dim": 8}}, n_layer=1)
    check_step_equals_forward(model, T=1300, B=1, splits=[700, 1, 1, 63, 1, 300, 17, 217])
