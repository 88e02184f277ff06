"""Gated delta rule in Triton: chunked forward and backward for training, fused recurrence for decode.

Math (per batch b and head h; state S in R^{K x V}, float32):

    S'  = Diag(exp(g_t)) S_{t-1}                  g_t <= 0, per key channel [K] (KDA) or scalar (GDN)
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T      write only the correction
    o_t = S_t^T (scale * q_t)                     scale defaults to K ** -0.5

Chunked form (chunk C = 64, sub-chunk 16). Inside one chunk, with G = cumsum(g) over the chunk's
rows (G <= 0, non-increasing) and Gamma_ij = exp(G_i - G_j) (per channel; <= 1 for i >= j):

    Ak  = tril(  (k_i * Gamma_ij) . k_j, -1)            [C, C]   strictly lower
    M   = tril(scale (q_i * Gamma_ij) . k_j,  0)        [C, C]   lower, diagonal included
    T   = (I + Diag(beta) Ak)^-1                        [C, C]   forward substitution
    W   = T (beta * k * exp(G))                         [C, K]   WY representation
    U   = T (beta * v)                                  [C, V]
    Vn  = U - W S                                       [C, V]   corrected values ("v new")
    O   = scale (q * exp(G)) S + M Vn                   [C, V]
    S  <- Diag(exp(G_L)) S + (k * exp(G_L - G))^T Vn             G_L = G of the chunk's last row

Stage plan (each stage one kernel; "bh" = batch x head):
    forward   F0 _chunk_cumsum_kernel        grid (chunks, bh)          G = in-chunk cumsum of g
              F1 _chunk_intra_kernel         grid (chunks*4, bh)        Ak and M, one 16-row strip each
              F2 _chunk_solve_kernel         grid (chunks, bh)          T: 16x16 diagonal inverses, combined
              F3 _chunk_wy_kernel            grid (chunks, bh)          W, U
              F4 _chunk_state_fwd_kernel     grid (V tiles, bh)         sequential over chunks: Vn, states h
              F5 _chunk_output_kernel        grid (chunks, V tiles, bh) O
    backward  B1 _chunk_state_bwd_kernel     grid (V tiles, bh)         reverse over chunks: dh, dVn, d(S0)
              B2 _chunk_bwd_main_kernel      grid (chunks, bh)          dv, dbeta, dA, dM, partial dq/dk/dG
              B3 _chunk_bwd_intra_kernel     grid (chunks*4, bh)        gated products of dA, dM -> dq, dk, dG
              B4 _chunk_reverse_cumsum_kernel grid (chunks, bh)         dg = reverse in-chunk cumsum of dG
    decode    _fused_recurrent_kernel        grid (V tiles, bh)         token loop, state updated in place

Saved for backward (no T x K x V tensor): G, W [T,K]; Vn [T,V]; Ak, T, M [T,64]; the chunk-start
states h [T/64, K, V].

Safe gating. Every exponent is <= 0: Gamma_ij for a pair (i, j) in different 16-row sub-chunks is
factored through the first row r of i's sub-chunk, exp(G_i - G_r) * exp(G_r - G_j), both <= 1, so a
tensor-core dot can do the channel sum; pairs inside one sub-chunk are formed column by column with
the upper triangle masked to -inf before exp. This stays finite for per-step log decay of -20 or
less (which a single reference point per chunk would overflow). Requires g <= 0 (as the layers make it).

Packed documents (cu_seqlens, B == 1): doc [T_pad] int32 holds every row's document (padding rows:
the last one). Inside a chunk, pairs of rows from different documents are zeroed in Ak and M (and
their gradients in dAk, dM), so T is block diagonal per document; the three decays between rows and
chunk states, exp(G) (from the chunk start), exp(G_L - G) (to the chunk end) and exp(G_L), are zeroed
where a document boundary lies in between (_chunk_decays). Every masked value is finite, so the
backward needs no other change; no document is padded.

Per-head gates g [B,T,H] are broadcast to the channels by a torch expand (its backward sums dg over K).
Inputs may be fp32, bf16 or fp16; all arithmetic and the state are fp32. Dots use IEEE fp32 for fp32
inputs and TF32 for half inputs. K, V up to 256; non power-of-two sizes are padded and masked.
"""
import os

import torch
import triton
import triton.language as tl

from .triton_autotune import autotune

CHUNK = 64  # rows per chunk (hard-wired in the 4 x 16 block solve)
SUB = 16  # rows per sub-chunk
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------------
# Launch configuration: autotune on a GPU, one fixed config under the interpreter (SPEC 7).
# --------------------------------------------------------------------------------------------------
class _FixedConfig:
    """Stands in for triton.autotune under TRITON_INTERPRET=1: launches with fixed meta-parameters."""

    def __init__(self, fn, meta):
        self.fn, self.meta = fn, meta

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            meta = dict(kwargs, **self.meta)
            return self.fn[grid(meta) if callable(grid) else grid](*args, **meta)

        return launch


def _autotune(configs, key, interpret_meta, **kwargs):
    """Tuned per H and `key`: a new head count is compiled anew anyway (a constexpr), so it is also tuned at
    its own shape instead of reusing the choice made at the first one (gpu_check: the checks' H=4 at T=300
    chose the configs for its training at H=12, T=2048)."""
    if INTERPRET:
        return lambda fn: _FixedConfig(fn, interpret_meta)
    return autotune(configs=configs, key=["H", *key], **kwargs)


def _warps_configs():   # first: what exact fp32 launches use untuned (triton_autotune), 8 warps spill least
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (8, 2, 4) for s in (2, 3)]


def _bv_configs():      # first: as above; BV 32 with 8 warps spills least in fp32
    return [triton.Config({"BV": bv}, num_warps=w, num_stages=s)
            for bv in (32, 64) for w in (8, 4) for s in (2, 3)]


_INTERPRET_BV = {"BV": 16}  # small tile under the interpreter, so tests cover several V tiles


# --------------------------------------------------------------------------------------------------
# Small device helpers. Layout convention: a [B, R, H, D] tensor (R = T for inputs, T_pad for the
# chunk intermediates); program (b, h) starts at (b*R*H + h)*D, rows are H*D apart.
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptr, rows, cols, row_stride, n_rows, n_cols):
    """[len(rows), len(cols)] fp32 tile; out-of-range rows/cols read as 0."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(ptr, rows, cols, row_stride, n_rows, n_cols, x):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * row_stride + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_row(ptr, row, cols, row_stride, n_rows, n_cols):
    """One row as a 1-D fp32 vector; 0 where out of range."""
    mask = (cols < n_cols) & ((cols * 0 + row) < n_rows)
    return tl.load(ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _invert_unit_lower_16(a):
    """(I + a)^-1 for a strictly lower-triangular [16, 16] tile, by forward substitution.

    Row i of X = (I + a)^-1 satisfies X_i = e_i - sum_{j<i} a_ij X_j; rows are finished in order.
    """
    idx = tl.arange(0, 16)
    x = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    for i in range(1, 16):
        a_row = tl.sum(tl.where(idx[:, None] == i, a, 0.0), axis=0)  # [16] a[i, :]
        correction = tl.sum(a_row[:, None] * x, axis=0)  # [16] sum_j a_ij X_j
        x = tl.where(idx[:, None] == i, x - correction[None, :], x)
    return x


@triton.jit
def _chunk_decays(G, G_last, doc_ptr, chunk, HAS_DOCS: tl.constexpr):
    """The decays between a chunk's rows and its states: exp(G) [64, BK] (from the chunk start),
    exp(G_L - G) [64, BK] (to the chunk end), exp(G_L) [BK]. Packed documents: each is 0 where a
    document boundary lies in between (the row's document did not start before the chunk / is not
    the chunk's last document / the chunk holds a boundary)."""
    e_start = tl.exp(G)
    e_end = tl.exp(G_last[None, :] - G)  # exponent <= 0
    e_last = tl.exp(G_last)
    if HAS_DOCS:
        doc = tl.load(doc_ptr + chunk * 64 + tl.arange(0, 64))
        doc_before = tl.load(doc_ptr + tl.maximum(chunk * 64 - 1, 0))
        doc_last = tl.load(doc_ptr + chunk * 64 + 63)
        e_start = tl.where((doc == doc_before)[:, None], e_start, 0.0)
        e_end = tl.where((doc == doc_last)[:, None], e_end, 0.0)
        e_last = tl.where(doc_last == doc_before, e_last, 0.0)
    return e_start, e_end, e_last


@triton.jit
def _same_doc(x, doc_ptr, rows_i, rows_j, HAS_DOCS: tl.constexpr):
    """x [len(rows_i), len(rows_j)] with pairs of rows from different documents set to 0."""
    if HAS_DOCS:
        same = tl.load(doc_ptr + rows_i)[:, None] == tl.load(doc_ptr + rows_j)[None, :]
        x = tl.where(same, x, 0.0)
    return x


# --------------------------------------------------------------------------------------------------
# Forward stages
# --------------------------------------------------------------------------------------------------
@_autotune(_warps_configs(), key=["K"], interpret_meta={})
@triton.jit
def _chunk_cumsum_kernel(g_ptr, G_ptr, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """F0: G = cumsum(g) inside each chunk. g [B,T,H,K] -> G [B,T_pad,H,K] fp32.

    Padded rows (t >= T) hold the chunk's last valid G, so G of row 63 is always G_L.
    """
    chunk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    b, h = bh // H, bh % H
    T_pad = tl.cdiv(T, 64) * 64
    rows = chunk * 64 + tl.arange(0, 64)
    cols = tl.arange(0, BK)
    g = _load_tile(g_ptr + (b * T * H + h) * K, rows, cols, H * K, T, K)  # [64, BK]
    _store_tile(G_ptr + (b * T_pad * H + h) * K, rows, cols, H * K, T_pad, K, tl.cumsum(g, axis=0))


@_autotune(_warps_configs(), key=["K"], interpret_meta={})
@triton.jit
def _chunk_intra_kernel(q_ptr, k_ptr, G_ptr, Ak_ptr, M_ptr, doc_ptr, scale, T,
                        H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
                        HAS_DOCS: tl.constexpr):
    """F1: rows of sub-chunk s of Ak = tril((k_i Gamma_ij).k_j, -1) and M = scale tril((q_i Gamma_ij).k_j).

    Ak, M [B,T_pad,H,64] must be zero-initialised (blocks above the diagonal are not written).
    """
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    chunk, s = pid // 4, pid % 4
    b, h = bh // H, bh % H
    T_pad = tl.cdiv(T, 64) * 64
    qk_ptr_off = (b * T * H + h) * K  # inputs
    G_base = G_ptr + (b * T_pad * H + h) * K
    A_off = (b * T_pad * H + h) * 64
    idx = tl.arange(0, 16)
    cols = tl.arange(0, BK)
    r0 = chunk * 64 + s * 16  # first row of this sub-chunk: the reference point
    rows = r0 + idx
    q_s = _load_tile(q_ptr + qk_ptr_off, rows, cols, H * K, T, K)  # [16, BK]
    k_s = _load_tile(k_ptr + qk_ptr_off, rows, cols, H * K, T, K)  # [16, BK]
    G_s = _load_tile(G_base, rows, cols, H * K, T_pad, K)  # [16, BK]
    G_r = _load_row(G_base, r0, cols, H * K, T_pad, K)  # [BK]
    decay_to_i = tl.exp(G_s - G_r[None, :])  # exp(G_i - G_r) <= 1
    k_i = k_s * decay_to_i
    q_i = q_s * decay_to_i
    # off-diagonal blocks J < s: factor Gamma_ij through r
    for J in range(0, s):
        rows_J = chunk * 64 + J * 16 + idx
        k_J = _load_tile(k_ptr + qk_ptr_off, rows_J, cols, H * K, T, K)
        G_J = _load_tile(G_base, rows_J, cols, H * K, T_pad, K)
        k_j = k_J * tl.exp(G_r[None, :] - G_J)  # exp(G_r - G_j) <= 1
        a_blk = _same_doc(tl.dot(k_i, tl.trans(k_j), input_precision=DOT_PREC), doc_ptr, rows, rows_J, HAS_DOCS)
        m_blk = _same_doc(tl.dot(q_i, tl.trans(k_j), input_precision=DOT_PREC) * scale, doc_ptr, rows, rows_J,
                          HAS_DOCS)
        _store_tile(Ak_ptr + A_off, rows, J * 16 + idx, H * 64, T_pad, 64, a_blk)
        _store_tile(M_ptr + A_off, rows, J * 16 + idx, H * 64, T_pad, 64, m_blk)
    # diagonal block: column by column, upper triangle masked before exp
    a_diag = tl.zeros([16, 16], dtype=tl.float32)
    m_diag = tl.zeros([16, 16], dtype=tl.float32)
    for j in range(0, 16):
        k_j = _load_row(k_ptr + qk_ptr_off, r0 + j, cols, H * K, T, K)  # [BK]
        G_j = _load_row(G_base, r0 + j, cols, H * K, T_pad, K)  # [BK]
        gamma = tl.exp(tl.where(idx[:, None] >= j, G_s - G_j[None, :], float("-inf")))  # [16, BK]
        kj_gamma = k_j[None, :] * gamma
        a_col = tl.sum(k_s * kj_gamma, axis=1)  # [16]
        m_col = tl.sum(q_s * kj_gamma, axis=1) * scale
        a_diag = tl.where((idx[None, :] == j) & (idx[:, None] > j), a_col[:, None], a_diag)
        m_diag = tl.where((idx[None, :] == j) & (idx[:, None] >= j), m_col[:, None], m_diag)
    a_diag = _same_doc(a_diag, doc_ptr, rows, rows, HAS_DOCS)
    m_diag = _same_doc(m_diag, doc_ptr, rows, rows, HAS_DOCS)
    _store_tile(Ak_ptr + A_off, rows, s * 16 + idx, H * 64, T_pad, 64, a_diag)
    _store_tile(M_ptr + A_off, rows, s * 16 + idx, H * 64, T_pad, 64, m_diag)


@triton.jit
def _load_A_block(Ak_ptr, beta_ptr, chunk, I: tl.constexpr, J: tl.constexpr, T, T_pad, H: tl.constexpr):
    """Block (I, J) of A = Diag(beta) Ak in one chunk, as a [16, 16] fp32 tile (offsets already per bh)."""
    idx = tl.arange(0, 16)
    rows = chunk * 64 + I * 16 + idx
    ak = _load_tile(Ak_ptr, rows, J * 16 + idx, H * 64, T_pad, 64)
    beta = tl.load(beta_ptr + rows * H, mask=rows < T, other=0.0).to(tl.float32)
    return ak * beta[:, None]


@triton.jit
def _store_T_block(Ti_ptr, chunk, I: tl.constexpr, J: tl.constexpr, T_pad, H: tl.constexpr, x):
    idx = tl.arange(0, 16)
    _store_tile(Ti_ptr, chunk * 64 + I * 16 + idx, J * 16 + idx, H * 64, T_pad, 64, x)


@_autotune(_warps_configs(), key=[], interpret_meta={})
@triton.jit
def _chunk_solve_kernel(Ak_ptr, beta_ptr, Ti_ptr, T, H: tl.constexpr, DOT_PREC: tl.constexpr):
    """F2: T = (I + A)^-1 per chunk, A = Diag(beta) Ak strictly lower [64, 64], as 4 x 4 blocks of 16.

    Diagonal blocks by forward substitution; below them T_IJ = -T_II sum_{J<=M<I} A_IM T_MJ.
    Ti [B,T_pad,H,64] must be zero-initialised (the upper blocks are not written).
    """
    chunk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    b, h = bh // H, bh % H
    T_pad = tl.cdiv(T, 64) * 64
    Ak_ptr += (b * T_pad * H + h) * 64
    Ti_ptr += (b * T_pad * H + h) * 64
    beta_ptr += b * T * H + h
    A10 = _load_A_block(Ak_ptr, beta_ptr, chunk, 1, 0, T, T_pad, H)
    A20 = _load_A_block(Ak_ptr, beta_ptr, chunk, 2, 0, T, T_pad, H)
    A21 = _load_A_block(Ak_ptr, beta_ptr, chunk, 2, 1, T, T_pad, H)
    A30 = _load_A_block(Ak_ptr, beta_ptr, chunk, 3, 0, T, T_pad, H)
    A31 = _load_A_block(Ak_ptr, beta_ptr, chunk, 3, 1, T, T_pad, H)
    A32 = _load_A_block(Ak_ptr, beta_ptr, chunk, 3, 2, T, T_pad, H)
    T00 = _invert_unit_lower_16(_load_A_block(Ak_ptr, beta_ptr, chunk, 0, 0, T, T_pad, H))
    T11 = _invert_unit_lower_16(_load_A_block(Ak_ptr, beta_ptr, chunk, 1, 1, T, T_pad, H))
    T22 = _invert_unit_lower_16(_load_A_block(Ak_ptr, beta_ptr, chunk, 2, 2, T, T_pad, H))
    T33 = _invert_unit_lower_16(_load_A_block(Ak_ptr, beta_ptr, chunk, 3, 3, T, T_pad, H))
    T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=DOT_PREC), input_precision=DOT_PREC)
    T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=DOT_PREC), input_precision=DOT_PREC)
    T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=DOT_PREC), input_precision=DOT_PREC)
    T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision=DOT_PREC)
                  + tl.dot(A21, T10, input_precision=DOT_PREC), input_precision=DOT_PREC)
    T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision=DOT_PREC)
                  + tl.dot(A32, T21, input_precision=DOT_PREC), input_precision=DOT_PREC)
    T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision=DOT_PREC)
                  + tl.dot(A31, T10, input_precision=DOT_PREC)
                  + tl.dot(A32, T20, input_precision=DOT_PREC), input_precision=DOT_PREC)
    _store_T_block(Ti_ptr, chunk, 0, 0, T_pad, H, T00)
    _store_T_block(Ti_ptr, chunk, 1, 0, T_pad, H, T10)
    _store_T_block(Ti_ptr, chunk, 1, 1, T_pad, H, T11)
    _store_T_block(Ti_ptr, chunk, 2, 0, T_pad, H, T20)
    _store_T_block(Ti_ptr, chunk, 2, 1, T_pad, H, T21)
    _store_T_block(Ti_ptr, chunk, 2, 2, T_pad, H, T22)
    _store_T_block(Ti_ptr, chunk, 3, 0, T_pad, H, T30)
    _store_T_block(Ti_ptr, chunk, 3, 1, T_pad, H, T31)
    _store_T_block(Ti_ptr, chunk, 3, 2, T_pad, H, T32)
    _store_T_block(Ti_ptr, chunk, 3, 3, T_pad, H, T33)


@_autotune(_bv_configs(), key=["K", "V"], interpret_meta=_INTERPRET_BV)
@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, beta_ptr, G_ptr, Ti_ptr, W_ptr, U_ptr, doc_ptr, T,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, HAS_DOCS: tl.constexpr):
    """F3: W = T (beta k exp(G)) [64, K] and U = T (beta v) [64, V] per chunk."""
    chunk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    b, h = bh // H, bh % H
    T_pad = tl.cdiv(T, 64) * 64
    rows = chunk * 64 + tl.arange(0, 64)
    cols_k = tl.arange(0, BK)
    t_inv = _load_tile(Ti_ptr + (b * T_pad * H + h) * 64, rows, tl.arange(0, 64), H * 64, T_pad, 64)
    beta = tl.load(beta_ptr + (b * T * H + h) + rows * H, mask=rows < T, other=0.0).to(tl.float32)
    k = _load_tile(k_ptr + (b * T * H + h) * K, rows, cols_k, H * K, T, K)
    G = _load_tile(G_ptr + (b * T_pad * H + h) * K, rows, cols_k, H * K, T_pad, K)
    G_last = _load_row(G_ptr + (b * T_pad * H + h) * K, chunk * 64 + 63, cols_k, H * K, T_pad, K)
    e_start, _, _ = _chunk_decays(G, G_last, doc_ptr, chunk, HAS_DOCS)
    w = tl.dot(t_inv, beta[:, None] * k * e_start, input_precision=DOT_PREC)  # [64, BK]
    _store_tile(W_ptr + (b * T_pad * H + h) * K, rows, cols_k, H * K, T_pad, K, w)
    for v0 in range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v = _load_tile(v_ptr + (b * T * H + h) * V, rows, cols_v, H * V, T, V)
        u = tl.dot(t_inv, beta[:, None] * v, input_precision=DOT_PREC)  # [64, BV]
        _store_tile(U_ptr + (b * T_pad * H + h) * V, rows, cols_v, H * V, T_pad, V, u)


@_autotune(_bv_configs(), key=["K", "V"], interpret_meta=_INTERPRET_BV)
@triton.jit
def _chunk_state_fwd_kernel(k_ptr, G_ptr, W_ptr, U_ptr, Vn_ptr, h_ptr, h0_ptr, hT_ptr, doc_ptr, T,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr,
                            HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
                            HAS_DOCS: tl.constexpr):
    """F4: the sequential pass over chunks for one value tile; S [BK, BV] fp32 lives in registers.

    h [B,H,NT,K,V] receives the state at each chunk's start; Vn = U - W S [B,T_pad,H,V].
    """
    pid_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    b, h = bh // H, bh % H
    NT = tl.cdiv(T, 64)
    T_pad = NT * 64
    cols_k = tl.arange(0, BK)
    cols_v = pid_v * BV + tl.arange(0, BV)
    state_mask = (cols_k[:, None] < K) & (cols_v[None, :] < V)
    state_off = cols_k[:, None] * V + cols_v[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + bh * K * V + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for chunk in range(0, NT):
        tl.store(h_ptr + (bh * NT + chunk) * K * V + state_off, S, mask=state_mask)
        rows = chunk * 64 + tl.arange(0, 64)
        w = _load_tile(W_ptr + (b * T_pad * H + h) * K, rows, cols_k, H * K, T_pad, K)  # [64, BK]
        u = _load_tile(U_ptr + (b * T_pad * H + h) * V, rows, cols_v, H * V, T_pad, V)  # [64, BV]
        v_new = u - tl.dot(w, S, input_precision=DOT_PREC)
        _store_tile(Vn_ptr + (b * T_pad * H + h) * V, rows, cols_v, H * V, T_pad, V, v_new)
        k = _load_tile(k_ptr + (b * T * H + h) * K, rows, cols_k, H * K, T, K)
        G = _load_tile(G_ptr + (b * T_pad * H + h) * K, rows, cols_k, H * K, T_pad, K)
        G_last = _load_row(G_ptr + (b * T_pad * H + h) * K, chunk * 64 + 63, cols_k, H * K, T_pad, K)
        _, e_end, e_last = _chunk_decays(G, G_last, doc_ptr, chunk, HAS_DOCS)
        k_decayed = k * e_end  # k_i exp(G_L - G_i)
        S = S * e_last[:, None] + tl.dot(tl.trans(k_decayed), v_new, input_precision=DOT_PREC)
    if STORE_HT:
        tl.store(hT_ptr + bh * K * V + state_off, S, mask=state_mask)


@_autotune(_bv_configs(), key=["K", "V"], interpret_meta=_INTERPRET_BV)
@triton.jit
def _chunk_output_kernel(q_ptr, G_ptr, M_ptr, Vn_ptr, h_ptr, o_ptr, doc_ptr, scale, T,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, HAS_DOCS: tl.constexpr):
    """F5: O = scale (q exp(G)) S_chunk + M Vn, for one chunk and value tile."""
    chunk, pid_v, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    NT = tl.cdiv(T, 64)
    T_pad = NT * 64
    rows = chunk * 64 + tl.arange(0, 64)
    cols_k = tl.arange(0, BK)
    cols_v = pid_v * BV + tl.arange(0, BV)
    q = _load_tile(q_ptr + (b * T * H + h) * K, rows, cols_k, H * K, T, K)
    G = _load_tile(G_ptr + (b * T_pad * H + h) * K, rows, cols_k, H * K, T_pad, K)
    S = _load_tile(h_ptr + (bh * NT + chunk) * K * V, cols_k, cols_v, V, K, V)  # [BK, BV]
    m = _load_tile(M_ptr + (b * T_pad * H + h) * 64, rows, tl.arange(0, 64), H * 64, T_pad, 64)
    v_new = _load_tile(Vn_ptr + (b * T_pad * H + h) * V, rows, cols_v, H * V, T_pad, V)
    G_last = _load_row(G_ptr + (b * T_pad * H + h) * K, chunk * 64 + 63, cols_k, H * K, T_pad, K)
    e_start, _, _ = _chunk_decays(G, G_last, doc_ptr, chunk, HAS_DOCS)
    o = tl.dot(q * e_start, S, input_precision=DOT_PREC) * scale + tl.dot(m, v_new, input_precision=DOT_PREC)
    _store_tile(o_ptr + (b * T * H + h) * V, rows, cols_v, H * V, T, V, o)


# --------------------------------------------------------------------------------------------------
# Backward stages
# --------------------------------------------------------------------------------------------------
@_autotune(_bv_configs(), key=["K", "V"], interpret_meta=_INTERPRET_BV)
@triton.jit
def _chunk_state_bwd_kernel(q_ptr, k_ptr, G_ptr, W_ptr, M_ptr, do_ptr, dh_ptr, dVn_ptr, dhT_ptr, dh0_ptr,
                            doc_ptr, scale, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr,
                            DOT_PREC: tl.constexpr, HAS_DOCS: tl.constexpr):
    """B1: reverse pass over chunks for one value tile; dS [BK, BV] = dLoss/d(state at chunk end).

        dh[c] = dS;  dVn = M^T dO + (k exp(G_L - G)) dS
        dS   <- Diag(exp(G_L)) dS + scale (q exp(G))^T dO - W^T dVn      (ends as d initial_state)
    """
    pid_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    b, h = bh // H, bh % H
    NT = tl.cdiv(T, 64)
    T_pad = NT * 64
    cols_k = tl.arange(0, BK)
    cols_v = pid_v * BV + tl.arange(0, BV)
    state_mask = (cols_k[:, None] < K) & (cols_v[None, :] < V)
    state_off = cols_k[:, None] * V + cols_v[None, :]
    if HAS_DHT:
        dS = tl.load(dhT_ptr + bh * K * V + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, NT):
        chunk = NT - 1 - i
        tl.store(dh_ptr + (bh * NT + chunk) * K * V + state_off, dS, mask=state_mask)
        rows = chunk * 64 + tl.arange(0, 64)
        do = _load_tile(do_ptr + (b * T * H + h) * V, rows, cols_v, H * V, T, V)  # [64, BV]
        m = _load_tile(M_ptr + (b * T_pad * H + h) * 64, rows, tl.arange(0, 64), H * 64, T_pad, 64)
        q = _load_tile(q_ptr + (b * T * H + h) * K, rows, cols_k, H * K, T, K)
        k = _load_tile(k_ptr + (b * T * H + h) * K, rows, cols_k, H * K, T, K)
        w = _load_tile(W_ptr + (b * T_pad * H + h) * K, rows, cols_k, H * K, T_pad, K)
        G = _load_tile(G_ptr + (b * T_pad * H + h) * K, rows, cols_k, H * K, T_pad, K)
        G_last = _load_row(G_ptr + (b * T_pad * H + h) * K, chunk * 64 + 63, cols_k, H * K, T_pad, K)
        e_start, e_end, e_last = _chunk_decays(G, G_last, doc_ptr, chunk, HAS_DOCS)
        k_decayed = k * e_end
        dv_new = tl.dot(tl.trans(m), do, input_precision=DOT_PREC) \
            + tl.dot(k_decayed, dS, input_precision=DOT_PREC)  # [64, BV]
        _store_tile(dVn_ptr + (b * T_pad * H + h) * V, rows, cols_v, H * V, T_pad, V, dv_new)
        dS = dS * e_last[:, None] \
            + tl.dot(tl.trans(q * e_start), do, input_precision=DOT_PREC) * scale \
            - tl.dot(tl.trans(w), dv_new, input_precision=DOT_PREC)
    tl.store(dh0_ptr + bh * K * V + state_off, dS, mask=state_mask)


@_autotune(_bv_configs(), key=["K", "V"], interpret_meta=_INTERPRET_BV)
@triton.jit
def _chunk_bwd_main_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, G_ptr, Ti_ptr, Ak_ptr, h_ptr, dh_ptr, do_ptr,
                           Vn_ptr, dVn_ptr,
                           dv_ptr, dbeta_ptr, dAk_ptr, dMs_ptr, dq_ptr, dk_ptr, dG_ptr, doc_ptr,
                           scale, T, dbeta_split_stride, dAk_split_stride, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
                           HAS_DOCS: tl.constexpr):
    """B2: everything of one chunk that needs no sub-chunk gating.

    With S0 = h[c], dS1 = dh[c], dVn from B1:
        d(q e^G) = scale dO S0^T        d(k e^{G_L-G}) = Vn dS1^T        dW = -dVn S0^T
        dM = dO Vn^T                    dT = dVn (beta v)^T + dW (beta k e^G)^T
        d(beta v) = T^T dVn             d(beta k e^G) = T^T dW           dA = -T^T dT T^T (strictly lower)
    Writes dv, dbeta, scale*dM and beta*dA for B3, and partial dq, dk, dG (fp32).

    The key columns are split across programs (axis 2, BK each; bwd_main_split_width): each computes its
    columns of dq, dk, dG, and its share of dT, hence of dA and dbeta, which are sums over the columns
    (dbeta and beta*dA go to split `ks`'s slice of their buffers; the host adds the slices). Split 0 also
    does the value-only work (dv, dM, the value share of dT and dbeta). So no program holds three
    [64, K] fp32 accumulators at K = 128, which spilled kilobytes per thread on sm_90.
    """
    chunk, bh, ks = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)  # int64 offsets
    if K > BK:  # compile time: with one program per chunk (K <= BK), the kernel is what it was unsplit
        split, first = ks, ks == 0
    else:
        split, first = 0, True
    b, h = bh // H, bh % H
    NT = tl.cdiv(T, 64)
    T_pad = NT * 64
    idx = tl.arange(0, 64)
    rows = chunk * 64 + idx
    cols_k = split * BK + tl.arange(0, BK)
    in_k = (b * T * H + h) * K  # offsets of [B,T,H,K] inputs
    pad_k = (b * T_pad * H + h) * K  # and of [B,T_pad,H,K] intermediates
    pad_c = (b * T_pad * H + h) * 64
    t_inv = _load_tile(Ti_ptr + pad_c, rows, idx, H * 64, T_pad, 64)  # [64, 64]
    beta = tl.load(beta_ptr + (b * T * H + h) + rows * H, mask=rows < T, other=0.0).to(tl.float32)

    d_qe = tl.zeros([64, BK], dtype=tl.float32)  # d(q exp(G)) / scale
    d_kd = tl.zeros([64, BK], dtype=tl.float32)  # d(k exp(G_L - G))
    d_w = tl.zeros([64, BK], dtype=tl.float32)
    d_decay_last = tl.zeros([BK], dtype=tl.float32)  # sum_v dS1 * S0
    d_t = tl.zeros([64, 64], dtype=tl.float32)
    d_m = tl.zeros([64, 64], dtype=tl.float32)
    d_beta = tl.zeros([64], dtype=tl.float32)
    for v0 in range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        S0 = _load_tile(h_ptr + (bh * NT + chunk) * K * V, cols_k, cols_v, V, K, V)  # [BK, BV]
        dS1 = _load_tile(dh_ptr + (bh * NT + chunk) * K * V, cols_k, cols_v, V, K, V)  # [BK, BV]
        do = _load_tile(do_ptr + (b * T * H + h) * V, rows, cols_v, H * V, T, V)  # [64, BV]
        v = _load_tile(v_ptr + (b * T * H + h) * V, rows, cols_v, H * V, T, V)
        v_new = _load_tile(Vn_ptr + (b * T_pad * H + h) * V, rows, cols_v, H * V, T_pad, V)
        dv_new = _load_tile(dVn_ptr + (b * T_pad * H + h) * V, rows, cols_v, H * V, T_pad, V)
        d_qe += tl.dot(do, tl.trans(S0), input_precision=DOT_PREC)
        d_kd += tl.dot(v_new, tl.trans(dS1), input_precision=DOT_PREC)
        d_w -= tl.dot(dv_new, tl.trans(S0), input_precision=DOT_PREC)
        d_decay_last += tl.sum(dS1 * S0, axis=1)
        if first:  # value-only work: once per chunk, not once per key split
            d_m += tl.dot(do, tl.trans(v_new), input_precision=DOT_PREC)
            d_t += tl.dot(dv_new, tl.trans(beta[:, None] * v), input_precision=DOT_PREC)
            d_bv = tl.dot(tl.trans(t_inv), dv_new, input_precision=DOT_PREC)  # d(beta v) [64, BV]
            _store_tile(dv_ptr + (b * T * H + h) * V, rows, cols_v, H * V, T, V, beta[:, None] * d_bv)
            d_beta += tl.sum(d_bv * v, axis=1)

    q = _load_tile(q_ptr + in_k, rows, cols_k, H * K, T, K)
    k = _load_tile(k_ptr + in_k, rows, cols_k, H * K, T, K)
    G = _load_tile(G_ptr + pad_k, rows, cols_k, H * K, T_pad, K)
    G_last = _load_row(G_ptr + pad_k, chunk * 64 + 63, cols_k, H * K, T_pad, K)
    # O = scale (q e^G) S0 + ...
    e_G, e_end, e_last = _chunk_decays(G, G_last, doc_ptr, chunk, HAS_DOCS)
    dq = d_qe * scale * e_G
    dG = dq * q
    # S1 = e^{G_L} S0 + (k e^{G_L - G})^T Vn
    k_decayed = k * e_end
    dk = d_kd * e_end
    dG -= d_kd * k_decayed
    dG_last = d_decay_last * e_last + tl.sum(d_kd * k_decayed, axis=0)  # [BK]
    # W = T (beta k e^G)
    x = beta[:, None] * k * e_G
    d_t += tl.dot(d_w, tl.trans(x), input_precision=DOT_PREC)
    d_x = tl.dot(tl.trans(t_inv), d_w, input_precision=DOT_PREC)  # [64, BK]
    dk += d_x * beta[:, None] * e_G
    d_beta += tl.sum(d_x * k * e_G, axis=1)
    dG += d_x * x
    dG = tl.where(idx[:, None] == 63, dG + dG_last[None, :], dG)  # G_L is G of row 63 (padded rows copy it)
    # T = (I + Diag(beta) Ak)^-1
    d_a = -tl.dot(tl.trans(t_inv), tl.dot(d_t, tl.trans(t_inv), input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    d_a = tl.where(idx[:, None] > idx[None, :], d_a, 0.0)
    ak = _load_tile(Ak_ptr + pad_c, rows, idx, H * 64, T_pad, 64)
    d_beta += tl.sum(d_a * ak, axis=1)
    _store_tile(dAk_ptr + split * dAk_split_stride + pad_c, rows, idx, H * 64, T_pad, 64,
                _same_doc(d_a * beta[:, None], doc_ptr, rows, rows, HAS_DOCS))
    if first:
        _store_tile(dMs_ptr + pad_c, rows, idx, H * 64, T_pad, 64,
                    _same_doc(tl.where(idx[:, None] >= idx[None, :], d_m * scale, 0.0), doc_ptr, rows, rows,
                              HAS_DOCS))
    tl.store(dbeta_ptr + split * dbeta_split_stride + (b * T * H + h) + rows * H,
             d_beta.to(dbeta_ptr.dtype.element_ty), mask=rows < T)
    _store_tile(dq_ptr + pad_k, rows, cols_k, H * K, T_pad, K, dq)
    _store_tile(dk_ptr + pad_k, rows, cols_k, H * K, T_pad, K, dk)
    _store_tile(dG_ptr + pad_k, rows, cols_k, H * K, T_pad, K, dG)


@_autotune(_warps_configs(), key=["K"], interpret_meta={})
@triton.jit
def _chunk_bwd_intra_kernel(q_ptr, k_ptr, G_ptr, dAk_ptr, dMs_ptr, dq_part_ptr, dk_part_ptr, dG_part_ptr,
                            dq_ptr, dk_ptr, dG_ptr, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                            DOT_PREC: tl.constexpr):
    """B3: gradients through the gated products, for the 16 rows of sub-chunk s.

    For X_ij = sum_c a_ic b_jc Gamma_ijc with upstream dX (dMs: a=q, b=k; dAk: a=k, b=k):
        da_i = sum_j dX_ij b_j Gamma_ij    db_j = sum_i dX_ij a_i Gamma_ij
        dG_i += a_i * da_i                 dG_j -= b_j * db_j
    Rows of s take the a-side (blocks J <= s), columns of s the b-side (blocks I >= s), so no atomics.
    Adds the partials of B2 and writes dq, dk (input dtype) and dG (fp32). Nothing is updated in place,
    so the autotuner may rerun it.
    """
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    chunk, s = pid // 4, pid % 4
    b, h = bh // H, bh % H
    NT = tl.cdiv(T, 64)
    T_pad = NT * 64
    idx = tl.arange(0, 16)
    cols = tl.arange(0, BK)
    in_k = (b * T * H + h) * K
    pad_k = (b * T_pad * H + h) * K
    pad_c = (b * T_pad * H + h) * 64
    r0 = chunk * 64 + s * 16
    rows = r0 + idx
    q_s = _load_tile(q_ptr + in_k, rows, cols, H * K, T, K)
    k_s = _load_tile(k_ptr + in_k, rows, cols, H * K, T, K)
    G_s = _load_tile(G_ptr + pad_k, rows, cols, H * K, T_pad, K)
    G_r = _load_row(G_ptr + pad_k, r0, cols, H * K, T_pad, K)

    # a-side, off-diagonal blocks J < s: reference point r0 (first row of s)
    dq_m = tl.zeros([16, BK], dtype=tl.float32)  # from M: d q_s
    dk_a = tl.zeros([16, BK], dtype=tl.float32)  # from A: d k_s as the row factor
    for J in range(0, s):
        rows_J = chunk * 64 + J * 16 + idx
        k_J = _load_tile(k_ptr + in_k, rows_J, cols, H * K, T, K)
        G_J = _load_tile(G_ptr + pad_k, rows_J, cols, H * K, T_pad, K)
        k_j = k_J * tl.exp(G_r[None, :] - G_J)
        dm_blk = _load_tile(dMs_ptr + pad_c, rows, J * 16 + idx, H * 64, T_pad, 64)
        da_blk = _load_tile(dAk_ptr + pad_c, rows, J * 16 + idx, H * 64, T_pad, 64)
        dq_m += tl.dot(dm_blk, k_j, input_precision=DOT_PREC)
        dk_a += tl.dot(da_blk, k_j, input_precision=DOT_PREC)
    decay_to_i = tl.exp(G_s - G_r[None, :])
    dq_m *= decay_to_i
    dk_a *= decay_to_i
    # a-side, diagonal block: column j of dX times b_j Gamma_ij
    for j in range(0, 16):
        k_j = _load_row(k_ptr + in_k, r0 + j, cols, H * K, T, K)
        G_j = _load_row(G_ptr + pad_k, r0 + j, cols, H * K, T_pad, K)
        gamma = tl.exp(tl.where(idx[:, None] >= j, G_s - G_j[None, :], float("-inf")))  # [16, BK]
        dm_col = tl.load(dMs_ptr + pad_c + rows * (H * 64) + s * 16 + j)  # [16]
        da_col = tl.load(dAk_ptr + pad_c + rows * (H * 64) + s * 16 + j)
        kj_gamma = k_j[None, :] * gamma
        dq_m += dm_col[:, None] * kj_gamma
        dk_a += da_col[:, None] * kj_gamma

    # b-side, off-diagonal blocks I > s: reference point = first row of I
    dk_b = tl.zeros([16, BK], dtype=tl.float32)
    for I in range(s + 1, 4):
        rI0 = chunk * 64 + I * 16
        rows_I = rI0 + idx
        G_rI = _load_row(G_ptr + pad_k, rI0, cols, H * K, T_pad, K)
        decay_I = tl.exp(_load_tile(G_ptr + pad_k, rows_I, cols, H * K, T_pad, K) - G_rI[None, :])
        q_I = _load_tile(q_ptr + in_k, rows_I, cols, H * K, T, K) * decay_I
        k_I = _load_tile(k_ptr + in_k, rows_I, cols, H * K, T, K) * decay_I
        dm_blk = _load_tile(dMs_ptr + pad_c, rows_I, s * 16 + idx, H * 64, T_pad, 64)  # [16(i), 16(j)]
        da_blk = _load_tile(dAk_ptr + pad_c, rows_I, s * 16 + idx, H * 64, T_pad, 64)
        part = tl.dot(tl.trans(dm_blk), q_I, input_precision=DOT_PREC) \
            + tl.dot(tl.trans(da_blk), k_I, input_precision=DOT_PREC)
        dk_b += part * tl.exp(G_rI[None, :] - G_s)
    # b-side, diagonal block: row i of dX times a_i Gamma_ij
    for i in range(0, 16):
        q_i = _load_row(q_ptr + in_k, r0 + i, cols, H * K, T, K)
        k_i = _load_row(k_ptr + in_k, r0 + i, cols, H * K, T, K)
        G_i = _load_row(G_ptr + pad_k, r0 + i, cols, H * K, T_pad, K)
        gamma = tl.exp(tl.where(idx[:, None] <= i, G_i[None, :] - G_s, float("-inf")))  # [16(j), BK]
        dm_row = tl.load(dMs_ptr + pad_c + (r0 + i) * (H * 64) + s * 16 + idx)  # [16] over j
        da_row = tl.load(dAk_ptr + pad_c + (r0 + i) * (H * 64) + s * 16 + idx)
        dk_b += (dm_row[:, None] * q_i[None, :] + da_row[:, None] * k_i[None, :]) * gamma

    dq = _load_tile(dq_part_ptr + pad_k, rows, cols, H * K, T_pad, K) + dq_m
    dk = _load_tile(dk_part_ptr + pad_k, rows, cols, H * K, T_pad, K) + dk_a + dk_b
    dG = _load_tile(dG_part_ptr + pad_k, rows, cols, H * K, T_pad, K) + q_s * dq_m + k_s * (dk_a - dk_b)
    _store_tile(dq_ptr + in_k, rows, cols, H * K, T, K, dq)
    _store_tile(dk_ptr + in_k, rows, cols, H * K, T, K, dk)
    _store_tile(dG_ptr + pad_k, rows, cols, H * K, T_pad, K, dG)


@_autotune(_warps_configs(), key=["K"], interpret_meta={})
@triton.jit
def _chunk_reverse_cumsum_kernel(dG_ptr, dg_ptr, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """B4: dg_t = sum_{s >= t in the chunk} dG_s  (G = in-chunk cumsum of g)."""
    chunk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    b, h = bh // H, bh % H
    T_pad = tl.cdiv(T, 64) * 64
    rows = chunk * 64 + tl.arange(0, 64)
    cols = tl.arange(0, BK)
    dG = _load_tile(dG_ptr + (b * T_pad * H + h) * K, rows, cols, H * K, T_pad, K)
    _store_tile(dg_ptr + (b * T * H + h) * K, rows, cols, H * K, T, K, tl.cumsum(dG, axis=0, reverse=True))


# --------------------------------------------------------------------------------------------------
# Decode: fused recurrence, state updated in place
# --------------------------------------------------------------------------------------------------
@_autotune(_bv_configs(), key=["K", "V"], interpret_meta=_INTERPRET_BV, restore_value=["state_ptr"])
@triton.jit
def _fused_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, scale, T,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, GATE_PER_HEAD: tl.constexpr):
    """Token-by-token recurrence for a few tokens; program = (value tile, batch x head).

    q,k [B,T,H,K]  v,o [B,T,H,V]  g [B,T,H,K] or [B,T,H]  beta [B,T,H]  state [B,H,K,V] fp32 (in place).
    """
    pid_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64 offsets
    b, h = bh // H, bh % H
    cols_k = tl.arange(0, BK)
    cols_v = pid_v * BV + tl.arange(0, BV)
    mask_k, mask_v = cols_k < K, cols_v < V
    state_mask = mask_k[:, None] & mask_v[None, :]
    state_off = bh * K * V + cols_k[:, None] * V + cols_v[None, :]
    S = tl.load(state_ptr + state_off, mask=state_mask, other=0.0).to(tl.float32)  # [BK, BV]
    for t in range(0, T):
        row = b * T * H + t * H + h
        q = tl.load(q_ptr + row * K + cols_k, mask=mask_k, other=0.0).to(tl.float32) * scale
        k = tl.load(k_ptr + row * K + cols_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * V + cols_v, mask=mask_v, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row).to(tl.float32)
        if GATE_PER_HEAD:
            S = S * tl.exp(tl.load(g_ptr + row).to(tl.float32))
        else:
            g = tl.load(g_ptr + row * K + cols_k, mask=mask_k, other=0.0).to(tl.float32)
            S = S * tl.exp(g)[:, None]
        prediction = tl.sum(k[:, None] * S, axis=0)  # S'^T k  [BV]
        S += (beta * k)[:, None] * (v - prediction)[None, :]
        o = tl.sum(q[:, None] * S, axis=0)  # S^T (scale q)  [BV]
        tl.store(o_ptr + row * V + cols_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_ptr + state_off, S, mask=state_mask)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
def _block(n):
    return max(16, triton.next_power_of_2(n))


def bwd_main_split_width(K, interpret=INTERPRET):
    """Key columns per program of _chunk_bwd_main_kernel: at most 64 on a GPU (K = 128 in one program
    spilled 1.3 to 6 KB per thread for sm_90 at every config), 16 under the interpreter so that the tests
    cover the split at their small widths."""
    return min(_block(K), 16 if interpret else 64)


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _doc_rows(cu_seqlens, T_pad):
    """Packed documents: the document of every row [T_pad] int32 (padding rows: the last one)."""
    from . import doc_index
    return doc_index(cu_seqlens, T_pad).clamp_max(len(cu_seqlens) - 2).int().contiguous()


def _chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state, doc=None):
    """Runs F0..F5. q,k,g [B,T,H,K], v [B,T,H,V], beta [B,T,H] (contiguous, same device);
    doc [T_pad] int32 (packed documents, B == 1) or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK)
    T_pad = NT * CHUNK
    BK = _block(K)
    prec = _dot_precision(q.dtype)
    f32 = dict(device=q.device, dtype=torch.float32)
    G = torch.empty(B, T_pad, H, K, **f32)
    Ak = torch.zeros(B, T_pad, H, CHUNK, **f32)
    M = torch.zeros(B, T_pad, H, CHUNK, **f32)
    T_inv = torch.zeros(B, T_pad, H, CHUNK, **f32)
    W = torch.empty(B, T_pad, H, K, **f32)
    U = torch.empty(B, T_pad, H, V, **f32)
    V_new = torch.empty(B, T_pad, H, V, **f32)
    h = torch.empty(B, H, NT, K, V, **f32)
    final_state = torch.empty(B, H, K, V, **f32) if output_final_state else None
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    docs = dict(HAS_DOCS=doc is not None)
    doc = G if doc is None else doc  # dummy pointer when unused

    _chunk_cumsum_kernel[(NT, B * H)](g, G, T, H=H, K=K, BK=BK)
    _chunk_intra_kernel[(NT * 4, B * H)](q, k, G, Ak, M, doc, scale, T, H=H, K=K, BK=BK, DOT_PREC=prec, **docs)
    _chunk_solve_kernel[(NT, B * H)](Ak, beta, T_inv, T, H=H, DOT_PREC=prec)
    _chunk_wy_kernel[(NT, B * H)](k, v, beta, G, T_inv, W, U, doc, T, H=H, K=K, V=V, BK=BK, DOT_PREC=prec, **docs)
    _chunk_state_fwd_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), B * H)](
        k, G, W, U, V_new, h, initial_state, final_state, doc, T, H=H, K=K, V=V, BK=BK,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, DOT_PREC=prec, **docs)
    _chunk_output_kernel[lambda meta: (NT, triton.cdiv(V, meta["BV"]), B * H)](
        q, G, M, V_new, h, o, doc, scale, T, H=H, K=K, V=V, BK=BK, DOT_PREC=prec, **docs)
    saved = (G, Ak, M, T_inv, W, V_new, h)
    return o, final_state, saved


def _chunk_backward(q, k, v, beta, g_dtype, scale, saved, do, d_final_state, doc=None):
    """Runs B1..B4; returns dq, dk, dv, dg (per channel), dbeta, d_initial_state."""
    G, Ak, M, T_inv, W, V_new, h = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK)
    T_pad = NT * CHUNK
    BK = _block(K)
    prec = _dot_precision(q.dtype)
    f32 = dict(device=q.device, dtype=torch.float32)
    dh = torch.empty(B, H, NT, K, V, **f32)
    dV_new = torch.empty(B, T_pad, H, V, **f32)
    dh0 = torch.empty(B, H, K, V, **f32)
    BKS = bwd_main_split_width(K)
    n_splits = triton.cdiv(K, BKS)
    dAk = torch.empty(n_splits, B, T_pad, H, CHUNK, **f32)  # one slice per key split, added below
    dMs = torch.empty(B, T_pad, H, CHUNK, **f32)
    dq_part = torch.empty(B, T_pad, H, K, **f32)
    dk_part = torch.empty(B, T_pad, H, K, **f32)
    dG_part = torch.empty(B, T_pad, H, K, **f32)
    dG = torch.empty(B, T_pad, H, K, **f32)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty(B, T, H, K, device=q.device, dtype=g_dtype)
    dv = torch.empty_like(v)
    dbeta = torch.empty(n_splits, *beta.shape, device=beta.device,
                        dtype=beta.dtype if n_splits == 1 else torch.float32)
    docs = dict(HAS_DOCS=doc is not None)
    doc = G if doc is None else doc  # dummy pointer when unused

    _chunk_state_bwd_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), B * H)](
        q, k, G, W, M, do, dh, dV_new, d_final_state, dh0, doc, scale, T, H=H, K=K, V=V, BK=BK,
        HAS_DHT=d_final_state is not None, DOT_PREC=prec, **docs)
    _chunk_bwd_main_kernel[(NT, B * H, n_splits)](
        q, k, v, beta, G, T_inv, Ak, h, dh, do, V_new, dV_new,
        dv, dbeta, dAk, dMs, dq_part, dk_part, dG_part, doc, scale, T, dbeta[0].numel(), dAk[0].numel(),
        H=H, K=K, V=V, BK=BKS, DOT_PREC=prec, **docs)
    dAk, dbeta = (dAk[0], dbeta[0]) if n_splits == 1 else (dAk.sum(0), dbeta.sum(0).to(beta.dtype))
    _chunk_bwd_intra_kernel[(NT * 4, B * H)](
        q, k, G, dAk, dMs, dq_part, dk_part, dG_part, dq, dk, dG, T, H=H, K=K, BK=BK, DOT_PREC=prec)
    _chunk_reverse_cumsum_kernel[(NT, B * H)](dG, dg, T, H=H, K=K, BK=BK)
    return dq, dk, dv, dg, dbeta, dh0


# torch.library ops: one opaque node for the forward and one for the backward under torch.compile,
# with fake (meta) impls for their shapes and a registered autograd: no graph break. The forward also
# returns what the backward needs (the `saved` intermediates); they carry no gradient.

@torch.library.custom_op("hybrid::delta_rule_fwd", mutates_args=())
def _delta_rule_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       scale: float, initial_state: torch.Tensor | None, output_final_state: bool,
                       doc: torch.Tensor | None) -> list[torch.Tensor]:
    o, final_state, saved = _chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state, doc)
    return [o, final_state if output_final_state else q.new_empty(0, dtype=torch.float32), *saved]


@_delta_rule_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, doc):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = (T + CHUNK - 1) // CHUNK
    T_pad = NT * CHUNK
    f32 = dict(dtype=torch.float32)
    final_state = q.new_empty(B, H, K, V, **f32) if output_final_state else q.new_empty(0, **f32)
    return [q.new_empty(B, T, H, V, dtype=v.dtype), final_state,
            q.new_empty(B, T_pad, H, K, **f32), *(q.new_empty(B, T_pad, H, CHUNK, **f32) for _ in range(3)),
            q.new_empty(B, T_pad, H, K, **f32), q.new_empty(B, T_pad, H, V, **f32), q.new_empty(B, H, NT, K, V, **f32)]


@torch.library.custom_op("hybrid::delta_rule_bwd", mutates_args=())
def _delta_rule_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g_dtype: torch.dtype,
                       scale: float, saved: list[torch.Tensor], do: torch.Tensor, d_final_state: torch.Tensor | None,
                       doc: torch.Tensor | None) -> list[torch.Tensor]:
    return list(_chunk_backward(q, k, v, beta, g_dtype, scale, saved, do.contiguous(), d_final_state, doc))


@_delta_rule_bwd_op.register_fake
def _(q, k, v, beta, g_dtype, scale, saved, do, d_final_state, doc):
    B, T, H, K = q.shape
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(B, T, H, K, dtype=g_dtype),
            torch.empty_like(beta), q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32)]


def _delta_rule_setup(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, doc = inputs
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(q, k, v, beta, doc, *output[2:])
    ctx.scale, ctx.g_dtype = scale, g.dtype
    ctx.initial_state_dtype = None if initial_state is None else initial_state.dtype


def _delta_rule_grad(ctx, grads):
    do, d_final_state = grads[0], grads[1]
    q, k, v, beta, doc, *saved = ctx.saved_tensors
    if d_final_state is not None and d_final_state.numel() == 0:   # no final state was asked for
        d_final_state = None
    if d_final_state is not None:
        d_final_state = d_final_state.contiguous().float()
    dq, dk, dv, dg, dbeta, dh0 = _delta_rule_bwd_op(q, k, v, beta, ctx.g_dtype, ctx.scale, saved, do,
                                                    d_final_state, doc)
    dh0 = dh0.to(ctx.initial_state_dtype) if ctx.initial_state_dtype is not None else None
    return dq, dk, dv, dg, dbeta, None, dh0, None, None


torch.library.register_autograd("hybrid::delta_rule_fwd", _delta_rule_grad, setup_context=_delta_rule_setup)


def _check(q, k, v, g, beta):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"delta_rule: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"beta{tuple(beta.shape)} do not match")
    if g.shape != q.shape and g.shape != q.shape[:3]:
        raise ValueError(f"delta_rule: g must be [B,T,H,K] or [B,T,H], got {tuple(g.shape)}")
    if K > 256 or V > 256:
        raise ValueError(f"delta_rule (triton): K and V must be <= 256, got K={K} V={V}")


def delta_rule_triton(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None):
    """Chunked gated delta rule (see module docstring). Differentiable in q, k, v, g, beta, initial_state.

    q,k [B,T,H,K]  v [B,T,H,V]  g [B,T,H,K] or [B,T,H]  beta [B,T,H]  initial_state [B,H,K,V] fp32.
    cu_seqlens: int64 [n_docs + 1] packed documents (B == 1, no states; checked by the caller) or None.
    Returns (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] fp32 or None).
    """
    _check(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    if g.dim() == 3:  # per-head gate: broadcast to channels (autograd sums dg back over K)
        g = g.unsqueeze(-1).expand(B, T, H, K)
    if initial_state is not None:
        if initial_state.shape != (B, H, K, V):
            raise ValueError(f"delta_rule: initial_state must be {(B, H, K, V)}, got {tuple(initial_state.shape)}")
        initial_state = initial_state.float().contiguous()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    doc = None if cu_seqlens is None else _doc_rows(cu_seqlens, triton.cdiv(T, CHUNK) * CHUNK)
    o, final_state, *_ = _delta_rule_fwd_op(q, k, v, g, beta, scale, initial_state, bool(output_final_state), doc)
    return o, (final_state if output_final_state else None)


@torch.library.custom_op("hybrid::fused_recurrent_delta_rule", mutates_args=("state",))
def _fused_recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, scale: float) -> torch.Tensor:
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    _fused_recurrent_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), B * H)](
        q, k, v, g, beta, state, o, scale, T, H=H, K=K, V=V, BK=_block(K), GATE_PER_HEAD=g.dim() == 3)
    return o


@_fused_recurrent_op.register_fake
def _(q, k, v, g, beta, state, scale):
    return v.new_empty(*q.shape[:3], v.shape[-1])


def fused_recurrent_delta_rule_triton(q, k, v, g, beta, state, *, scale=None):
    """Recurrent form for a few tokens (decode/verification); `state` [B,H,K,V] fp32 updated in place.

    q,k [B,T,H,K]  v [B,T,H,V]  g [B,T,H,K] or [B,T,H]  beta [B,T,H]  ->  o [B,T,H,V]. No autograd
    (a registered op that mutates `state`).
    """
    _check(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if state.shape != (B, H, K, V) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"delta_rule_step: state must be a contiguous float32 {(B, H, K, V)} tensor, "
                         f"got {state.dtype} {tuple(state.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    return _fused_recurrent_op(q, k, v, g, beta, state, scale)


def delta_rule_step_triton(q, k, v, g, beta, state, *, scale=None):
    """One decode token: q,k [B,H,K]  v [B,H,V]  g [B,H,K] or [B,H]  beta [B,H]; state updated in place.

    Returns o [B,H,V].
    """
    o = fused_recurrent_delta_rule_triton(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1),
                                          beta.unsqueeze(1), state, scale=scale)
    return o.squeeze(1)
