"""Gated delta rule and plain linear attention, pure PyTorch: the reference path and the CPU
training path (SPEC 4, 0.3).

Per batch element and head, with a state S in R^{K x V} kept in float32:

    S'  = Diag(exp(g_t)) S_{t-1}                  g_t <= 0: [K] per key channel (KDA) or one scalar (GDN)
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T      the delta rule: write only the correction
    o_t = S_t^T (scale * q_t)                     scale defaults to K ** -0.5; no normalisation here

Chunked form (chunk C = 64). Inside a chunk that starts from state S0, let G_t = sum_{s<=t} g_s
(cumulative log decay from the chunk start, G <= 0 and non-increasing). Unrolling the recurrence,
S_t = Diag(exp(G_t)) S0 + sum_{j<=t} Diag(exp(G_t - G_j)) k_j u_j^T, where u_j = beta_j (v_j - S'_j^T k_j)
is what step j actually writes. Substituting S'_t into u_t gives a unit lower-triangular system:

    A[i,j]  = beta_i (k_i * exp(G_i - G_j)) . k_j        j < i   (zero on and above the diagonal)
    (I + A) U_all = beta * v - (beta * k * exp(G)) S0    so  U_all = U - W S0  with
    U = (I + A)^-1 (beta * v),   W = (I + A)^-1 (beta * k * exp(G))     (state-independent)
    O      = (q * exp(G)) S0 + P U_all,   P[i,j] = (q_i * exp(G_i - G_j)) . k_j   j <= i
    S_next = Diag(exp(G_last)) S0 + (k * exp(G_last - G))^T U_all

Everything except the last two lines is computed for all chunks at once; the loop over chunks
carries only S (three small matmuls per chunk).

The per-channel pairwise decay exp(G_i - G_j) is never materialised as a [C, C, K] tensor, and no
positive number is ever exponentiated (per-step log decays of -20 reach G = -1280 inside a chunk, so
exp(-G_j) alone would overflow). P, A and (I + A)^-1 are built together by recursive halving. For a
block of positions split into a low half and a high half, every pair (i in high, j in low) factors
through the last position r of the low half,  exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), with
both exponents <= 0; so the lower-left quarter of P (or A) is one matmul:
(q_i or k_i scaled by exp(G_i - G_r)) @ (k_j scaled by exp(G_r - G_j))^T. The inverse of a unit
lower-triangular block follows from its halves' inverses:
    [[T11, 0], [A21, T22]]^-1 = [[T11^-1, 0], [-T22^-1 A21 T11^-1, T22^-1]]
Starting from single positions (P = q_i . k_i, T^-1 = 1) and doubling six times gives the 64 x 64
matrices, all with batched matmuls. Memory is O(T * (K + C) * log C), linear in T. A per-head gate
(GDN) is the same with G of shape [..., C, 1] broadcast over K.

Plain linear attention (`kind: linear`): S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T (scale * q_t). It is
not a special case of the delta rule (which writes a correction, not k v^T), so it has its own small
chunked function and step below.

Packed documents (cu_seqlens, B == 1): with doc_i the document of position i, a boundary inside a
chunk is handled by masks on the chunk matrices, nothing is padded:
    A[i,j], P[i,j]   kept only when doc_i == doc_j (so (I + A)^-1 is block diagonal per document)
    exp(G_i) in W and in q * exp(G)      only where doc_i continues from the chunk start ("cont")
    exp(G_last) on S0 in S_next          only when the chunk's last row continues from its start
    k_j in S_next                        only where doc_j is the document of the chunk's last row
Every masked term is finite before the mask (exponents stay <= 0), so gradients stay clean.

Gradients come from autograd through the chunked forward.
"""
import torch
import torch.nn.functional as F

CHUNK = 64  # positions per chunk; a power of two (the recursive halving needs it)


def _to_chunks(x, T_pad, C):
    """[B, T, H, *rest] -> [B, H, N, C, *rest] float32, zero-padded in time up to T_pad = N * C."""
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    x = x.float()
    if T_pad > T:
        x = F.pad(x, (0, 0) * len(rest) + (0, 0, 0, T_pad - T))
    return x.reshape(B, T_pad // C, C, H, *rest).movedim(3, 1)


def _from_chunks(x, T):
    """[B, H, N, C, D] -> [B, T, H, D] (drops the padding)."""
    B, H, N, C, D = x.shape
    return x.movedim(1, 3).reshape(B, N * C, H, D)[:, :T]


def _join_blocks(diag_blocks, lower_left):
    """Diagonal blocks [..., 2n, h, h] and lower-left blocks [..., n, h, h] -> [..., n, 2h, 2h]:
    block i becomes [[diag[2i], 0], [lower_left[i], diag[2i+1]]]."""
    d = diag_blocks.unflatten(-3, (-1, 2))                       # [..., n, 2, h, h]
    top = torch.cat([d[..., 0, :, :], torch.zeros_like(lower_left)], dim=-1)
    bottom = torch.cat([lower_left, d[..., 1, :, :]], dim=-1)
    return torch.cat([top, bottom], dim=-2)                       # [..., n, 2h, 2h]


def _doc_masks(cu_seqlens, T_pad, C):
    """Packed-document masks of every chunk (float32, broadcast over B and H):
    doc [N, C, 1] document id (padding rows: the last document), cont [N, C, 1] continues from the
    chunk start, last [N, C, 1] is in the chunk's last row's document, carry [N, 1, 1] the chunk's
    last row continues from the chunk start."""
    from . import doc_index
    doc = doc_index(cu_seqlens, T_pad).clamp_max(len(cu_seqlens) - 2).view(T_pad // C, C)
    before = torch.cat([doc[:1, :1], doc[:-1, -1:]])                   # [N, 1]: doc of the row before
    cont = (doc == before).float()[..., None]
    last = (doc == doc[:, -1:]).float()[..., None]
    return doc.float()[..., None], cont, last, cont[:, -1:]


def _chunk_matrices(q, k, G, beta, doc=None):
    """The state-independent matrices of each chunk, without a [C, C, K] tensor.

    q, k [..., C, K]  G [..., C, K] or [..., C, 1] (cumulative log decay from the chunk start)
    beta [..., C, 1]  doc [..., C, 1] document ids (packed documents: cross-document pairs are 0). Returns
      P     [..., C, C]: (q_i * exp(G_i - G_j)) . k_j for j <= i, else 0
      T_inv [..., C, C]: (I + A)^-1 with A[i,j] = beta_i (k_i * exp(G_i - G_j)) . k_j for j < i
    """
    *lead, C, K = k.shape
    P = (q * k).sum(-1)[..., None, None]                          # [..., C, 1, 1]: blocks of one position
    T_inv = torch.ones_like(P)
    L = 2                                                         # block size at this level
    while L <= C:
        h = L // 2
        halves = lambda x: x.reshape(*lead, C // L, 2, h, x.shape[-1]).unbind(-3)  # low, high: [..., C/L, h, D]
        (G_low, G_high), (k_low, k_high), q_high = halves(G), halves(k), halves(q)[1]
        beta_high = halves(beta)[1]                               # [..., C/L, h, 1]
        same = 1.0
        if doc is not None:                                       # [..., C/L, h, h]: same document
            doc_low, doc_high = halves(doc)
            same = (doc_high == doc_low.transpose(-1, -2)).float()
        G_ref = G_low[..., h - 1:, :]                             # [..., C/L, 1, K]: last of the low half
        k_low_t = (k_low * torch.exp(G_ref - G_low)).transpose(-1, -2)   # [..., C/L, K, h], exponent <= 0
        from_ref = torch.exp(G_high - G_ref)                             # exponent <= 0
        P = _join_blocks(P, same * ((q_high * from_ref) @ k_low_t))      # [..., C/L, L, L]
        A21 = same * beta_high * ((k_high * from_ref) @ k_low_t)         # [..., C/L, h, h]
        T11_inv, T22_inv = T_inv.unflatten(-3, (-1, 2)).unbind(-3)
        T_inv = _join_blocks(T_inv, -(T22_inv @ A21) @ T11_inv)
        L *= 2
    return P.squeeze(-3), T_inv.squeeze(-3)


def delta_rule_torch(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None):
    """Chunked gated delta rule (see the module docstring for the math).

    q, k [B,T,H,K]  v [B,T,H,V]  g [B,T,H,K] (per channel) or [B,T,H] (per head), g <= 0
    beta [B,T,H] in (0,1)  initial_state [B,H,K,V] (float32) or None.
    cu_seqlens: int64 [n_docs + 1] packed documents (B == 1, checked by the caller), or None.
    Returns (o [B,T,H,V] in q's dtype, final_state [B,H,K,V] float32 or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"delta_rule: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"beta{tuple(beta.shape)} do not match")
    if g.shape not in (q.shape, q.shape[:3]):
        raise ValueError(f"delta_rule: g must be [B,T,H,K] or [B,T,H], got {tuple(g.shape)}")
    per_channel = g.dim() == 4
    in_dtype = q.dtype
    scale = K ** -0.5 if scale is None else scale
    C = CHUNK
    N = -(-T // C)                                                # number of chunks
    T_pad = N * C                                                 # padded steps: g=0, beta=0, k=0

    q = _to_chunks(q, T_pad, C) * scale                           # [B,H,N,C,K]
    k = _to_chunks(k, T_pad, C)                                   # [B,H,N,C,K]
    v = _to_chunks(v, T_pad, C)                                   # [B,H,N,C,V]
    beta = _to_chunks(beta, T_pad, C)[..., None]                  # [B,H,N,C,1]
    G = _to_chunks(g, T_pad, C).cumsum(3)                         # [B,H,N,C,K] or [B,H,N,C]
    if not per_channel:
        G = G[..., None]                                          # [B,H,N,C,1], broadcasts over K

    # state-independent, all chunks at once
    doc, cont, last, carry = (None, 1.0, 1.0, 1.0) if cu_seqlens is None else _doc_masks(cu_seqlens, T_pad, C)
    doc = None if doc is None else doc.expand(B, H, N, C, 1)
    P, T_inv = _chunk_matrices(q, k, G, beta, doc)                # [B,H,N,C,C] each
    decay_from_start = torch.exp(G) * cont                        # [B,H,N,C,K or 1]: 0 after a boundary
    WU = T_inv @ torch.cat([beta * k * decay_from_start, beta * v], dim=-1)   # [B,H,N,C,K+V]
    W, U = WU[..., :K], WU[..., K:]                               # [B,H,N,C,K], [B,H,N,C,V]
    q_decayed = q * decay_from_start                              # [B,H,N,C,K]: q_i decayed from the chunk start
    G_last = G[..., C - 1:, :]                                    # [B,H,N,1,K or 1]
    k_to_end_t = (k * torch.exp(G_last - G) * last).transpose(-1, -2)  # [B,H,N,K,C]: k_j decayed to the chunk end
    state_decay = (torch.exp(G_last) * carry).transpose(-1, -2)   # [B,H,N,K or 1,1]

    # the recurrence over chunks: only S is carried
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    # unbind, not U[:, :, n]: the backward of each index op would zero-fill a full-size gradient
    per_chunk = zip(*(x.unbind(2) for x in (U, W, q_decayed, P, state_decay, k_to_end_t)))
    for U_n, W_n, q_n, P_n, decay_n, k_to_end_n in per_chunk:
        u = U_n - W_n @ S                                         # [B,H,C,V]: what each step writes
        outs.append(q_n @ S + P_n @ u)                            # [B,H,C,V]
        S = S * decay_n + k_to_end_n @ u                          # [B,H,K,V]
    o = _from_chunks(torch.stack(outs, dim=2), T)                 # [B,T,H,V]
    return o.to(in_dtype), (S if output_final_state else None)


def delta_rule_step_torch(q, k, v, g, beta, state, *, scale=None):
    """One token of the gated delta rule; `state` is updated in place.

    q, k [B,H,K]  v [B,H,V]  g [B,H,K] or [B,H]  beta [B,H]  state [B,H,K,V] float32.
    Returns o [B,H,V] in q's dtype.
    """
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dtype = q.dtype
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    decay = torch.exp(g)[..., None] if g.dim() == 3 else torch.exp(g)[..., None, None]
    state.mul_(decay)                                             # S' = Diag(exp(g)) S
    k_read = torch.einsum("bhk,bhkv->bhv", k, state)              # S'^T k
    write = beta[..., None] * (v - k_read)                        # [B,H,V]
    state.add_(k[..., :, None] * write[..., None, :])             # S = S' + k write^T
    o = torch.einsum("bhk,bhkv->bhv", q * scale, state)
    return o.to(dtype)


def linear_attention_torch(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None):
    """Chunked plain linear attention: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T (scale * q_t).

    q, k [B,T,H,K]  v [B,T,H,V]  initial_state [B,H,K,V] float32 or None; scale defaults to K ** -0.5
    (pass scale=1.0 for the bare o_t = S_t^T q_t). Returns (o [B,T,H,V], final_state or None).
    Per chunk: O = q S0 + tril(q k^T) v; the chunk-start states are a cumulative sum of k^T v.
    Packed documents (cu_seqlens): the masks of delta_rule_torch, and the chunk-start states are
    carried chunk by chunk (a sum that restarts where a document starts).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    C = CHUNK
    N = -(-T // C)
    T_pad = N * C
    qc = _to_chunks(q, T_pad, C) * scale                          # [B,H,N,C,K]
    kc = _to_chunks(k, T_pad, C)                                  # [B,H,N,C,K]
    vc = _to_chunks(v, T_pad, C)                                  # [B,H,N,C,V]
    S0 = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    qk = (qc @ kc.transpose(-1, -2)).tril()                       # [B,H,N,C,C]
    if cu_seqlens is None:
        kv = kc.transpose(-1, -2) @ vc                            # [B,H,N,K,V]: each chunk's total write
        before = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1].cumsum(2)], dim=2)
        starts = S0[:, :, None] + before                          # [B,H,N,K,V]: state before each chunk
    else:
        doc, cont, last, carry = _doc_masks(cu_seqlens, T_pad, C)
        kv = (kc * last).transpose(-1, -2) @ vc                   # the write of the chunk's last document
        qc, qk = qc * cont, qk * (doc == doc.transpose(-1, -2))
        starts, S = [], S0
        for kv_n, carry_n in zip(kv.unbind(2), carry.unbind(0)):
            starts.append(S)
            S = S * carry_n + kv_n
        starts = torch.stack(starts, dim=2)                       # [B,H,N,K,V]
    o = qc @ starts + qk @ vc                                     # [B,H,N,C,V]
    final = starts[:, :, -1] + kv[:, :, -1] if output_final_state else None
    return _from_chunks(o, T).to(q.dtype), final


def linear_attention_step_torch(q, k, v, state, *, scale=None):
    """One token of plain linear attention; `state` [B,H,K,V] float32 is updated in place.
    q, k [B,H,K]  v [B,H,V]  ->  o [B,H,V] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state.add_(k.float()[..., :, None] * v.float()[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q.float() * scale, state).to(q.dtype)
