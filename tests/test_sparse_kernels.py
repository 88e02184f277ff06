"""Sparse attention ops (kernels/torch_sparse.py, kernels/triton_sparse.py): DSA's sparse MLA attention
and indexer top-k, NSA's block-sparse selection.

The torch path is checked against naive per-query loops written here (float64), the Triton path
(run by the interpreter on CPU, conftest sets TRITON_INTERPRET=1) against the torch path, forward and
every gradient. Edge cases: rows with fewer visible keys than slots (padding gets no probability and
no gradient), rows with none, many queries selecting the same key (gradient accumulation), lengths
that are not multiples of any block size, Dk != Dv, exact ties in the indexer's top-k.
"""
import pytest
import torch

import kernels
from kernels.torch_sparse import index_scores, topk_select

pytest.importorskip("kernels.triton_sparse")

ATOL = 1e-5


# ------------------------------------------------------------------ naive per-query references

def naive_attend(q, keys, values, scale):
    """One query's heads q [G, D] over explicit keys [n, D] / values [n, Dv] in float64; n = 0 -> 0."""
    if keys.shape[0] == 0:
        return q.new_zeros(q.shape[0], values.shape[1]), q.new_full((q.shape[0],), float("-inf"))
    s = q @ keys.T * scale
    return s.softmax(-1) @ values, torch.logsumexp(s, -1)


def naive_sparse_mla(q, kv, indices, d_v, scale):
    B, T, H, _ = q.shape
    S = kv.shape[1]
    o, lse = [], []
    for b in range(B):
        for t in range(T):
            sel = [j for j in indices[b, t].tolist() if 0 <= j <= S - T + t]
            rows = kv[b, sel].double()
            ot, lt = naive_attend(q[b, t].double(), rows, rows[:, :d_v], scale)
            o.append(ot)
            lse.append(lt)
    return torch.stack(o).view(B, T, H, d_v), torch.stack(lse).view(B, T, H)


def naive_block_sparse(q, k, v, block_indices, block_size, scale):
    B, T, Hq, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    o = []
    for b in range(B):
        for t in range(T):
            for h in range(Hq):
                blocks = [i for i in block_indices[b, t, h // G].tolist() if i >= 0]
                keys = [j for i in blocks for j in range(i * block_size, (i + 1) * block_size) if j <= S - T + t]
                o.append(naive_attend(q[b, t, h:h + 1].double(), k[b, keys, h // G].double(),
                                      v[b, keys, h // G].double(), scale)[0][0])
    return torch.stack(o).view(B, T, Hq, v.shape[3])


def naive_topk(iq, iw, ik, k):
    """Per query: score every visible key with a loop, sort by (score, position) descending."""
    B, T, HI, dI = iq.shape
    S = ik.shape[1]
    out = []
    for b in range(B):
        for t in range(T):
            pos = S - T + t
            scores = [(sum(iw[b, t, h].item() * max((iq[b, t, h].double() @ ik[b, j].double()).item(), 0.0)
                           for h in range(HI)) * dI ** -0.5, j) for j in range(pos + 1)]
            out.append([j for _, j in sorted(scores, reverse=True)[:k]])
    return out


# ------------------------------------------------------------------ inputs

def mla_inputs(B, T, S, H, Dk, K, seed, hot=None):
    """indices: a mix of visible keys, keys after the query, -1 slots; `hot` keys selected by every query."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Dk, generator=g).requires_grad_()
    kv = torch.randn(B, S, Dk, generator=g).requires_grad_()
    idx = torch.stack([torch.stack([torch.randperm(S + 3, generator=g)[:K] - 3 for _ in range(T)]) for _ in range(B)])
    idx = idx.clamp(min=-1)                                           # -1 slots (duplicates of -1 allowed)
    if hot is not None:
        idx[..., :len(hot)] = torch.tensor(hot)
        idx[..., len(hot):] = torch.where(torch.isin(idx[..., len(hot):], torch.tensor(hot)), -1, idx[..., len(hot):])
    return q, kv, idx


def run_mla(backend, q, kv, idx, d_v, scale, seed=1):
    o, lse = kernels.sparse_mla_attention(q, kv, idx, d_v=d_v, scale=scale, backend=backend)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed))
    return [o, lse, *torch.autograd.grad(o, [q, kv], do)]


def close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    err = (a.double() - b.double()).masked_fill(both_inf, 0).abs().max().item()
    assert err < atol, err


# ------------------------------------------------------------------ DSA: sparse MLA attention

MLA_CASES = {   # B, T, S, H, Dk, d_v, K
    "offset_queries_rope": (2, 7, 21, 3, 24, 16, 19),    # T < S; K, S, H not multiples of any block
    "nope_dk_eq_dv": (1, 9, 9, 4, 16, 16, 5),            # d_rope = 0
    "wide_rope": (1, 5, 13, 2, 40, 8, 13),               # Dk - d_v > 16: rope part spans dims
    "two_head_tiles": (1, 3, 8, 20, 24, 16, 5),          # H > the kernel's head tile (16)
}


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_sparse_mla_torch_matches_naive(case):
    B, T, S, H, Dk, d_v, K = MLA_CASES[case]
    q, kv, idx = mla_inputs(B, T, S, H, Dk, K, seed=0)
    o, lse = kernels.sparse_mla_attention(q, kv, idx, d_v=d_v, scale=0.3, backend="torch")
    o_ref, lse_ref = naive_sparse_mla(q, kv, idx, d_v, 0.3)
    close(o, o_ref)
    close(lse, lse_ref)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    for g, g_ref in zip(torch.autograd.grad(o, [q, kv], do), torch.autograd.grad(o_ref, [q, kv], do.double())):
        close(g, g_ref)


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_sparse_mla_triton_matches_torch(case):
    B, T, S, H, Dk, d_v, K = MLA_CASES[case]
    q, kv, idx = mla_inputs(B, T, S, H, Dk, K, seed=2)
    for a, b in zip(run_mla("triton", q, kv, idx, d_v, 0.3), run_mla("torch", q, kv, idx, d_v, 0.3)):
        close(a, b)


def test_sparse_mla_padding_and_shared_keys():
    """Every query selects keys 0 and 3 (atomics accumulate them), early queries see fewer keys than
    slots, the first query of batch row 1 none at all: o = 0, lse = -inf, no gradient anywhere."""
    B, T, S, H, Dk, d_v, K = 2, 12, 12, 3, 20, 16, 6
    q, kv, idx = mla_inputs(B, T, S, H, Dk, K, seed=3, hot=[0, 3])
    idx[1, 0] = torch.tensor([5, -1, 7, 11, -1, 1])                   # nothing visible at position 0
    outs = {be: run_mla(be, q, kv, idx, d_v, 0.5) for be in ("torch", "triton")}
    for a, b in zip(outs["triton"], outs["torch"]):
        close(a, b)
    o, lse, dq, dkv = outs["triton"]
    assert (o[1, 0] == 0).all() and (lse[1, 0] == float("-inf")).all() and (dq[1, 0] == 0).all()
    visible = torch.zeros(B, S, dtype=torch.bool)                    # keys some query may attend
    for b in range(B):
        for t in range(T):
            visible[b, [j for j in idx[b, t].tolist() if 0 <= j <= t]] = True
    assert (dkv[~visible] == 0).all() and (dkv[visible].abs().sum(-1) > 0).all()


def test_torch_paths_across_query_blocks():
    """T spans several of the torch paths' query blocks (kernels.torch_sparse.BLOCK_Q = 64)."""
    q, kv, idx = mla_inputs(1, 70, 75, 2, 16, 6, seed=8)
    o, lse = kernels.sparse_mla_attention(q, kv, idx, d_v=8, scale=0.3, backend="torch")
    o_ref, lse_ref = naive_sparse_mla(q, kv, idx, 8, 0.3)
    close(o, o_ref)
    close(lse, lse_ref)
    q, k, v, bi = nsa_inputs(1, 70, 75, 2, 1, 8, 8, 8, 3, seed=9)
    close(kernels.block_sparse_attention(q, k, v, bi, 8, scale=0.4, backend="torch"),
          naive_block_sparse(q, k, v, bi, 8, 0.4))
    iq, iw, ik = int_indexer(1, 70, 70, 1, 8, seed=13)                 # first block sees 64 < k keys
    assert first_valid(kernels.index_topk(iq, iw, ik, 66, backend="torch"), 70, 70) == naive_topk(iq, iw, ik, 66)


# ------------------------------------------------------------------ DSA: the indexer's top-k

def int_indexer(B, T, S, HI, dI, seed):
    """Small integer inputs: every score is exact in fp32 on both paths, and ties are common."""
    g = torch.Generator().manual_seed(seed)
    iq = torch.randint(-2, 3, (B, T, HI, dI), generator=g).float()
    iw = torch.randint(-2, 3, (B, T, HI), generator=g).float()
    ik = torch.randint(-1, 2, (B, S, dI), generator=g).float()
    return iq, iw, ik


def first_valid(sel, S, T):
    """Per query: the visible entries of a best-first selection (padding is only at the end)."""
    out = []
    for b in range(sel.shape[0]):
        for t in range(T):
            row = sel[b, t].tolist()
            valid = [j for j in row if 0 <= j <= S - T + t]
            assert row[:len(valid)] == valid                          # padding never before a real key
            out.append(valid)
    return out


@pytest.mark.parametrize("B,T,S,HI,dI,k,decreasing", [(2, 11, 11, 2, 16, 5, False), (1, 9, 40, 2, 16, 20, False),
                                                       (1, 17, 34, 1, 8, 3, False), (1, 4, 40, 1, 8, 2, True)])
def test_index_topk_matches_naive_and_topk_select(B, T, S, HI, dI, k, decreasing):
    iq, iw, ik = int_indexer(B, T, S, HI, dI, seed=T)
    if decreasing:  # scores fall with the position: after the first tile no key tile gains (merge skipped)
        iq, iw = iq.abs() + 1, iw.abs() + 1
        ik = (S - torch.arange(S, dtype=torch.float32)).view(1, S, 1).expand(B, S, dI).contiguous()
    ref = naive_topk(iq, iw, ik, k)
    qpos = torch.arange(S - T, S)
    assert first_valid(topk_select(index_scores(iq, iw, ik), qpos, k), S, T) == ref
    for backend in ("torch", "triton"):
        assert first_valid(kernels.index_topk(iq, iw, ik, k, backend=backend), S, T) == ref, backend


# ------------------------------------------------------------------ NSA: block-sparse selection

NSA_CASES = {   # B, T, S, Hq, Hkv, D, Dv, block_size, n
    "gqa2_odd_blocks": (2, 7, 23, 4, 2, 16, 8, 5, 3),   # S, T not multiples of the block; T < S
    "mha_pow2_block": (1, 16, 16, 2, 2, 8, 16, 4, 2),
    "gqa3_big_block": (1, 9, 30, 3, 1, 24, 12, 20, 2),   # a block longer than the kernel's key tile
}


def nsa_inputs(B, T, S, Hq, Hkv, D, Dv, block_size, n, seed):
    """Random distinct blocks per (query, kv head), some after the query, some slots -1; the first
    query of batch 0 gets no block at all."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).requires_grad_()
    k = torch.randn(B, S, Hkv, D, generator=g).requires_grad_()
    v = torch.randn(B, S, Hkv, Dv, generator=g).requires_grad_()
    n_blocks = -(-S // block_size)
    bi = torch.stack([torch.randperm(n_blocks + 1, generator=g)[:n] - 1 for _ in range(B * T * Hkv)])
    bi = bi.view(B, T, Hkv, n).clamp(min=-1)
    bi[0, 0] = -1
    return q, k, v, bi


def run_nsa(backend, q, k, v, bi, block_size, seed=1):
    o = kernels.block_sparse_attention(q, k, v, bi, block_size, scale=0.4, backend=backend)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed))
    return [o, *torch.autograd.grad(o, [q, k, v], do)]


@pytest.mark.parametrize("case", list(NSA_CASES))
def test_block_sparse_torch_matches_naive(case):
    B, T, S, Hq, Hkv, D, Dv, bs, n = NSA_CASES[case]
    q, k, v, bi = nsa_inputs(*NSA_CASES[case], seed=0)
    o = kernels.block_sparse_attention(q, k, v, bi, bs, scale=0.4, backend="torch")
    o_ref = naive_block_sparse(q, k, v, bi, bs, 0.4)
    close(o, o_ref)
    assert (o[0, 0] == 0).all()
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    for g, g_ref in zip(torch.autograd.grad(o, [q, k, v], do), torch.autograd.grad(o_ref, [q, k, v], do.double())):
        close(g, g_ref)


@pytest.mark.parametrize("case", list(NSA_CASES))
def test_block_sparse_triton_matches_torch(case):
    bs = NSA_CASES[case][7]
    q, k, v, bi = nsa_inputs(*NSA_CASES[case], seed=4)
    for a, b in zip(run_nsa("triton", q, k, v, bi, bs), run_nsa("torch", q, k, v, bi, bs)):
        close(a, b)


def test_block_sparse_every_block_equals_attention():
    """Selecting every block (and every query sharing block 0: accumulation) == causal attention."""
    B, T, S, Hq, Hkv, D, bs = 1, 10, 10, 4, 2, 16, 4
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, Hq, D, generator=g).requires_grad_()
    k = torch.randn(B, S, Hkv, D, generator=g).requires_grad_()
    v = torch.randn(B, S, Hkv, D, generator=g).requires_grad_()
    bi = torch.arange(-(-S // bs)).flip(0).expand(B, T, Hkv, -1).contiguous()
    o = kernels.attention(q, k, v, scale=0.4, backend="torch")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    dense = [o, *torch.autograd.grad(o, [q, k, v], do)]
    for backend in ("torch", "triton"):
        for a, b in zip(run_nsa(backend, q, k, v, bi, bs), dense):
            close(a, b)


# ------------------------------------------------------------------ the model's DSA on the Triton path

DSA_LAYER = {"kind": "mla", "n_heads": 4, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 6,
             "q_lora_rank": 12, "dsa": {"n_heads": 2, "head_dim": 8, "rope_dim": 4, "top_k": 5}}


def test_mla_dsa_triton_backend_equals_torch():
    """A DSA layer in training (sparse stage, indexer KL loss): loss and every gradient agree."""
    from tests.test_model import make_model
    spec = DSA_LAYER
    idx = torch.randint(0, 61, (1, 14), generator=torch.Generator().manual_seed(0))
    out = {}
    for backend in ("torch", "triton"):
        model = make_model({"a": spec}, n_layer=1, backend=backend).train()
        _, loss = model(idx, idx)
        names, params = zip(*model.named_parameters())
        out[backend] = [loss.detach()] + list(torch.autograd.grad(loss, params))
    for a, b in zip(out["triton"], out["torch"]):
        close(a, b, 1e-4)


def test_half_precision_inputs():
    """fp16 in (the interpreter has no bf16 arithmetic, SPEC 7): fp32 accumulation inside, so the
    Triton ops stay within fp16 rounding of the torch path run in fp32 on the same values."""
    q, kv, idx = mla_inputs(1, 6, 10, 3, 24, 7, seed=6)
    q16, kv16 = q.detach().half().requires_grad_(), kv.detach().half().requires_grad_()
    q32, kv32 = q16.detach().float().requires_grad_(), kv16.detach().float().requires_grad_()
    for a, b in zip(run_mla("triton", q16, kv16, idx, 16, 0.3), run_mla("torch", q32, kv32, idx, 16, 0.3)):
        assert a.dtype in (torch.float16, torch.float32)
        close(a.float(), b, 2e-2)
    q, k, v, bi = nsa_inputs(1, 5, 12, 4, 2, 16, 16, 4, 2, seed=7)
    half = [x.detach().half().requires_grad_() for x in (q, k, v)]
    full = [x.detach().float().requires_grad_() for x in half]
    for a, b in zip(run_nsa("triton", *half, bi, 4), run_nsa("torch", *full, bi, 4)):
        assert a.dtype == torch.float16
        close(a.float(), b, 2e-2)


def test_mla_dsa_triton_step_equals_forward():
    """Decode on the Triton path (one query, growing key count) equals its parallel forward."""
    from tests.test_model import check_step_equals_forward, make_model
    model = make_model({"a": DSA_LAYER}, n_layer=1, backend="triton")
    check_step_equals_forward(model, T=8, B=1, splits=[3, 1, 1, 2, 1])


def test_bad_inputs_name_the_problem():
    q, kv, idx = mla_inputs(1, 4, 6, 2, 16, 3, seed=0)
    with pytest.raises(ValueError, match="sparse_mla_attention: need indices"):
        kernels.sparse_mla_attention(q, kv, idx[:, :2], d_v=8, scale=1.0)
    with pytest.raises(ValueError, match="index_topk: k must be in"):
        kernels.index_topk(q, q[..., 0], kv, 7)
    with pytest.raises(ValueError, match="block_sparse_attention: need block_indices"):
        kernels.block_sparse_attention(q, kv[:, :, None], kv[:, :, None], idx, 2)


@pytest.mark.slow
def test_larger_shapes():
    """Closer to real layers: 32 heads over 40 selected rows of d_c + d_rope = 64 + 16 across several
    key tiles; NSA groups of 8 heads over 4 blocks of 16; the top-k over 3 query blocks and 5 key tiles."""
    q, kv, idx = mla_inputs(1, 40, 72, 32, 80, 40, seed=10, hot=[0, 5, 9])
    for a, b in zip(run_mla("triton", q, kv, idx, 64, 80 ** -0.5), run_mla("torch", q, kv, idx, 64, 80 ** -0.5)):
        close(a, b)
    q, k, v, bi = nsa_inputs(1, 40, 72, 16, 2, 32, 32, 16, 4, seed=11)
    for a, b in zip(run_nsa("triton", q, k, v, bi, 16), run_nsa("torch", q, k, v, bi, 16)):
        close(a, b)
    iq, iw, ik = int_indexer(1, 40, 72, 4, 16, seed=12)
    ref = naive_topk(iq, iw, ik, 24)
    assert first_valid(kernels.index_topk(iq, iw, ik, 24, backend="triton"), 72, 40) == ref
