"""Sparse attention in Triton: the GPU paths of the ops in kernels/torch_sparse.py (SPEC 3, 5).

A query t of T sits at absolute position i = S - T + t and never sees a key j > i. Softmax is the
online (flash) softmax of triton_attention.py: exp2 on log2-scaled logits, lse saved in log2 units,
the backward recomputes p = exp2(s - lse2) and uses ds = p * (dp - delta), delta = rowsum(dO * O).

DSA, sparse_mla_attention (absorbed MLA: one latent kv row per key, shared by all H heads)
    One program per (query, batch, tile of BLOCK_H heads). The heads are the rows of the tile, so
    each selected latent row is loaded once for BLOCK_H heads; the query's k indices are walked
    BLOCK_K at a time: a [BLOCK_H, BLOCK_K] tile of scores is all that ever exists. A row's first
    d_v dims are both key part and value (loaded once): s = q[:d_v] . kv[:d_v] + q[d_v:] . kv[d_v:].
    Padding indices (< 0 or > i) are masked before the softmax: no probability, no load, no gradient.
    Backward: the same walk; dq stays in registers, d(kv) of each selected row is added with fp32
    atomics into a [B, S, Dk] fp32 buffer (many queries select the same key). Atomics make the
    summation order, hence the last bits of d(kv), vary run to run on a GPU.

DSA indexer, index_topk
    One program per block of BLOCK_M queries. Key tiles of BLOCK_N keys are streamed: scores
    [BLOCK_M, BLOCK_N] are computed in registers, packed with the key position into int64
    (order-preserving float bits << 32 | position, as topk_select), and merged into a running top-KP
    (KP = next_pow2(k)) held in registers: with the running list sorted descending and the tile
    (padded to KP with int64 min) sorted ascending, the elementwise max is exactly the top KP of their
    union (a bitonic half-cleaner), sorted again; a tile that improves no row's list is not merged.
    Only key tiles some query of the block can see are visited; the T x S scores are never written.
    Unmeasured on a GPU: at k = 2048 the running list is [16, 2048] int64 per program, which will
    likely spill registers (a radix-select threshold pass is the known alternative).

NSA selection, block_sparse_attention (the NSA paper's kernel)
    One program per (query, batch * kv head); the G = Hq // Hkv query heads of the GQA group are the
    rows of the tile, so each selected K/V block is loaded once for the whole group. Unused slots
    (-1) and blocks after the query are skipped. Backward: dq in registers, dK/dV with fp32 atomics.
"""
import torch
import triton
import triton.language as tl

from .triton_attention import INTERPRET, LN2, _on_device
from .triton_autotune import autotune

LOG2E_ = 1.4426950408889634
INT64_MIN = -(2 ** 63)


def _head_block(d):
    return max(16, triton.next_power_of_2(d))


def _precision(x):
    return "ieee" if x.dtype == torch.float32 else "tf32"    # fp32 inputs: no tf32 rounding in tl.dot


def _autotune(configs, key, **kw):
    """Autotune on a GPU; the interpreter has no autotuner: the launcher passes one fixed config."""
    if INTERPRET:
        return lambda fn: fn
    return autotune(configs, key=key, **kw)


def _fixed(**meta):
    return dict(meta) if INTERPRET else {}


# ================================================================== DSA: sparse MLA attention

# first: what exact fp32 launches use untuned (kernels/triton_autotune.py), the one spilling least
_MLA_CONFIGS = [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                for bh, bk, w, st in [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2)]]
_MLA_INTERPRET = dict(BLOCK_H=16, BLOCK_K=16)


@triton.jit
def _mla_rows(KV_b, IDX_t, stride_kvs, stride_kvd, stride_ik, k0, pos, K, Dv, Dr,
              BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """The selected rows k0 .. k0 + BLOCK_K of one query: (valid [BK], rows [BK], ka [BK, BDV], kb [BK, BDR])."""
    kk = k0 + tl.arange(0, BLOCK_K)
    idx = tl.load(IDX_t + kk * stride_ik, mask=kk < K, other=-1)
    valid = (idx >= 0) & (idx <= pos)
    rows = tl.where(valid, idx, 0).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    ka = tl.load(KV_b + rows[:, None] * stride_kvs + dv[None, :] * stride_kvd,
                 mask=valid[:, None] & (dv[None, :] < Dv), other=0.0)                     # [BK, BDV]: key and value
    kb = tl.load(KV_b + rows[:, None] * stride_kvs + (Dv + dr)[None, :] * stride_kvd,
                 mask=valid[:, None] & (dr[None, :] < Dr), other=0.0)                     # [BK, BDR]: rest of key
    return valid, rows, ka, kb


@_autotune(_MLA_CONFIGS, key=["H", "BLOCK_DV", "BLOCK_DR"])   # not K: it grows every decode step
@triton.jit
def _mla_fwd_kernel(Q, KV, IDX, O, LSE2,
                    stride_qb, stride_qt, stride_qh, stride_qd,
                    stride_kvb, stride_kvs, stride_kvd,
                    stride_ib, stride_it, stride_ik,
                    stride_ob, stride_ot, stride_oh, stride_od,
                    T, S, H, K, Dv, Dr, sm_scale,
                    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)                      # offsets past 2**31 at long T
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_in = h < H
    pos = S - T + t
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    Q_t = Q + b * stride_qb + t * stride_qt + h[:, None] * stride_qh
    qa = tl.load(Q_t + dv[None, :] * stride_qd, mask=h_in[:, None] & (dv[None, :] < Dv), other=0.0)         # [BH, BDV]
    qb = tl.load(Q_t + (Dv + dr)[None, :] * stride_qd, mask=h_in[:, None] & (dr[None, :] < Dr), other=0.0)  # [BH, BDR]
    KV_b = KV + b * stride_kvb
    IDX_t = IDX + b * stride_ib + t * stride_it
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        valid, rows, ka, kb = _mla_rows(KV_b, IDX_t, stride_kvs, stride_kvd, stride_ik, k0, pos, K, Dv, Dr,
                                        BLOCK_K, BLOCK_DV, BLOCK_DR)
        s = tl.dot(qa, tl.trans(ka), input_precision=PRECISION) + tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))                       # [BH, BK], log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(ka.dtype), ka, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)                      # a row with no valid index: o = 0, lse = -inf
    lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(O + b * stride_ob + t * stride_ot + h[:, None] * stride_oh + dv[None, :] * stride_od,
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=h_in[:, None] & (dv[None, :] < Dv))
    tl.store(LSE2 + (b * T + t) * H + h, lse2, mask=h_in)


@_autotune(_MLA_CONFIGS, key=["H", "BLOCK_DV", "BLOCK_DR"], reset_to_zero=["DKV"])
@triton.jit
def _mla_bwd_kernel(Q, KV, IDX, DO, LSE2, DELTA, DQ, DKV,
                    stride_qb, stride_qt, stride_qh, stride_qd,
                    stride_kvb, stride_kvs, stride_kvd,
                    stride_ib, stride_it, stride_ik,
                    stride_dob, stride_dot, stride_doh, stride_dod,
                    T, S, H, K, Dv, Dr, sm_scale,
                    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """dQ [B,T,H,Dk] (q's strides), dKV [B,S,Dk] fp32 contiguous, accumulated with atomics."""
    t = tl.program_id(0).to(tl.int64)                      # offsets past 2**31 at long T
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_in = h < H
    pos = S - T + t
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    Q_t = Q + b * stride_qb + t * stride_qt + h[:, None] * stride_qh
    qa = tl.load(Q_t + dv[None, :] * stride_qd, mask=h_in[:, None] & (dv[None, :] < Dv), other=0.0)
    qb = tl.load(Q_t + (Dv + dr)[None, :] * stride_qd, mask=h_in[:, None] & (dr[None, :] < Dr), other=0.0)
    do = tl.load(DO + b * stride_dob + t * stride_dot + h[:, None] * stride_doh + dv[None, :] * stride_dod,
                 mask=h_in[:, None] & (dv[None, :] < Dv), other=0.0)                      # [BH, BDV]
    lse2 = tl.load(LSE2 + (b * T + t) * H + h, mask=h_in, other=0.0)
    delta = tl.load(DELTA + (b * T + t) * H + h, mask=h_in, other=0.0)
    live = h_in & (lse2 > float("-inf"))                     # real heads of a row with some valid index
    lse2 = tl.where(live, lse2, 0.0)
    KV_b = KV + b * stride_kvb
    DKV_b = DKV + b * S * (Dv + Dr)
    IDX_t = IDX + b * stride_ib + t * stride_it
    qk_scale = sm_scale * 1.4426950408889634

    dqa = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    dqb = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        valid, rows, ka, kb = _mla_rows(KV_b, IDX_t, stride_kvs, stride_kvd, stride_ik, k0, pos, K, Dv, Dr,
                                        BLOCK_K, BLOCK_DV, BLOCK_DR)
        s = tl.dot(qa, tl.trans(ka), input_precision=PRECISION) + tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
        p = tl.where(live[:, None] & valid[None, :], tl.exp2(s * qk_scale - lse2[:, None]), 0.0)   # [BH, BK]
        dp = tl.dot(do, tl.trans(ka), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])                                                  # d(logit), unscaled
        dqa += tl.dot(ds.to(ka.dtype), ka, input_precision=PRECISION)
        dqb += tl.dot(ds.to(kb.dtype), kb, input_precision=PRECISION)
        dka = (tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
               + tl.dot(tl.trans(ds).to(qa.dtype), qa, input_precision=PRECISION) * sm_scale)   # [BK, BDV]
        dkb = tl.dot(tl.trans(ds).to(qb.dtype), qb, input_precision=PRECISION) * sm_scale       # [BK, BDR]
        tl.atomic_add(DKV_b + rows[:, None] * (Dv + Dr) + dv[None, :], dka, mask=valid[:, None] & (dv[None, :] < Dv))
        tl.atomic_add(DKV_b + rows[:, None] * (Dv + Dr) + (Dv + dr)[None, :], dkb,
                      mask=valid[:, None] & (dr[None, :] < Dr))

    DQ_t = DQ + b * stride_qb + t * stride_qt + h[:, None] * stride_qh
    tl.store(DQ_t + dv[None, :] * stride_qd, (dqa * sm_scale).to(DQ.dtype.element_ty),
             mask=h_in[:, None] & (dv[None, :] < Dv))
    tl.store(DQ_t + (Dv + dr)[None, :] * stride_qd, (dqb * sm_scale).to(DQ.dtype.element_ty),
             mask=h_in[:, None] & (dr[None, :] < Dr))


def _mla_args(q, kv, indices, d_v):
    B, T, H, Dk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    grid = lambda meta: (T, B, triton.cdiv(H, meta["BLOCK_H"]))  # noqa: E731
    shape = (T, S, H, K, d_v, Dk - d_v)
    consts = dict(PRECISION=_precision(q), BLOCK_DV=_head_block(d_v), BLOCK_DR=_head_block(max(Dk - d_v, 1)))
    return grid, shape, consts


# torch.library ops: opaque to torch.compile, fake impls for shapes, registered autograd.

@torch.library.custom_op("hybrid::sparse_mla_fwd", mutates_args=())
def _sparse_mla_fwd_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, Dk = q.shape
    grid, shape, consts = _mla_args(q, kv, indices, d_v)
    o = torch.empty(B, T, H, d_v, device=q.device, dtype=q.dtype)
    lse2 = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    with _on_device(q):
        _mla_fwd_kernel[grid](q, kv, indices, o, lse2, *q.stride(), *kv.stride(), *indices.stride(), *o.stride(),
                              *shape, scale, **consts, **_fixed(**_MLA_INTERPRET))
    return o, lse2


@_sparse_mla_fwd_op.register_fake
def _(q, kv, indices, d_v, scale):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, d_v), q.new_empty(B, T, H, dtype=torch.float32)


@torch.library.custom_op("hybrid::sparse_mla_bwd", mutates_args=())
def _sparse_mla_bwd_op(do: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, o: torch.Tensor,
                       lse2: torch.Tensor, d_v: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    grid, shape, consts = _mla_args(q, kv, indices, d_v)
    delta = (do.float() * o.float()).sum(-1).contiguous()                   # [B, T, H]
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    with _on_device(q):
        _mla_bwd_kernel[grid](q, kv, indices, do, lse2, delta, dq, dkv, *q.stride(), *kv.stride(),
                              *indices.stride(), *do.stride(), *shape, scale, **consts, **_fixed(**_MLA_INTERPRET))
    return dq, dkv.to(kv.dtype)


@_sparse_mla_bwd_op.register_fake
def _(do, q, kv, indices, o, lse2, d_v, scale):
    return torch.empty_like(q), kv.new_empty(kv.shape)


def _sparse_mla_setup(ctx, inputs, output):
    q, kv, indices, d_v, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, kv, indices, *output)
    ctx.d_v, ctx.scale = d_v, scale


def _sparse_mla_grad(ctx, do, _dlse2):
    q, kv, indices, o, lse2 = ctx.saved_tensors
    dq, dkv = _sparse_mla_bwd_op(do, q, kv, indices, o, lse2, ctx.d_v, ctx.scale)
    return dq, dkv, None, None, None


torch.library.register_autograd("hybrid::sparse_mla_fwd", _sparse_mla_grad, setup_context=_sparse_mla_setup)


def sparse_mla_attention_triton(q, kv, indices, *, d_v, scale):
    """See kernels.sparse_mla_attention. Returns (o [B,T,H,d_v], lse [B,T,H] fp32, natural log)."""
    o, lse2 = _sparse_mla_fwd_op(q, kv, indices, int(d_v), float(scale))  # one dtype: kernels._one_dtype
    return o, lse2 * LN2


# ================================================================== DSA: the indexer's top-k

@triton.jit
def _index_topk_kernel(IQ, IW, IK, OUT,
                       stride_qb, stride_qt, stride_qh, stride_qd,
                       stride_wb, stride_wt, stride_wh,
                       stride_kb, stride_ks, stride_kd,
                       T, S, HI, DI, K, score_scale,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t_in = t < T
    q_pos = S - T + t                                                                   # [BM]
    d = tl.arange(0, BLOCK_D)
    slot = tl.arange(0, KP // BLOCK_N)                                                  # [R]: R * BLOCK_N = KP
    top = tl.full([BLOCK_M, KP], -9223372036854775808, dtype=tl.int64)                  # running top-KP, descending
    q_last = S - T + tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T - 1)
    for c0 in range(0, q_last + 1, BLOCK_N):                                             # key tiles some query sees
        k_pos = c0 + tl.arange(0, BLOCK_N)
        kT = tl.load(IK + b * stride_kb + k_pos[None, :] * stride_ks + d[:, None] * stride_kd,
                     mask=(k_pos[None, :] < S) & (d[:, None] < DI), other=0.0)          # [BD, BN]
        score = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for h in range(HI):
            q = tl.load(IQ + b * stride_qb + t[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd,
                        mask=t_in[:, None] & (d[None, :] < DI), other=0.0)
            w = tl.load(IW + b * stride_wb + t * stride_wt + h * stride_wh, mask=t_in, other=0.0).to(tl.float32)
            score += w[:, None] * tl.maximum(tl.dot(q, kT, input_precision=PRECISION), 0.0)
        score = score * score_scale
        score = tl.where(score == 0.0, 0.0, score)                                     # -0 -> +0, as topk_select
        bits = score.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)                                    # order-preserving int
        key = (ordered.to(tl.int64) << 32) | k_pos[None, :].to(tl.int64)                # (score, position)
        seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < S)
        key = tl.where(seen, key, -9223372036854775808)                                 # [BM, BN]
        # the tile sorted ascending (padded to KP entries with "nothing", int64 min, when KP > BLOCK_N); its
        # max with the descending running list is the top KP of both (a bitonic half-cleaner), sorted again.
        # Where the tile is the list's length, merge only when some row gains a key (once the lists are full,
        # most tiles are skipped); the padded merge stays unconditional: on sm_90 in bf16 Triton 3.9 cannot
        # compile that `if` around the reshape (a layout mismatch; bench/compile_sm90.py)
        if KP == BLOCK_N:
            gains = tl.max(key, 1) > tl.min(top, 1)                                     # [BM]
            if tl.max(gains.to(tl.int32), 0) > 0:
                top = tl.sort(tl.maximum(top, tl.sort(key, 1, descending=False)), 1, descending=True)
        else:
            pad = tl.where(slot[None, :, None] == 0, key[:, None, :], -9223372036854775808)  # [BM, R, BN]
            pad = tl.sort(tl.reshape(pad, [BLOCK_M, KP]), 1, descending=False)
            top = tl.sort(tl.maximum(top, pad), 1, descending=True)
    col = tl.arange(0, KP)
    out = tl.where(top == -9223372036854775808, -1, top - ((top >> 32) << 32))         # low 32 bits; unfilled: -1
    tl.store(OUT + (b * T + t[:, None]) * K + col[None, :], out, mask=t_in[:, None] & (col[None, :] < K))


def index_topk_meta(KP, interpret=INTERPRET):
    """The top-k kernel's key tile and warps (not autotuned): 16-key tiles under the interpreter."""
    if interpret:
        return dict(BLOCK_N=min(KP, 16))
    return dict(BLOCK_N=min(KP, 128), num_warps=8 if KP >= 1024 else 4)


@torch.library.custom_op("hybrid::index_topk", mutates_args=())
def _index_topk_op(iq: torch.Tensor, iw: torch.Tensor, ik: torch.Tensor, k: int) -> torch.Tensor:
    B, T, HI, DI = iq.shape
    S = ik.shape[1]
    out = torch.empty(B, T, k, device=iq.device, dtype=torch.int64)
    block_m = 16
    kp = max(16, triton.next_power_of_2(k))
    with _on_device(iq):
        _index_topk_kernel[(triton.cdiv(T, block_m), B)](
            iq, iw, ik, out, *iq.stride(), *iw.stride(), *ik.stride(), T, S, HI, DI, k, DI ** -0.5,
            PRECISION=_precision(iq), BLOCK_M=block_m, KP=kp, BLOCK_D=_head_block(DI), **index_topk_meta(kp))
    return out


@_index_topk_op.register_fake
def _(iq, iw, ik, k):
    return iq.new_empty(iq.shape[0], iq.shape[1], k, dtype=torch.int64)


def index_topk_triton(iq, iw, ik, k):
    """See kernels.index_topk. [B, T, k] int64, best first; -1 where a query sees fewer than k keys."""
    return _index_topk_op(iq, iw, ik.to(iq.dtype), int(k))


# ================================================================== NSA: block-sparse selection

# first: as for _MLA_CONFIGS
_NSA_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
                for bn, w, st in [(16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 8, 3)]]
_NSA_INTERPRET = dict(BLOCK_N=16)


@_autotune(_NSA_CONFIGS, key=["G", "N_SEL", "BLOCK_SIZE", "BLOCK_D", "BLOCK_DV"])
@triton.jit
def _nsa_fwd_kernel(Q, K, V, BI, O, LSE2,
                    stride_qb, stride_qt, stride_qh, stride_qd,
                    stride_kb, stride_ks, stride_kh, stride_kd,
                    stride_vb, stride_vs, stride_vh, stride_vd,
                    stride_ib, stride_it, stride_ih, stride_in,
                    stride_ob, stride_ot, stride_oh, stride_od,
                    T, S, Hq, Hkv, G, N_SEL, BLOCK_SIZE, D, Dv, sm_scale,
                    PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)                      # offsets past 2**31 at long T
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hk = tl.program_id(1) % Hkv
    pos = S - T + t
    g = tl.arange(0, BLOCK_G)
    h = hk * G + g
    g_in = g < G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + t * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_in[:, None] & (d[None, :] < D), other=0.0)                         # [BG, BD]: the group's heads
    K_h = K + b * stride_kb + hk * stride_kh
    V_h = V + b * stride_vb + hk * stride_vh
    BI_t = BI + b * stride_ib + t * stride_it + hk * stride_ih
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for i in range(N_SEL):
        blk = tl.load(BI_t + i * stride_in)
        first = blk * BLOCK_SIZE
        if (blk >= 0) & (first <= pos):                        # unused slot / block after the query: skipped
            for c in range(0, BLOCK_SIZE, BLOCK_N):
                j = c + tl.arange(0, BLOCK_N)
                k_pos = first + j
                seen = (j < BLOCK_SIZE) & (k_pos <= pos)
                kT = tl.load(K_h + k_pos[None, :] * stride_ks + d[:, None] * stride_kd,
                             mask=seen[None, :] & (d[:, None] < D), other=0.0)           # [BD, BN], once per group
                s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale
                s = tl.where(seen[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V_h + k_pos[:, None] * stride_vs + dv[None, :] * stride_vd,
                            mask=seen[:, None] & (dv[None, :] < Dv), other=0.0)          # [BN, BDV]
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(O + b * stride_ob + t * stride_ot + h[:, None] * stride_oh + dv[None, :] * stride_od,
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=g_in[:, None] & (dv[None, :] < Dv))
    tl.store(LSE2 + (b * T + t) * Hq + h, lse2, mask=g_in)


@_autotune(_NSA_CONFIGS, key=["G", "N_SEL", "BLOCK_SIZE", "BLOCK_D", "BLOCK_DV"], reset_to_zero=["DK", "DV"])
@triton.jit
def _nsa_bwd_kernel(Q, K, V, BI, DO, LSE2, DELTA, DQ, DK, DV,
                    stride_qb, stride_qt, stride_qh, stride_qd,
                    stride_kb, stride_ks, stride_kh, stride_kd,
                    stride_vb, stride_vs, stride_vh, stride_vd,
                    stride_ib, stride_it, stride_ih, stride_in,
                    stride_dob, stride_dot, stride_doh, stride_dod,
                    T, S, Hq, Hkv, G, N_SEL, BLOCK_SIZE, D, Dv, sm_scale,
                    PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """dQ in q's strides; dK [B,S,Hkv,D], dV [B,S,Hkv,Dv] fp32 contiguous, accumulated with atomics."""
    t = tl.program_id(0).to(tl.int64)                      # offsets past 2**31 at long T
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hk = tl.program_id(1) % Hkv
    pos = S - T + t
    g = tl.arange(0, BLOCK_G)
    h = hk * G + g
    g_in = g < G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + t * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_in[:, None] & (d[None, :] < D), other=0.0)
    do = tl.load(DO + b * stride_dob + t * stride_dot + h[:, None] * stride_doh + dv[None, :] * stride_dod,
                 mask=g_in[:, None] & (dv[None, :] < Dv), other=0.0)
    lse2 = tl.load(LSE2 + (b * T + t) * Hq + h, mask=g_in, other=0.0)
    delta = tl.load(DELTA + (b * T + t) * Hq + h, mask=g_in, other=0.0)
    live = g_in & (lse2 > float("-inf"))
    lse2 = tl.where(live, lse2, 0.0)
    K_h = K + b * stride_kb + hk * stride_kh
    V_h = V + b * stride_vb + hk * stride_vh
    DK_h = DK + (b * S * Hkv + hk) * D
    DV_h = DV + (b * S * Hkv + hk) * Dv
    BI_t = BI + b * stride_ib + t * stride_it + hk * stride_ih
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for i in range(N_SEL):
        blk = tl.load(BI_t + i * stride_in)
        first = blk * BLOCK_SIZE
        if (blk >= 0) & (first <= pos):
            for c in range(0, BLOCK_SIZE, BLOCK_N):
                j = c + tl.arange(0, BLOCK_N)
                k_pos = first + j
                seen = (j < BLOCK_SIZE) & (k_pos <= pos)
                k = tl.load(K_h + k_pos[:, None] * stride_ks + d[None, :] * stride_kd,
                            mask=seen[:, None] & (d[None, :] < D), other=0.0)            # [BN, BD]
                v = tl.load(V_h + k_pos[:, None] * stride_vs + dv[None, :] * stride_vd,
                            mask=seen[:, None] & (dv[None, :] < Dv), other=0.0)          # [BN, BDV]
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                p = tl.where(live[:, None] & seen[None, :], tl.exp2(s - lse2[:, None]), 0.0)  # [BG, BN]
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
                dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION) * sm_scale   # [BN, BD]
                dvv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)           # [BN, BDV]
                rows = k_pos.to(tl.int64) * Hkv
                tl.atomic_add(DK_h + rows[:, None] * D + d[None, :], dk, mask=seen[:, None] & (d[None, :] < D))
                tl.atomic_add(DV_h + rows[:, None] * Dv + dv[None, :], dvv, mask=seen[:, None] & (dv[None, :] < Dv))
    tl.store(DQ + b * stride_qb + t * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=g_in[:, None] & (d[None, :] < D))


def _nsa_args(q, k, v, block_indices, block_size):
    B, T, Hq, D = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    shape = (T, S, Hq, Hkv, G, block_indices.shape[3], block_size, D, Dv)
    consts = dict(PRECISION=_precision(q), BLOCK_G=max(16, triton.next_power_of_2(G)),
                  BLOCK_D=_head_block(D), BLOCK_DV=_head_block(Dv))
    return (T, B * Hkv), shape, consts


@torch.library.custom_op("hybrid::block_sparse_fwd", mutates_args=())
def _block_sparse_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
                         block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, Hq, _ = q.shape
    grid, shape, consts = _nsa_args(q, k, v, block_indices, block_size)
    o = torch.empty(B, T, Hq, v.shape[3], device=q.device, dtype=q.dtype)
    lse2 = torch.empty(B, T, Hq, device=q.device, dtype=torch.float32)
    with _on_device(q):
        _nsa_fwd_kernel[grid](q, k, v, block_indices, o, lse2, *q.stride(), *k.stride(), *v.stride(),
                              *block_indices.stride(), *o.stride(), *shape, scale, **consts,
                              **_fixed(**_NSA_INTERPRET))
    return o, lse2


@_block_sparse_fwd_op.register_fake
def _(q, k, v, block_indices, block_size, scale):
    B, T, Hq, _ = q.shape
    return q.new_empty(B, T, Hq, v.shape[3]), q.new_empty(B, T, Hq, dtype=torch.float32)


@torch.library.custom_op("hybrid::block_sparse_bwd", mutates_args=())
def _block_sparse_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         block_indices: torch.Tensor, o: torch.Tensor, lse2: torch.Tensor, block_size: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grid, shape, consts = _nsa_args(q, k, v, block_indices, block_size)
    delta = (do.float() * o.float()).sum(-1).contiguous()                   # [B, T, Hq]
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    with _on_device(q):
        _nsa_bwd_kernel[grid](q, k, v, block_indices, do, lse2, delta, dq, dk, dv, *q.stride(), *k.stride(),
                              *v.stride(), *block_indices.stride(), *do.stride(), *shape, scale,
                              **consts, **_fixed(**_NSA_INTERPRET))
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@_block_sparse_bwd_op.register_fake
def _(do, q, k, v, block_indices, o, lse2, block_size, scale):
    return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape)


def _block_sparse_setup(ctx, inputs, output):
    q, k, v, block_indices, block_size, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, block_indices, *output)
    ctx.block_size, ctx.scale = block_size, scale


def _block_sparse_grad(ctx, do, _dlse2):
    q, k, v, block_indices, o, lse2 = ctx.saved_tensors
    dq, dk, dv = _block_sparse_bwd_op(do, q, k, v, block_indices, o, lse2, ctx.block_size, ctx.scale)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("hybrid::block_sparse_fwd", _block_sparse_grad, setup_context=_block_sparse_setup)


def block_sparse_attention_triton(q, k, v, block_indices, block_size, *, scale):
    """See kernels.block_sparse_attention. o [B,T,Hq,Dv] in q's dtype; differentiable."""
    return _block_sparse_fwd_op(q, k.to(q.dtype), v.to(q.dtype), block_indices, int(block_size), float(scale))[0]
