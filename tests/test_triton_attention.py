"""Triton attention (kernels/triton_attention.py) against a naive oracle and the torch backend.

Runs on CPU under the Triton interpreter (conftest sets TRITON_INTERPRET=1), fp32, small shapes.
The oracle builds the full score matrix in float64 with an explicit mask and the sink as an extra
softmax column; the kernels must match it (and the torch backend) to 1e-4 in outputs, lse and the
gradients of q, k, v and sinks.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import attention

tri = pytest.importorskip("kernels.triton_attention")

ATOL = 1e-4


def naive_attention(q, k, v, window=None, sinks=None, scale=None):
    """Full-matrix reference in float64. Returns (o [B,T,Hq,Dv], lse [B,Hq,T])."""
    B, T, Hq, Dk = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = Dk ** -0.5 if scale is None else scale
    group = Hq // Hkv
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(group, dim=2)                                   # [B,S,Hq,Dk]
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale                  # [B,Hq,T,S]
    i = torch.arange(T)[:, None] + (S - T)                                  # absolute query positions
    j = torch.arange(S)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double().view(1, Hq, 1, 1).expand(B, Hq, T, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :S]
    return torch.einsum("bhts,bshd->bthd", p, v), lse


def make_inputs(B, T, S, Hq, Hkv, Dk, Dv, with_sinks, seed=0, mult=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, Hq, Dk, generator=g) * mult).requires_grad_()
    k = (torch.randn(B, S, Hkv, Dk, generator=g) * mult).requires_grad_()
    v = torch.randn(B, S, Hkv, Dv, generator=g).requires_grad_()
    sinks = torch.randn(Hq, generator=g).requires_grad_() if with_sinks else None
    do = torch.randn(B, T, Hq, Dv, generator=g)
    return q, k, v, sinks, do


def grads(fn, q, k, v, sinks, do):
    o = fn()
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    return o, torch.autograd.grad(o, inputs, do)


def check(T, S, Hq, Hkv, Dk, Dv, window, with_sinks, B=2, scale=None, mult=1.0, seed=0, grad=True):
    q, k, v, sinks, do = make_inputs(B, T, S, Hq, Hkv, Dk, Dv, with_sinks, seed=seed, mult=mult)
    kw = dict(window=window, sinks=sinks, scale=scale)

    o_tri, lse_tri = tri.attention_triton_fwd(q.detach(), k.detach(), v.detach(), window=window,
                                             sinks=None if sinks is None else sinks.detach(), scale=scale)
    o_ref, lse_ref = naive_attention(q.detach(), k.detach(), v.detach(), **kw)
    assert o_tri.dtype == q.dtype and lse_tri.dtype == torch.float32
    torch.testing.assert_close(o_tri.double(), o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse_tri.double(), lse_ref, atol=ATOL, rtol=0)
    if not grad:
        return

    o, g_tri = grads(lambda: attention(q, k, v, **kw, backend="triton"), q, k, v, sinks, do)
    _, g_ref = grads(lambda: naive_attention(q, k, v, **kw)[0], q, k, v, sinks, do)
    o_torch, g_torch = grads(lambda: attention(q, k, v, **kw, backend="torch"), q, k, v, sinks, do)
    torch.testing.assert_close(o, o_torch, atol=ATOL, rtol=0)
    names = ["dq", "dk", "dv", "dsinks"]
    for name, a, b, c in zip(names, g_tri, g_ref, g_torch):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b.double(), atol=ATOL, rtol=0, msg=lambda m: f"{name} vs oracle: {m}")
        torch.testing.assert_close(a, c, atol=ATOL, rtol=0, msg=lambda m: f"{name} vs torch: {m}")


# (T, S): self-attention (T == S, T not a multiple of the blocks), prefill against a cache (T < S),
# decode (T == 1).
SHAPES = [(37, 37), (80, 80), (20, 77), (1, 50)]


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [None, 1, 16, 48, 200])
@pytest.mark.parametrize("T,S", SHAPES)
def test_causal_window_sinks(T, S, window, with_sinks):
    check(T, S, Hq=2, Hkv=1, Dk=32, Dv=32, window=window, with_sinks=with_sinks, B=1)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("T,S", [(37, 37), (20, 77)])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
def test_gqa_mqa(Hq, Hkv, T, S, window):
    check(T, S, Hq=Hq, Hkv=Hkv, Dk=32, Dv=32, window=window, with_sinks=True, seed=1, B=1)


@pytest.mark.parametrize("Dk,Dv", [(48, 32), (32, 48), (24, 40), (64, 64), (16, 16)])
def test_head_dims(Dk, Dv):
    check(45, 61, Hq=4, Hkv=2, Dk=Dk, Dv=Dv, window=24, with_sinks=True, seed=2)
    check(33, 33, Hq=2, Hkv=1, Dk=Dk, Dv=Dv, window=None, with_sinks=False, seed=3, B=1)


def test_large_logits_and_explicit_scale():
    # Logits up to ~190: exp would overflow fp32 without the running max. Forward only: the
    # gradients' fp32 error grows like |logit| * eps * |grad| (recomputing p = exp(s - lse) rounds
    # s and lse at ~1e-5 there, for any flash-style backward; the torch path misses 1e-4 too).
    check(50, 70, Hq=2, Hkv=1, Dk=32, Dv=32, window=None, with_sinks=True, scale=1.0, mult=3.0, B=1, grad=False)
    check(50, 70, Hq=2, Hkv=1, Dk=32, Dv=32, window=20, with_sinks=False, scale=1.0, mult=3.0, B=1, grad=False)
    # logits up to ~50, gradients included
    check(50, 70, Hq=2, Hkv=1, Dk=32, Dv=32, window=None, with_sinks=True, scale=1.0, mult=1.5, B=1)
    check(50, 70, Hq=2, Hkv=1, Dk=32, Dv=32, window=20, with_sinks=False, scale=0.5, mult=2.0, B=1)


def test_non_contiguous_inputs():
    B, T, S, Hq, Hkv, D = 2, 30, 40, 4, 2, 32
    g = torch.Generator().manual_seed(4)
    # q: heads-major storage seen through a transpose; k, v: slices of a fused kv tensor
    q = torch.randn(B, Hq, T, D, generator=g).transpose(1, 2).requires_grad_()
    kv = torch.randn(B, S, Hkv, 2 * D, generator=g)
    k, v = kv[..., :D].requires_grad_(), kv[..., D:].clone().transpose(1, 2).contiguous().transpose(1, 2)
    v.requires_grad_()
    sinks = torch.randn(Hq, generator=g).requires_grad_()
    do = torch.randn(B, Hq, T, D, generator=g).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or do.is_contiguous())
    kw = dict(window=12, sinks=sinks)
    o, g_tri = grads(lambda: attention(q, k, v, **kw, backend="triton"), q, k, v, sinks, do)
    o_ref, g_ref = grads(lambda: naive_attention(q, k, v, **kw)[0], q, k, v, sinks, do)
    torch.testing.assert_close(o.double(), o_ref, atol=ATOL, rtol=0)
    for a, b in zip(g_tri, g_ref):
        torch.testing.assert_close(a.double(), b.double(), atol=ATOL, rtol=0)


def test_half_precision_inputs():
    """fp16 in, fp16 out (fp32 accumulation inside); the interpreter has no bf16 arithmetic (SPEC 7)."""
    q, k, v, sinks, do = make_inputs(1, 30, 40, 4, 2, 48, 32, with_sinks=True, seed=7)
    q16, k16, v16 = [x.detach().half().requires_grad_() for x in (q, k, v)]
    o, g16 = grads(lambda: tri.attention_triton(q16, k16, v16, window=12, sinks=sinks), q16, k16, v16, sinks,
                   do.half())
    assert o.dtype == torch.float16 and [x.dtype for x in g16] == [torch.float16] * 3 + [torch.float32]
    q32, k32, v32 = [x.detach().float().requires_grad_() for x in (q16, k16, v16)]
    o_ref, g_ref = grads(lambda: naive_attention(q32, k32, v32, window=12, sinks=sinks)[0], q32, k32, v32, sinks,
                         do.half().float())
    torch.testing.assert_close(o.double(), o_ref.double(), atol=2e-3, rtol=0)   # fp16 output rounding
    for a, b in zip(g16, g_ref):
        torch.testing.assert_close(a.double(), b.double(), atol=4e-3, rtol=0)


def test_identities():
    q, k, v, sinks, do = make_inputs(1, 25, 40, 2, 1, 32, 32, with_sinks=True, seed=5)
    q, k, v = q.detach(), k.detach(), v.detach()
    plain = tri.attention_triton(q, k, v)
    # a window covering every key is global attention
    torch.testing.assert_close(tri.attention_triton(q, k, v, window=40), plain, atol=0, rtol=0)
    # a -inf sink is no sink, and its gradient is zero
    s = torch.full((2,), float("-inf"), requires_grad=True)
    o = tri.attention_triton(q, k, v, sinks=s)
    torch.testing.assert_close(o, plain, atol=1e-6, rtol=0)
    (ds,) = torch.autograd.grad(o, s, do)
    assert torch.equal(ds, torch.zeros(2))
    # sinks only shrink rows: o = o_plain * sigmoid(lse_plain - s_h)
    o_s = tri.attention_triton(q, k, v, sinks=sinks.detach())
    _, lse = tri.attention_triton_fwd(q, k, v)
    gate = torch.sigmoid(lse - sinks.detach().view(1, 2, 1)).transpose(1, 2).unsqueeze(-1)   # [B,T,Hq,1]
    torch.testing.assert_close(o_s, plain * gate, atol=1e-5, rtol=0)


@pytest.mark.parametrize("T,window", [(20, 16), (1, 16), (40, 8)])
def test_key_blocks_outside_window_are_never_read(T, window):
    """Poison the key blocks no query's window reaches with NaN: a kernel that loads them (even to
    mask them) turns NaN, since 0 * NaN = NaN in p @ V."""
    S, Hq, Hkv, D = 80, 2, 1, 32
    q, k, v, sinks, do = make_inputs(1, T, S, Hq, Hkv, D, D, with_sinks=True, seed=6)
    block_n = tri.INTERPRET_CONFIG["BLOCK_N"]
    first_needed = (S - T - window + 1) // block_n * block_n       # first key block any query sees
    assert first_needed >= block_n, "test shape must leave whole key blocks out of the window"
    k_bad, v_bad = k.detach().clone(), v.detach().clone()
    k_bad[:, :first_needed] = float("nan")
    v_bad[:, :first_needed] = float("nan")
    k_bad.requires_grad_()
    v_bad.requires_grad_()
    kw = dict(window=window, sinks=sinks)
    o, (dq, dk, dv, ds) = grads(lambda: tri.attention_triton(q, k_bad, v_bad, **kw), q, k_bad, v_bad, sinks, do)
    o_ref, (dq_r, dk_r, dv_r, ds_r) = grads(lambda: naive_attention(q, k, v, **kw)[0], q, k, v, sinks, do)
    torch.testing.assert_close(o.double(), o_ref, atol=ATOL, rtol=0)
    for a, b in [(dq, dq_r), (dk, dk_r), (dv, dv_r), (ds, ds_r)]:
        torch.testing.assert_close(a.double(), b.double(), atol=ATOL, rtol=0)
    assert torch.equal(dk[:, :first_needed], torch.zeros_like(dk[:, :first_needed]))


@triton.jit
def _ranges_kernel(OUT_Q, OUT_K, T, S, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Runs the kernels' own range helpers: row m of OUT_Q = key blocks of query block m,
    row n of OUT_K = query blocks of key block n, each (lo, full_lo, full_hi, hi)."""
    pid = tl.program_id(0)
    offset = S - T
    if pid * BLOCK_M < T:
        q_first = offset + pid * BLOCK_M
        q_last = offset + tl.minimum(pid * BLOCK_M + BLOCK_M - 1, T - 1)
        a, b, c, d = tri._key_blocks_for_queries(q_first, q_last, window, BLOCK_N)
        tl.store(OUT_Q + pid * 4 + 0, a)
        tl.store(OUT_Q + pid * 4 + 1, b)
        tl.store(OUT_Q + pid * 4 + 2, c)
        tl.store(OUT_Q + pid * 4 + 3, d)
    if pid * BLOCK_N < S:
        a, b, c, d = tri._query_blocks_for_keys(pid * BLOCK_N, offset, T, window, BLOCK_M, BLOCK_N)
        tl.store(OUT_K + pid * 4 + 0, a)
        tl.store(OUT_K + pid * 4 + 1, b)
        tl.store(OUT_K + pid * 4 + 2, c)
        tl.store(OUT_K + pid * 4 + 3, d)


@pytest.mark.parametrize("T,S,W", [(37, 37, 37), (80, 80, 16), (20, 77, 16), (1, 50, 1), (45, 61, 24),
                                   (33, 100, 5), (64, 64, 1), (70, 90, 90)])
def test_block_ranges(T, S, W):
    """The loop bounds: every visible (query, key) pair is visited from both sides,
    'full' blocks need no mask, and a query block visits O(W / BLOCK_N) key blocks."""
    bm, bn = 32, 16
    n_q, n_k = math.ceil(T / bm), math.ceil(S / bn)
    out_q = torch.full((max(n_q, n_k), 4), -1, dtype=torch.int32)
    out_k = torch.full((max(n_q, n_k), 4), -1, dtype=torch.int32)
    _ranges_kernel[(max(n_q, n_k),)](out_q, out_k, T, S, W, BLOCK_M=bm, BLOCK_N=bn)
    i = torch.arange(T)[:, None] + (S - T)
    j = torch.arange(S)[None, :]
    visible = (j <= i) & (j > i - W)
    pad = lambda x: torch.nn.functional.pad(x, (0, n_k * bn - S, 0, n_q * bm - T))  # noqa: E731
    visible_p = pad(visible)
    real_p = pad(torch.ones(T, S, dtype=torch.bool))

    visits = torch.zeros(n_q * bm, n_k * bn, dtype=torch.int32)
    for m in range(n_q):
        lo, full_lo, full_hi, hi = out_q[m].tolist()
        assert 0 <= lo <= full_lo <= full_hi <= hi <= n_k
        rows = slice(m * bm, (m + 1) * bm)
        visits[rows, lo * bn:hi * bn] += 1
        block = visible_p[rows, full_lo * bn:full_hi * bn]
        real = real_p[rows, full_lo * bn:full_hi * bn].any(dim=1)          # rows with t < T
        assert block[real].all(), "a 'full' key block has masked entries"
        assert hi - lo <= math.ceil((W + bm - 1) / bn) + 1, "window cost not O(W)"
    assert torch.equal(visits.bool() & visible_p, visible_p)

    visits = torch.zeros(n_q * bm, n_k * bn, dtype=torch.int32)
    for n in range(n_k):
        lo, full_lo, full_hi, hi = out_k[n].tolist()
        assert 0 <= lo <= full_lo <= full_hi <= hi <= n_q
        cols = slice(n * bn, (n + 1) * bn)
        visits[lo * bm:hi * bm, cols] += 1
        block = visible_p[full_lo * bm:full_hi * bm, cols]
        real = real_p[full_lo * bm:full_hi * bm, cols].any(dim=0)          # keys with j < S
        assert block[:, real].all(), "a 'full' query block has masked entries"
        assert real_p[full_lo * bm:full_hi * bm, cols].any(dim=1).all(), "a 'full' query block has padding rows"
        assert hi - lo <= math.ceil((W + bn - 1) / bm) + 1, "window cost not O(W)"
    assert torch.equal(visits.bool() & visible_p, visible_p)


def test_backend_none_on_cpu_uses_torch(monkeypatch):
    q, k, v, sinks, _ = make_inputs(1, 10, 12, 2, 1, 16, 16, with_sinks=True)

    def refuse(*args, **kwargs):
        raise AssertionError("backend=None picked triton on a CPU tensor")

    monkeypatch.setattr(tri, "attention_triton", refuse)
    assert kernels._pick(None, q) == "torch"
    o = attention(q, k, v, window=5, sinks=sinks)
    torch.testing.assert_close(o, attention(q, k, v, window=5, sinks=sinks, backend="torch"), atol=0, rtol=0)


def test_model_step_equals_forward_with_triton_backend():
    """A hybrid attention model on the Triton kernels: parallel forward, chunked prefill against the
    cache (T < S) and 1-token decode agree, and match the torch backend."""
    from test_model import check_step_equals_forward, make_model
    layers = {"local": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "window": 5, "sinks": True},
              "global": {"kind": "attn", "n_heads": 4, "n_kv_heads": 1}}
    model = make_model(layers, n_layer=2, backend="triton")
    check_step_equals_forward(model, T=24, B=1, splits=[9, 1, 1, 13])
    reference = make_model(layers, n_layer=2)
    idx = torch.randint(0, 61, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference(idx)[0], atol=1e-4, rtol=1e-4)
