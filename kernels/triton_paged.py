"""Paged decode attention in Triton (PagedAttention): one query token per row over a block table.

    q [B,1,Hq,Dk]  k_pool [N,bs,Hkv,Dk]  v_pool [N,bs,Hkv,Dv] (any strides: MLA passes a view of its
    latent rows)  block_table [B,nb]  seq_lens [B]  ->  o [B,1,Hq,Dv]

One program per (row, query head). It walks the row's blocks j = 0 .. ceil(seq_len / bs) - 1 (left of
a window: from the first block the window reaches), reads the block id from the table, loads that
block's keys of its kv head, and keeps a running max m, denominator l and output acc (online softmax,
exp2 on log2-scaled logits, as kernels/triton_attention.py). A sink starts the row at m = s_h, l = 1.
The query sits at position seq_len - 1 and sees keys p <= seq_len - 1 (and p > seq_len - 1 - window).
"""
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)   # the kernel's copy: compiled code reads only constexpr globals


@triton.jit
def _paged_decode_kernel(Q, K, V, TABLE, LENS, SINKS, O,
                         stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_kd,
                         stride_vn, stride_vs, stride_vh, stride_vd, stride_tb, stride_ob, stride_oh,
                         qk_scale, window, group, bs, Dk, Dv,
                         HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DK: tl.constexpr,
                         BLOCK_DV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    n = tl.load(LENS + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_dk, mask=offs_dk < Dk, other=0.0).to(tl.float32)
    if HAS_SINKS:
        m_i = tl.load(SINKS + h).to(tl.float32) * _LOG2E
        l_i = 1.0
    else:
        m_i = -float("inf")
        l_i = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    lo = tl.maximum(n - window, 0)                                  # first visible key
    for j in range(lo // bs, tl.cdiv(n, bs)):
        blk = tl.load(TABLE + b * stride_tb + j).to(tl.int64)
        pos = j * bs + offs_s
        ok = (offs_s < bs) & (pos < n) & (pos >= lo)
        k = tl.load(K + blk * stride_kn + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_dk[None, :] * stride_kd,
                    mask=ok[:, None] & (offs_dk[None, :] < Dk), other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale                # [BLOCK_S], log2 units
        s = tl.where(ok, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(V + blk * stride_vn + offs_s[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :] * stride_vd,
                    mask=ok[:, None] & (offs_dv[None, :] < Dv), other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    o = acc / l_i
    tl.store(O + b * stride_ob + h * stride_oh + offs_dv, o.to(O.dtype.element_ty), mask=offs_dv < Dv)


@torch.library.custom_op("hybrid::paged_decode", mutates_args=())
def _paged_decode_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     lens: torch.Tensor, window: int, sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    B, _, Hq, Dk = q.shape
    bs, Hkv = k_pool.shape[1], k_pool.shape[2]
    Dv = v_pool.shape[3]
    o = torch.empty(B, 1, Hq, Dv, device=q.device, dtype=q.dtype)
    sinks_arg = sinks if sinks is not None else q                   # unused when HAS_SINKS is false
    _paged_decode_kernel[(B, Hq)](
        q, k_pool, v_pool, table, lens, sinks_arg, o,
        q.stride(0), q.stride(2), *k_pool.stride(), *v_pool.stride(), table.stride(0), o.stride(0), o.stride(2),
        scale * LOG2E, window, Hq // Hkv, bs, Dk, Dv,
        HAS_SINKS=sinks is not None, BLOCK_S=triton.next_power_of_2(bs),
        BLOCK_DK=triton.next_power_of_2(Dk), BLOCK_DV=triton.next_power_of_2(Dv))
    return o


@_paged_decode_op.register_fake
def _(q, k_pool, v_pool, table, lens, window, sinks, scale):
    return q.new_empty(q.shape[0], 1, q.shape[2], v_pool.shape[3])


def paged_decode_triton(q, k_pool, v_pool, block_table, seq_lens, *, window=None, sinks=None, scale=None):
    """One decode token per row (T == 1); a registered op (torch.library, no autograd: decode only)."""
    B, T, Hq, Dk = q.shape
    assert T == 1, "the Triton paged kernel decodes one token per row"
    bs = k_pool.shape[1]
    scale = Dk ** -0.5 if scale is None else scale
    table = block_table.to(q.device, torch.int32).contiguous()
    lens = seq_lens.to(q.device, torch.int32).contiguous()
    window = int(window) if window is not None else int(block_table.shape[1] * bs + 1)
    return _paged_decode_op(q.contiguous(), k_pool, v_pool, table, lens, window, sinks, float(scale))
