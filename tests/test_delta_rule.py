"""The chunked delta rule (kernels/torch_delta_rule.py) against a token-by-token loop of the recurrence.

Oracle (SPEC 4), per head:  S' = Diag(exp(g_t)) S;  S = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S^T (scale q_t).
The op runs in float32; the loop runs in float64 on the same values.
"""

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.torch_delta_rule import (delta_rule_step_torch, delta_rule_torch, linear_attention_step_torch,
                                linear_attention_torch)
from tests.test_varlen import cu_of, docs

B, H, K, V = 2, 2, 32, 48
TOL = 1e-4


def loop_delta_rule(q, k, v, g, beta, scale, S0):
    """Token-by-token recurrence. q,k [B,T,H,K] v [B,T,H,V] g [B,T,H,K] or [B,T,H] beta [B,T,H]."""
    Bq, T, Hq, Kq = q.shape
    S = torch.zeros(Bq, Hq, Kq, v.shape[-1], dtype=q.dtype) if S0 is None else S0
    outs = []
    for t in range(T):
        decay = torch.exp(g[:, t])
        decay = decay[..., None] if g.dim() == 4 else decay[..., None, None]
        S = S * decay
        read = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - read))[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, dim=1), S


def loop_linear(q, k, v, scale, S0):
    Bq, T, Hq, Kq = q.shape
    S = torch.zeros(Bq, Hq, Kq, v.shape[-1], dtype=q.dtype) if S0 is None else S0
    outs = []
    for t in range(T):
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, dim=1), S


def make_inputs(T, per_channel, with_state, seed=0, b=B, h=H, kd=K, vd=V):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q = F.normalize(r(b, T, h, kd), dim=-1)                      # the layer L2-normalises q and k
    k = F.normalize(r(b, T, h, kd), dim=-1)
    v = r(b, T, h, vd)
    g_shape = (b, T, h, kd) if per_channel else (b, T, h)
    g = -F.softplus(r(*g_shape) * 2 - 2)                         # log decays, mostly in (-2, 0)
    beta = torch.sigmoid(r(b, T, h))
    S0 = r(b, h, kd, vd) * 0.5 if with_state else None
    return q, k, v, g, beta, S0


def rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def leaves(tensors, dtype):
    return [None if t is None else t.to(dtype).detach().requires_grad_() for t in tensors]


def run_and_grad(fn, inputs, T, seed=1):
    """fn(*inputs) -> (o, S); returns o, S and the grads of a fixed random projection of both."""
    o, S = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=gen).to(o.dtype)
    w_s = torch.randn(S.shape, generator=gen).to(S.dtype)
    ((o * w_o).sum() + (S * w_s).sum()).backward()
    return o, S, [None if t is None else t.grad for t in inputs]


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 200])
@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=0", "s0"])
def test_chunked_matches_loop(T, per_channel, with_state):
    raw = make_inputs(T, per_channel, with_state)
    scale = K ** -0.5
    x32 = leaves(raw, torch.float32)
    x64 = leaves(raw, torch.float64)
    o, S, grads = run_and_grad(
        lambda q, k, v, g, beta, S0: delta_rule_torch(q, k, v, g, beta, scale=scale, initial_state=S0,
                                                      output_final_state=True), x32, T)
    o_ref, S_ref, grads_ref = run_and_grad(
        lambda q, k, v, g, beta, S0: loop_delta_rule(q, k, v, g, beta, scale, S0), x64, T)
    assert o.dtype == torch.float32 and o.shape == (B, T, H, V)
    assert S.dtype == torch.float32 and S.shape == (B, H, K, V)
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(S, S_ref) <= TOL
    for name, gr, gr_ref in zip(["q", "k", "v", "g", "beta", "S0"], grads, grads_ref):
        if gr_ref is None:
            continue
        assert torch.isfinite(gr).all(), name
        assert rel_err(gr, gr_ref) <= TOL, (name, rel_err(gr, gr_ref))


def test_no_final_state_and_default_scale():
    q, k, v, g, beta, _ = make_inputs(70, True, False)
    o, S = delta_rule_torch(q, k, v, g, beta)
    assert S is None
    o_ref, _ = loop_delta_rule(*[t.double() for t in (q, k, v, g, beta)], K ** -0.5, None)
    assert rel_err(o, o_ref) <= TOL


def test_bf16_in_fp32_state():
    q, k, v, g, beta, S0 = make_inputs(65, True, True)
    o, S = delta_rule_torch(*[t.bfloat16() for t in (q, k, v, g, beta)], initial_state=S0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_ref, S_ref = loop_delta_rule(*[t.bfloat16().double() for t in (q, k, v, g, beta)], K ** -0.5, S0.double())
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(S, S_ref) <= 1e-3


def test_kda_with_constant_gate_equals_gdn():
    q, k, v, g, beta, S0 = make_inputs(100, False, True)
    o1, S1 = delta_rule_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    g_kda = g[..., None].expand(*g.shape, K)
    o2, S2 = delta_rule_torch(q, k, v, g_kda, beta, initial_state=S0, output_final_state=True)
    assert rel_err(o2, o1.double()) <= TOL and rel_err(S2, S1.double()) <= TOL


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_step_matches_loop(per_channel):
    T = 20
    q, k, v, g, beta, S0 = make_inputs(T, per_channel, True)
    o_ref, S_ref = loop_delta_rule(*[t.double() for t in (q, k, v, g, beta)], K ** -0.5, S0.double())
    state = S0.clone()
    outs = [delta_rule_step_torch(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state) for t in range(T)]
    assert rel_err(torch.stack(outs, 1), o_ref) <= TOL
    assert rel_err(state, S_ref) <= TOL                           # updated in place


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_chunked_prefill_then_step(per_channel):
    """Chunked over a prefix, then token steps from its final state, equals the chunked op on the whole."""
    q, k, v, g, beta, _ = make_inputs(75, per_channel, False)
    o_all, S_all = delta_rule_torch(q, k, v, g, beta, output_final_state=True)
    o_pre, state = delta_rule_torch(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], output_final_state=True)
    outs = [delta_rule_step_torch(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state) for t in range(70, 75)]
    o_cat = torch.cat([o_pre, torch.stack(outs, 1)], dim=1)
    assert rel_err(o_cat, o_all.double()) <= TOL and rel_err(state, S_all.double()) <= TOL


@pytest.mark.parametrize("T", [1, 65, 200])
def test_linear_attention_matches_loop(T):
    q, k, v, _, _, S0 = make_inputs(T, True, True)
    scale = 0.7
    x32, x64 = leaves((q, k, v, S0), torch.float32), leaves((q, k, v, S0), torch.float64)
    o, S, grads = run_and_grad(lambda q, k, v, S0: linear_attention_torch(
        q, k, v, scale=scale, initial_state=S0, output_final_state=True), x32, T)
    o_ref, S_ref, grads_ref = run_and_grad(lambda q, k, v, S0: loop_linear(q, k, v, scale, S0), x64, T)
    assert rel_err(o, o_ref) <= TOL and rel_err(S, S_ref) <= TOL
    for gr, gr_ref in zip(grads, grads_ref):
        assert rel_err(gr, gr_ref) <= TOL
    state = S0.clone()
    outs = [linear_attention_step_torch(q[:, t], k[:, t], v[:, t], state, scale=scale) for t in range(min(T, 20))]
    assert rel_err(torch.stack(outs, 1), o_ref[:, :len(outs)]) <= TOL


@pytest.mark.parametrize("op", ["delta_rule", "linear"])
@pytest.mark.parametrize("lens", [[130], [3, 41, 13], [3, 70, 57]], ids=["row", "packed_1_chunk", "packed"])
def test_float64_inputs_compute_in_float64(op, lens):
    """float64 in, float64 out, equal to the token loop to 1e-12, packed documents too (each document's
    loop starts from a zero state). Linear attention's packed path once kept a float32 start state, which
    failed on one chunk."""
    q, k, v, g, beta, _ = [t if t is None else t.double() for t in make_inputs(sum(lens), True, False, b=1)]
    cu = cu_of(lens) if len(lens) > 1 else None
    if op == "delta_rule":
        o, _ = delta_rule_torch(q, k, v, g, beta, cu_seqlens=cu)
        loop = lambda a, b: loop_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], K ** -0.5, None)[0]
    else:
        o, _ = linear_attention_torch(q, k, v, cu_seqlens=cu)
        loop = lambda a, b: loop_linear(q[:, a:b], k[:, a:b], v[:, a:b], K ** -0.5, None)[0]
    ref = torch.cat([loop(a, b) for a, b in docs(lens)], dim=1)
    assert o.dtype == torch.float64
    assert rel_err(o, ref) <= 1e-12


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_strong_decay_finite(per_channel):
    """log decays of -20 per step on some channels (G reaches -1280 inside a chunk), ~0 on others."""
    T = 1024
    q, k, v, g, beta, S0 = make_inputs(T, per_channel, True, b=1, h=2)
    if per_channel:
        g = torch.where(torch.arange(K) % 2 == 0, -20.0, -1e-4).expand_as(g).clone()
    else:
        g = torch.where(torch.arange(T)[None, :, None] % 3 == 0, -20.0, -1e-4).expand_as(g).clone()
    x = leaves((q, k, v, g, beta, S0), torch.float32)
    o, S = delta_rule_torch(*x[:5], initial_state=x[5], output_final_state=True)
    ((o ** 2).sum() + S.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    for t in x:
        assert torch.isfinite(t.grad).all()
    with torch.no_grad():
        o_ref, S_ref = loop_delta_rule(*[t.double() for t in (q, k, v, g, beta)], K ** -0.5, S0.double())
    assert rel_err(o, o_ref) <= TOL and rel_err(S, S_ref) <= TOL


def dispatcher(name):
    """kernels.<name>, the dispatch function."""
    return getattr(kernels, name)


def test_dispatcher():
    q, k, v, g, beta, S0 = make_inputs(65, True, True)
    o, S = dispatcher("delta_rule")(q, k, v, g, beta, initial_state=S0, output_final_state=True, backend="torch")
    o2, S2 = delta_rule_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(S, S2)
    state = S0.clone()
    o_step = dispatcher("delta_rule_step")(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, backend="torch")
    o_ref, S_ref = loop_delta_rule(*[t[:, :1].double() for t in (q, k, v, g, beta)], K ** -0.5, S0.double())
    assert rel_err(o_step, o_ref[:, 0]) <= TOL and rel_err(state, S_ref) <= TOL


def saved_bytes(fn):
    """Bytes of the distinct storages autograd saves for backward while running fn()."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def test_memory_linear_in_T():
    def run(T):
        q, k, v, g, beta, _ = make_inputs(T, True, False, b=1, h=2, kd=32, vd=32)
        x = leaves((q, k, v, g, beta), torch.float32)
        nbytes, (o, _) = saved_bytes(lambda: delta_rule_torch(*x))
        o.sum().backward()
        return nbytes

    small, big = run(1024), run(4096)
    assert big <= 4.5 * small, (small, big)
    # far from a pairwise [T, C, C, K] decay tensor: all that is saved is less than one [T, C, K] tensor
    # (C = 64), about 40 copies of a [T, H, K] input
    assert small < 1024 * 64 * 2 * 32 * 4, small


def test_non_contiguous_inputs():
    """The layer may hand over [B,T,H,D] views of [B,H,T,D] tensors."""
    q, k, v, g, beta, S0 = make_inputs(70, True, True)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, g, beta)]
    assert not views[0].is_contiguous()
    o1, S1 = delta_rule_torch(*views, initial_state=S0, output_final_state=True)
    o2, S2 = delta_rule_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(S1, S2)


def strong_decay(g, per_channel, T):
    """Log decays of -20 per step on some channels (or steps), the drawn ones elsewhere. Not on step 0
    of a per-head gate: at T=1 the whole gradient of g would then be exp(-20)-small, a sum of O(1) terms
    that cancel, and no float arithmetic (autograd's included) gets its relative error below 1e-5."""
    if per_channel:
        return torch.where(torch.arange(g.shape[-1]) % 3 == 0, -20.0, g)
    return torch.where(torch.arange(T)[None, :, None] % 5 == 1, -20.0, g)


@pytest.mark.parametrize("T, cu_seqlens", [(1, None), (63, None), (64, None), (65, None), (200, None),
                                           (300, [0, 1, 3, 66, 130, 131, 300]),
                                           (600, [0, 190, 200, 500, 530, 600])], ids=str)
@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_hand_backward_equals_autograd(T, cu_seqlens, per_channel, keep, monkeypatch):
    """The hand-written backward (_ChunkedDeltaRule) equals autograd through the same chunked forward
    math (_chunk_forward), for every input, with an initial state and strong decay; in float64 (the
    math exactly) and in float32 (the op as it runs, against autograd in float32: both carry the same
    float32 rounding, up to 2e-5 from the float64 loop here for a per-head gate). Packed documents:
    boundaries inside chunks and across the spans the forward (8 chunks) and backward (3) walk. Both ways
    the backward gets its chunk operators: kept from the forward (short sequences) and recomputed (long)."""
    from kernels import torch_delta_rule
    from kernels.torch_delta_rule import _chunk_forward, _chunked_inputs, _from_chunks
    monkeypatch.setattr(torch_delta_rule, "KEEP_CHUNKS", 10 ** 6 if keep else 0)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    q, k, v, g, beta, S0 = make_inputs(T, per_channel, True)
    raw = (q, k, v, strong_decay(g, per_channel, T), beta, S0)
    scale = K ** -0.5

    def by_autograd(q, k, v, g, beta, S0):
        *chunked, masks = _chunked_inputs(q, k, v, g, beta, scale, cu_seqlens=cu)
        O, S, _ = _chunk_forward(*chunked, S0, masks)
        return _from_chunks(O, T), S[:, :, -1]

    by_hand = lambda q, k, v, g, beta, S0: delta_rule_torch(q, k, v, g, beta, scale=scale, initial_state=S0,
                                                           output_final_state=True, cu_seqlens=cu)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        _, _, grads_ref = run_and_grad(by_autograd, leaves(raw, dtype), T)
        _, _, grads = run_and_grad(by_hand, leaves(raw, dtype), T)
        for name, gr, gr_ref in zip(["q", "k", "v", "g", "beta", "S0"], grads, grads_ref):
            assert gr.dtype == dtype and rel_err(gr, gr_ref) <= tol, (name, dtype, rel_err(gr, gr_ref))


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_hand_backward_saves_inputs_and_states(per_channel):
    """What the op keeps for backward. Longer than KEEP_CHUNKS chunks: its inputs and the N+1 chunk states,
    nothing else. Up to KEEP_CHUNKS: also the chunked inputs and the chunk operators of every chunk (in
    float32: q, k, v, G, beta; P and T_inv [C, C]; W|U [C, K+V]; q_decayed, k_to_end [C, K]; the state decay
    [K or 1]), and nothing when no input needs a gradient."""
    from kernels.torch_delta_rule import KEEP_CHUNKS
    b, h, kd, vd, C = 1, 2, 32, 32, 64
    for T in (KEEP_CHUNKS * C + 1, 1024, KEEP_CHUNKS * C, 200):
        N = -(-T // C)
        q, k, v, g, beta, _ = make_inputs(T, per_channel, False, b=b, h=h, kd=kd, vd=vd)
        x = leaves((q, k, v, g, beta), torch.float32)
        nbytes, _ = saved_bytes(lambda: delta_rule_torch(*x))
        expected = sum(t.nbytes for t in x) + b * h * (N + 1) * kd * vd * 4
        if N <= KEEP_CHUNKS:
            gate = kd if per_channel else 1
            per_chunk = C * (kd + kd + vd + gate + 1) + 2 * C * C + C * (kd + vd) + 2 * C * kd + gate
            expected += b * h * N * per_chunk * 4
        assert nbytes == expected, (T, nbytes, expected)
    x = [t.detach() for t in x]
    assert saved_bytes(lambda: delta_rule_torch(*x))[0] == 0


@pytest.mark.parametrize("T", [200, 1000])
def test_second_backward_of_a_kept_graph(T):
    """retain_graph: a second backward through the same forward (kept operators at T=200, recomputed at 1000)
    gives the first one's gradients exactly."""
    q, k, v, g, beta, S0 = make_inputs(T, True, True)
    x = leaves((q, k, v, g, beta, S0), torch.float32)
    o, S = delta_rule_torch(*x[:5], initial_state=x[5], output_final_state=True)
    loss = (o * torch.randn_like(o)).sum() + (S * torch.randn_like(S)).sum()
    first = torch.autograd.grad(loss, x, retain_graph=True)
    second = torch.autograd.grad(loss, x)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("T", [200, 1000])
def test_float32_under_autocast(T):
    """The op computes in float32 also under bf16 autocast (as its backward always did): output, final state
    and gradients equal the op's without autocast (kept operators at T=200, recomputed at 1000). Its forward
    matmuls ran in bf16 under autocast before; kept, such operators would reach the backward in bf16."""
    q, k, v, g, beta, S0 = make_inputs(T, True, True)
    x = leaves((q, k, v, g, beta, S0), torch.float32)

    def run(autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o, S = delta_rule_torch(*x[:5], initial_state=x[5], output_final_state=True)
        loss = (o * torch.linspace(-1, 1, o.shape[-1])).sum() + S.sum()
        return o, S, torch.autograd.grad(loss, x)

    o, S, grads = run(False)
    o_ac, S_ac, grads_ac = run(True)
    assert o_ac.dtype == torch.float32 and torch.equal(o_ac, o) and torch.equal(S_ac, S)
    assert all(torch.equal(a, b) for a, b in zip(grads_ac, grads))


def test_keeps_operators_only_where_a_backward_can_come(monkeypatch):
    """The forward walks the backward's small groups and keeps their operators only when a backward can follow:
    under no_grad (inputs that require grad or not) and for inputs without grad it walks GROUP_FORWARD chunks a
    group, as before the keeping. T=256: 4 chunks, one group of 8 or two of 3 (2 + 2)."""
    from kernels import torch_delta_rule as D
    calls = []
    real = D._chunk_forward
    monkeypatch.setattr(D, "_chunk_forward", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    q, k, v, g, beta, _ = make_inputs(256, True, False)
    x = leaves((q, k, v, g, beta), torch.float32)
    with torch.no_grad():
        o_no_grad, _ = delta_rule_torch(*x)
    assert calls == [4]
    delta_rule_torch(*[t.detach() for t in x])
    assert calls == [4, 4]
    o, _ = delta_rule_torch(*x)
    assert calls == [4, 4, 2, 2] and torch.equal(o, o_no_grad)
