"""Softmax attention in Triton: a flash-attention-2 style forward and backward (SPEC 0.3, 1).

    q [B,T,Hq,Dk]  k [B,S,Hkv,Dk]  v [B,S,Hkv,Dv]  ->  o [B,T,Hq,Dv]
    query t sits at absolute position i = S - T + t and sees key j iff  i - W < j <= i
    (W = window, or S when global). Query head h reads kv head h // (Hq // Hkv).

Forward (one program per block of BLOCK_M queries of one head). Walk over the key blocks the
queries can see, keeping per row a running max m, a running denominator l and an unnormalised
output acc (online softmax):

    s     = scale * q k^T                          [BLOCK_M, BLOCK_N]   (never written to memory)
    m'    = max(m, rowmax(s));  p = exp(s - m')
    l     = l * exp(m - m') + rowsum(p)
    acc   = acc * exp(m - m') + p v
    o     = acc / l,   lse = m + log(l)            (lse is saved, fp32, for the backward)

A learned sink s_h is one more softmax column with no value: it just starts the row at m = s_h,
l = 1. Exponentials are exp2 on log2-scaled logits (scale * log2(e) folded into one multiply);
the saved lse stays in log2 units (lse2 = lse * log2(e)) so the backward never converts it back.

Block skipping: a query block only visits key blocks that intersect its causal window, so a
windowed layer costs O(T * W), not O(T * S). Those key blocks are split into ones every query of
the block sees in full (no mask work) and boundary ones (causal diagonal, window edge) that get
the mask.

Backward (recompute, never store P): with delta_i = rowsum(dO_i * O_i),

    p  = exp(s - lse)    dV = p^T dO    dp = dO V^T    ds = p * (dp - delta)
    dQ = scale * ds K    dK = scale * ds^T Q
    d_sink_h = -sum_{b,i} exp(s_h - lse_i) * delta_i

Packed documents (cu_seqlens, B == 1, T == S): per position the first position of its document
(doc_start) and the end of it (doc_end, exclusive). Query i also hides keys j < doc_start[i]: the
forward and dQ mask with key_lo_i = max(i - W + 1, doc_start[i]), the dK/dV side with the query bound
min(j + W, doc_end[j]). Both are monotone in position, so the block ranges are just narrowed by the
first and last row's bounds: a tile that straddles a boundary is masked, nothing is padded.

dK/dV are computed by one program per key block of one kv head, looping over the query heads of
its GQA group and over the query blocks that see it (no atomics); dQ by one program per query
block, looping over key blocks exactly like the forward.
"""
import contextlib
import os

import torch
import triton
import triton.language as tl

from .triton_autotune import autotune

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The interpreter has no autotuner (it needs a GPU driver): one small fixed config.
INTERPRET_CONFIG = dict(BLOCK_M=32, BLOCK_N=16)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _configs(pairs):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in pairs]


# first: what exact fp32 launches use untuned (kernels/triton_autotune.py), the one spilling least (none forward)
_FWD_CONFIGS = _configs([(16, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
                         (128, 128, 8, 2), (64, 32, 4, 2)])
_BWD_CONFIGS = _configs([(16, 64, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2),
                         (32, 128, 4, 2), (64, 32, 4, 3)])


def _prune_for_short_queries(configs, named_args, **kwargs):
    """Decode / short prefill: don't spend a 128-row query block on a single query."""
    t = {**named_args, **kwargs}["T_BUCKET"]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, t)]
    return keep or configs[:1]


def _autotune(configs, prune=None):
    if INTERPRET:
        return lambda fn: fn
    return autotune(configs, key=["T_BUCKET", "S_BUCKET", "BLOCK_DK", "BLOCK_DV", "HAS_SINKS", "HAS_DOCS"],
                           prune_configs_by={"early_config_prune": prune} if prune else None)


# --------------------------------------------------------------------------- block ranges

@triton.jit
def _key_blocks_for_queries(q_first, q_last, window, BLOCK_N: tl.constexpr):
    """Key blocks seen by the queries at absolute positions [q_first, q_last].

    Returns (lo, full_lo, full_hi, hi) in units of key blocks: blocks [full_lo, full_hi) are seen
    in full by every query; [lo, full_lo) (window edge) and [full_hi, hi) (causal diagonal) need the
    mask; everything outside [lo, hi) is never loaded. All numerators are clamped to >= 0 so
    integer division means floor on every backend.
    """
    lo = tl.maximum(q_first - window + 1, 0) // BLOCK_N
    hi = (q_last + BLOCK_N) // BLOCK_N                                   # ceil((q_last + 1) / BLOCK_N)
    full_lo = (tl.maximum(q_last - window + 1, 0) + BLOCK_N - 1) // BLOCK_N
    full_hi = (q_first + 1) // BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_blocks_for_keys(k_first, offset, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks (query index t, position offset + t) that see some key in [k_first, k_first + BLOCK_N).

    Query i sees key j iff j <= i <= j + window - 1. Returns (lo, full_lo, full_hi, hi) in units of
    query blocks, as above; a full block also has no padding rows (t < T for all its rows).
    """
    t_first = tl.maximum(k_first - offset, 0)
    t_last = tl.minimum(k_first + BLOCK_N - 1 + window - 1 - offset, T - 1)
    lo = t_first // BLOCK_M
    hi = tl.maximum((tl.maximum(t_last + 1, 0) + BLOCK_M - 1) // BLOCK_M, lo)
    full_lo = (tl.maximum(k_first + BLOCK_N - 1 - offset, 0) + BLOCK_M - 1) // BLOCK_M
    full_hi = tl.minimum(tl.maximum(k_first + window - offset, 0) // BLOCK_M, T // BLOCK_M)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _clamp_ranges(lo, full_lo, full_hi, hi):
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_blocks_in_documents(lo, full_lo, full_hi, hi, start_first, start_last, BLOCK_N: tl.constexpr):
    """Narrow _key_blocks_for_queries' ranges to keys >= the document start of the first query
    (start_first) and, for the full blocks, of the last query (start_last)."""
    lo = tl.maximum(lo, start_first // BLOCK_N)
    full_lo = tl.maximum(full_lo, (start_last + BLOCK_N - 1) // BLOCK_N)
    return _clamp_ranges(lo, full_lo, full_hi, hi)


@triton.jit
def _query_blocks_in_documents(lo, full_lo, full_hi, hi, end_first, end_last, offset, BLOCK_M: tl.constexpr):
    """Narrow _query_blocks_for_keys' ranges to queries before the document end of the block's last
    key (end_last, exclusive) and, for the full blocks, of its first key (end_first)."""
    hi = tl.minimum(hi, (tl.maximum(end_last - offset, 0) + BLOCK_M - 1) // BLOCK_M)
    full_hi = tl.minimum(full_hi, tl.maximum(end_first - offset, 0) // BLOCK_M)
    return _clamp_ranges(lo, full_lo, full_hi, hi)


@triton.jit
def _query_key_lo(q_pos, t, T, window, DOC_START, HAS_DOCS: tl.constexpr):
    """The first key each query row sees: q_pos - window + 1, and not before its document start."""
    key_lo = q_pos - window + 1
    if HAS_DOCS:
        key_lo = tl.maximum(key_lo, tl.load(DOC_START + t, mask=t < T, other=0))
    return key_lo


# --------------------------------------------------------------------------- forward

@triton.jit
def _fwd_inner(acc, m_i, l_i, q, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs, stride_vd,
               block_lo, block_hi, S, Dk, Dv, key_lo, qk_scale,
               MASKED: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for block in range(block_lo, block_hi):
        k_pos = block * BLOCK_N + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
        k_in = k_pos < S
        kT = tl.load(K_head + k_pos[None, :] * stride_ks + offs_dk[:, None] * stride_kd,
                     mask=k_in[None, :] & (offs_dk[:, None] < Dk), other=0.0)            # [BLOCK_DK, BLOCK_N]
        s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale                           # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= key_lo[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)                                                      # rescale old rows
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_head + k_pos[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                    mask=k_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)             # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@_autotune(_FWD_CONFIGS, prune=_prune_for_short_queries)
@triton.jit
def _attn_fwd_kernel(Q, K, V, SINKS, DOC_START, O, LSE2,
                     stride_qb, stride_qt, stride_qh, stride_qd,
                     stride_kb, stride_ks, stride_kh, stride_kd,
                     stride_vb, stride_vs, stride_vh, stride_vd,
                     stride_ob, stride_ot, stride_oh, stride_od,
                     T, S, Hq, group, Dk, Dv, window, sm_scale, T_BUCKET, S_BUCKET,
                     HAS_SINKS: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    h_kv = h // group
    offset = S - T

    Q_head = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    K_head = K + b.to(tl.int64) * stride_kb + h_kv * stride_kh
    V_head = V + b.to(tl.int64) * stride_vb + h_kv * stride_vh

    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                                           # query index
    q_pos = offset + t                                                                    # absolute position
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q_head + t[:, None] * stride_qt + offs_dk[None, :] * stride_qd,
                mask=(t[:, None] < T) & (offs_dk[None, :] < Dk), other=0.0)              # [BLOCK_M, BLOCK_DK]

    # The running max starts at the sink logit (the sink column contributes exp(s_h - m) = 1 to l).
    # Without a sink (or a -inf sink) it starts at a large finite negative so that a row whose first
    # blocks are fully masked never computes exp(-inf - -inf).
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634                   # log2 units
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.maximum(sink, -1.0e30)
        l_i = tl.exp2(sink - m_i)                                                         # 1, or 0 for a -inf sink
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    q_first = offset + pid_m * BLOCK_M
    q_last = offset + tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T - 1)
    lo, full_lo, full_hi, hi = _key_blocks_for_queries(q_first, q_last, window, BLOCK_N)
    key_lo = _query_key_lo(q_pos, t, T, window, DOC_START, HAS_DOCS)                      # [BLOCK_M]
    if HAS_DOCS:   # T == S: query index == position
        lo, full_lo, full_hi, hi = _key_blocks_in_documents(lo, full_lo, full_hi, hi, tl.load(DOC_START + q_first),
                                                            tl.load(DOC_START + q_last), BLOCK_N)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs,
                               stride_vd, lo, full_lo, S, Dk, Dv, key_lo, qk_scale,
                               True, PRECISION, BLOCK_N, BLOCK_DK, BLOCK_DV)              # window edge
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs,
                               stride_vd, full_lo, full_hi, S, Dk, Dv, key_lo, qk_scale,
                               False, PRECISION, BLOCK_N, BLOCK_DK, BLOCK_DV)             # fully visible
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs,
                               stride_vd, full_hi, hi, S, Dk, Dv, key_lo, qk_scale,
                               True, PRECISION, BLOCK_N, BLOCK_DK, BLOCK_DV)              # causal diagonal

    l_safe = tl.where(l_i > 0, l_i, 1.0)                    # only padding rows (t >= T) can have l == 0
    o = acc / l_safe[:, None]
    lse2 = m_i + tl.log2(l_safe)                              # log2-sum-exp2 of the row, sink included
    O_head = O + b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(O_head + t[:, None] * stride_ot + offs_dv[None, :] * stride_od, o.to(O.dtype.element_ty),
             mask=(t[:, None] < T) & (offs_dv[None, :] < Dv))
    tl.store(LSE2 + pid_bh.to(tl.int64) * T + t, lse2, mask=t < T)


# --------------------------------------------------------------------------- backward

@triton.jit
def _bwd_delta_kernel(O, DO, DELTA,
                      stride_ob, stride_ot, stride_oh, stride_od,
                      stride_dob, stride_dot, stride_doh, stride_dod,
                      T, Hq, Dv, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d]   (fp32)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_DV)
    mask = (t[:, None] < T) & (d[None, :] < Dv)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + t[:, None] * stride_ot + d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + t[:, None] * stride_dot + d[None, :] * stride_dod,
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh.to(tl.int64) * T + t, tl.sum(o * do, 1), mask=t < T)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs, stride_vd,
              block_lo, block_hi, S, Dk, Dv, key_lo, qk_scale,
              MASKED: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for block in range(block_lo, block_hi):
        k_pos = block * BLOCK_N + tl.arange(0, BLOCK_N)
        k_in = k_pos < S
        k = tl.load(K_head + k_pos[:, None] * stride_ks + offs_dk[None, :] * stride_kd,
                    mask=k_in[:, None] & (offs_dk[None, :] < Dk), other=0.0)             # [BLOCK_N, BLOCK_DK]
        vT = tl.load(V_head + k_pos[None, :] * stride_vs + offs_dv[:, None] * stride_vd,
                     mask=k_in[None, :] & (offs_dv[:, None] < Dv), other=0.0)            # [BLOCK_DV, BLOCK_N]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale                  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= key_lo[:, None]) & k_in[None, :]
            s = tl.where(visible, s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])                                                    # softmax, recomputed
        dp = tl.dot(do, vT, input_precision=PRECISION)                                    # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)                        # [BLOCK_M, BLOCK_DK]
    return dq


@_autotune(_BWD_CONFIGS, prune=_prune_for_short_queries)
@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE2, DELTA, DOC_START, DQ,
                        stride_qb, stride_qt, stride_qh, stride_qd,
                        stride_kb, stride_ks, stride_kh, stride_kd,
                        stride_vb, stride_vs, stride_vh, stride_vd,
                        stride_dob, stride_dot, stride_doh, stride_dod,
                        stride_dqb, stride_dqt, stride_dqh, stride_dqd,
                        T, S, Hq, group, Dk, Dv, window, sm_scale, T_BUCKET, S_BUCKET,
                        HAS_SINKS: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    h_kv = h // group
    offset = S - T
    K_head = K + b.to(tl.int64) * stride_kb + h_kv * stride_kh
    V_head = V + b.to(tl.int64) * stride_vb + h_kv * stride_vh

    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = offset + t
    t_in = t < T
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h * stride_qh + t[:, None] * stride_qt + offs_dk[None, :] * stride_qd,
                mask=t_in[:, None] & (offs_dk[None, :] < Dk), other=0.0)                 # [BLOCK_M, BLOCK_DK]
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + t[:, None] * stride_dot + offs_dv[None, :] * stride_dod,
                 mask=t_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)                # [BLOCK_M, BLOCK_DV]
    lse2 = tl.load(LSE2 + pid_bh.to(tl.int64) * T + t, mask=t_in, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * T + t, mask=t_in, other=0.0)
    qk_scale = sm_scale * 1.4426950408889634

    dq = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)
    q_first = offset + pid_m * BLOCK_M
    q_last = offset + tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T - 1)
    lo, full_lo, full_hi, hi = _key_blocks_for_queries(q_first, q_last, window, BLOCK_N)
    key_lo = _query_key_lo(q_pos, t, T, window, DOC_START, HAS_DOCS)
    if HAS_DOCS:
        lo, full_lo, full_hi, hi = _key_blocks_in_documents(lo, full_lo, full_hi, hi, tl.load(DOC_START + q_first),
                                                            tl.load(DOC_START + q_last), BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs, stride_vd,
                   lo, full_lo, S, Dk, Dv, key_lo, qk_scale, True, PRECISION, BLOCK_N, BLOCK_DK, BLOCK_DV)
    dq = _dq_inner(dq, q, do, lse2, delta, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs, stride_vd,
                   full_lo, full_hi, S, Dk, Dv, key_lo, qk_scale, False, PRECISION, BLOCK_N, BLOCK_DK, BLOCK_DV)
    dq = _dq_inner(dq, q, do, lse2, delta, q_pos, K_head, V_head, stride_ks, stride_kd, stride_vs, stride_vd,
                   full_hi, hi, S, Dk, Dv, key_lo, qk_scale, True, PRECISION, BLOCK_N, BLOCK_DK, BLOCK_DV)
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh + t[:, None] * stride_dqt + offs_dk[None, :] * stride_dqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=t_in[:, None] & (offs_dk[None, :] < Dk))


@triton.jit
def _dkdv_inner(dk, dv, k, v, k_pos, Q_head, DO_head, LSE2_head, DELTA_head,
                stride_qt, stride_qd, stride_dot, stride_dod,
                block_lo, block_hi, T, offset, Dk, Dv, q_end, qk_scale,
                MASKED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for block in range(block_lo, block_hi):
        t = block * BLOCK_M + tl.arange(0, BLOCK_M)                                       # [BLOCK_M]
        t_in = t < T
        q = tl.load(Q_head + t[:, None] * stride_qt + offs_dk[None, :] * stride_qd,
                    mask=t_in[:, None] & (offs_dk[None, :] < Dk), other=0.0)             # [BLOCK_M, BLOCK_DK]
        do = tl.load(DO_head + t[:, None] * stride_dot + offs_dv[None, :] * stride_dod,
                     mask=t_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)            # [BLOCK_M, BLOCK_DV]
        lse2 = tl.load(LSE2_head + t, mask=t_in, other=0.0)
        delta = tl.load(DELTA_head + t, mask=t_in, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale                 # [BLOCK_N, BLOCK_M]
        if MASKED:
            q_pos = offset + t
            visible = (k_pos[:, None] <= q_pos[None, :]) & (q_pos[None, :] < q_end[:, None]) & t_in[None, :]
            sT = tl.where(visible, sT, float("-inf"))
        pT = tl.exp2(sT - lse2[None, :])                                                  # P^T, recomputed
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)                      # [BLOCK_N, BLOCK_DV]
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)                          # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)                       # [BLOCK_N, BLOCK_DK]
    return dk, dv


@_autotune(_BWD_CONFIGS)
@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE2, DELTA, DOC_END, DK, DV,
                          stride_qb, stride_qt, stride_qh, stride_qd,
                          stride_kb, stride_ks, stride_kh, stride_kd,
                          stride_vb, stride_vs, stride_vh, stride_vd,
                          stride_dob, stride_dot, stride_doh, stride_dod,
                          stride_dkb, stride_dks, stride_dkh, stride_dkd,
                          stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                          T, S, Hq, Hkv, group, Dk, Dv, window, sm_scale, T_BUCKET, S_BUCKET,
                          HAS_SINKS: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    h_kv = pid_bh % Hkv
    offset = S - T

    k_first = pid_n * BLOCK_N
    k_pos = k_first + tl.arange(0, BLOCK_N)
    k_in = k_pos < S
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b.to(tl.int64) * stride_kb + h_kv * stride_kh + k_pos[:, None] * stride_ks + offs_dk[None, :] * stride_kd,
                mask=k_in[:, None] & (offs_dk[None, :] < Dk), other=0.0)                 # [BLOCK_N, BLOCK_DK]
    v = tl.load(V + b.to(tl.int64) * stride_vb + h_kv * stride_vh + k_pos[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                mask=k_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)                 # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    lo, full_lo, full_hi, hi = _query_blocks_for_keys(k_first, offset, T, window, BLOCK_M, BLOCK_N)
    q_end = k_pos + window                                   # [BLOCK_N]: queries before q_end see the key
    if HAS_DOCS:                                             # ... and before the end of its document
        q_end = tl.minimum(q_end, tl.load(DOC_END + k_pos, mask=k_in, other=S))
        k_last = tl.minimum(k_first + BLOCK_N - 1, S - 1)
        lo, full_lo, full_hi, hi = _query_blocks_in_documents(lo, full_lo, full_hi, hi, tl.load(DOC_END + k_first),
                                                              tl.load(DOC_END + k_last), offset, BLOCK_M)
    for g in range(group):                                   # the query heads that read this kv head
        h = h_kv * group + g
        Q_head = Q + b.to(tl.int64) * stride_qb + h * stride_qh
        DO_head = DO + b.to(tl.int64) * stride_dob + h * stride_doh
        LSE2_head = LSE2 + (b * Hq + h).to(tl.int64) * T
        DELTA_head = DELTA + (b * Hq + h).to(tl.int64) * T
        dk, dv = _dkdv_inner(dk, dv, k, v, k_pos, Q_head, DO_head, LSE2_head, DELTA_head,
                             stride_qt, stride_qd, stride_dot, stride_dod, lo, full_lo, T, offset, Dk, Dv,
                             q_end, qk_scale, True, PRECISION, BLOCK_M, BLOCK_DK, BLOCK_DV)
        dk, dv = _dkdv_inner(dk, dv, k, v, k_pos, Q_head, DO_head, LSE2_head, DELTA_head,
                             stride_qt, stride_qd, stride_dot, stride_dod, full_lo, full_hi, T, offset, Dk, Dv,
                             q_end, qk_scale, False, PRECISION, BLOCK_M, BLOCK_DK, BLOCK_DV)
        dk, dv = _dkdv_inner(dk, dv, k, v, k_pos, Q_head, DO_head, LSE2_head, DELTA_head,
                             stride_qt, stride_qd, stride_dot, stride_dod, full_hi, hi, T, offset, Dk, Dv,
                             q_end, qk_scale, True, PRECISION, BLOCK_M, BLOCK_DK, BLOCK_DV)

    tl.store(DK + b.to(tl.int64) * stride_dkb + h_kv * stride_dkh + k_pos[:, None] * stride_dks + offs_dk[None, :] * stride_dkd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=k_in[:, None] & (offs_dk[None, :] < Dk))
    tl.store(DV + b.to(tl.int64) * stride_dvb + h_kv * stride_dvh + k_pos[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=k_in[:, None] & (offs_dv[None, :] < Dv))


# --------------------------------------------------------------------------- launchers

def _head_block(d):
    return max(16, triton.next_power_of_2(d))


def _launch_meta():
    """Block sizes to pass explicitly: the fixed interpreter config, or none (the autotuner picks)."""
    return dict(INTERPRET_CONFIG) if INTERPRET else {}


def _common(q, k, v, window, scale):
    B, T, Hq, Dk = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    window = S if window is None else min(int(window), S)     # global == a window covering every key
    scale = Dk ** -0.5 if scale is None else float(scale)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: no tf32 rounding in tl.dot
    shape_args = dict(T_BUCKET=triton.next_power_of_2(T), S_BUCKET=triton.next_power_of_2(S),
                      PRECISION=precision, BLOCK_DK=_head_block(Dk), BLOCK_DV=_head_block(Dv))
    return B, T, S, Hq, Hkv, Dk, Dv, window, scale, shape_args


def _doc_bounds(cu_seqlens, S):
    """Packed documents: (doc_start, doc_end) [S] int32 of every position's document, or (None, None)."""
    if cu_seqlens is None:
        return None, None
    from . import doc_index
    doc = doc_index(cu_seqlens, S)
    return cu_seqlens[doc].int().contiguous(), cu_seqlens[doc + 1].int().contiguous()


def _forward(q, k, v, window, sinks, scale, docs=(None, None)):
    """Returns (o [B,T,Hq,Dv], lse2 [B,Hq,T] fp32 in log2 units). docs: _doc_bounds(cu_seqlens)."""
    B, T, S, Hq, Hkv, Dk, Dv, window, scale, shape_args = _common(q, k, v, window, scale)
    o = torch.empty(B, T, Hq, Dv, device=q.device, dtype=q.dtype)
    lse2 = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    sinks_arg = sinks.contiguous() if sinks is not None else lse2    # dummy pointer when unused
    doc_start = docs[0] if docs[0] is not None else lse2
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    _attn_fwd_kernel[grid](q, k, v, sinks_arg, doc_start, o, lse2, *q.stride(), *k.stride(), *v.stride(),
                           *o.stride(), T, S, Hq, Hq // Hkv, Dk, Dv, window, scale, HAS_SINKS=sinks is not None,
                           HAS_DOCS=docs[0] is not None, **shape_args, **_launch_meta())
    return o, lse2


def bwd_delta_meta(interpret=INTERPRET):
    """The row-sum kernel's block (not autotuned): small under the interpreter."""
    return dict(BLOCK_M=16 if interpret else 64)


def _backward(do, q, k, v, o, lse2, window, sinks, scale, docs=(None, None)):
    """Gradients from the saved (o, lse2). Returns (dq, dk, dv, d_sinks or None)."""
    B, T, S, Hq, Hkv, Dk, Dv, window, scale, shape_args = _common(q, k, v, window, scale)
    delta = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    meta = bwd_delta_meta()
    _bwd_delta_kernel[(triton.cdiv(T, meta["BLOCK_M"]), B * Hq)](
        o, do, delta, *o.stride(), *do.stride(), T, Hq, Dv, BLOCK_DV=_head_block(Dv), **meta)

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    has_sinks, has_docs = sinks is not None, docs[0] is not None
    doc_start, doc_end = docs if has_docs else (delta, delta)       # dummy pointers when unused
    grid_q = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    _attn_bwd_dq_kernel[grid_q](q, k, v, do, lse2, delta, doc_start, dq, *q.stride(), *k.stride(), *v.stride(),
                                *do.stride(), *dq.stride(), T, S, Hq, Hq // Hkv, Dk, Dv, window, scale,
                                HAS_SINKS=has_sinks, HAS_DOCS=has_docs, **shape_args, **_launch_meta())
    grid_k = lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)  # noqa: E731
    _attn_bwd_dkdv_kernel[grid_k](q, k, v, do, lse2, delta, doc_end, dk, dv, *q.stride(), *k.stride(), *v.stride(),
                                  *do.stride(), *dk.stride(), *dv.stride(), T, S, Hq, Hkv, Hq // Hkv, Dk, Dv,
                                  window, scale, HAS_SINKS=has_sinks, HAS_DOCS=has_docs, **shape_args,
                                  **_launch_meta())

    d_sinks = None
    if has_sinks:   # the sink's probability per row is exp(s_h - lse); its logit gets -p_sink * delta
        p_sink = torch.exp2(sinks.float().view(1, Hq, 1) * LOG2E - lse2)      # [B, Hq, T]
        d_sinks = -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
    return dq, dk, dv, d_sinks


def attention_triton_fwd(q, k, v, *, window=None, sinks=None, scale=None):
    """Forward only (no autograd). Returns (o [B,T,Hq,Dv] in q's dtype,
    lse [B,Hq,T] fp32: natural-log log-sum-exp of each row's logits, sink included)."""
    o, lse2 = _attn_fwd_op(q, k, v, sinks, window, scale, None, None)
    return o, lse2 * LN2


def _on_device(x):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# --------------------------------------------------------------------------- torch.library ops
# Registered ops: torch.compile sees one opaque node per launch, with a fake (meta) impl that
# gives its output shapes and a registered autograd, so a compiled model has no graph break here.

@torch.library.custom_op("hybrid::attn_fwd", mutates_args=())
def _attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, window: int | None,
                 scale: float | None, doc_start: torch.Tensor | None, doc_end: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    with _on_device(q):
        return _forward(q, k, v, window, sinks, scale, (doc_start, doc_end))


@_attn_fwd_op.register_fake
def _(q, k, v, sinks, window, scale, doc_start, doc_end):
    B, T, Hq, _ = q.shape
    return q.new_empty(B, T, Hq, v.shape[3]), q.new_empty(B, Hq, T, dtype=torch.float32)


@torch.library.custom_op("hybrid::attn_bwd", mutates_args=())
def _attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse2: torch.Tensor, sinks: torch.Tensor | None, window: int | None, scale: float | None,
                 doc_start: torch.Tensor | None, doc_end: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with _on_device(q):
        dq, dk, dv, d_sinks = _backward(do, q, k, v, o, lse2, window, sinks, scale, (doc_start, doc_end))
    return dq, dk, dv, (d_sinks if d_sinks is not None else q.new_empty(0))   # an op returns tensors only


@_attn_bwd_op.register_fake
def _(do, q, k, v, o, lse2, sinks, window, scale, doc_start, doc_end):
    d_sinks = torch.empty_like(sinks) if sinks is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_sinks


def _attn_setup(ctx, inputs, output):
    q, k, v, sinks, window, scale, doc_start, doc_end = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, sinks, *output, doc_start, doc_end)
    ctx.window, ctx.scale = window, scale


def _attn_grad(ctx, do, _dlse2):
    q, k, v, sinks, o, lse2, doc_start, doc_end = ctx.saved_tensors
    dq, dk, dv, d_sinks = _attn_bwd_op(do, q, k, v, o, lse2, sinks, ctx.window, ctx.scale, doc_start, doc_end)
    return dq, dk, dv, (d_sinks if sinks is not None else None), None, None, None, None


torch.library.register_autograd("hybrid::attn_fwd", _attn_grad, setup_context=_attn_setup)


def attention_triton(q, k, v, *, window=None, sinks=None, scale=None, cu_seqlens=None):
    """Causal (optionally windowed, optionally with sinks) attention; differentiable. See module doc.

    q [B,T,Hq,Dk]  k [B,S,Hkv,Dk]  v [B,S,Hkv,Dv]  sinks [Hq] or None  ->  o [B,T,Hq,Dv] (q's dtype)
    cu_seqlens: int64 [n_docs + 1] packed documents (B == 1, T == S; checked by the caller) or None.
    Any strides are accepted (nothing is copied).
    """
    doc_start, doc_end = _doc_bounds(cu_seqlens, k.shape[1])
    window = None if window is None else int(window)
    scale = None if scale is None else float(scale)
    return _attn_fwd_op(q, k, v, sinks, window, scale, doc_start, doc_end)[0]
