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

In the code G is kept in log2 units (log2(e) times the sum of the g's), so each factor exp(G_i - G_j) above
is an exp2 of a difference (torch.exp2 is about twice as fast as torch.exp on the CPU); the gradients
(dG, dg) are still with respect to the natural-log decays.

Everything except the last two lines is computed for all chunks at once; the loop over chunks
carries only S (two small matmuls per chunk each way).

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
(GDN, G of shape [..., C, 1]) factors out of the dot products: P = (q k^T) * D and A = beta (k k^T) * D
with the [C, C] matrix D[i,j] = exp(G_i - G_j) (j <= i, the exponent masked to -inf above the diagonal),
so only the inverse takes the halving (1.75x faster forward + backward than halving everything).

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

Gradients are written by hand (_chunk_backward, inside the autograd Function _ChunkedDeltaRule): the
forward saves its inputs and the state before each chunk, and for sequences of up to KEEP_CHUNKS chunks
also the chunk matrices; the backward takes those or recomputes each group of chunks' matrices, runs the
recurrence backwards (the gradient of what each chunk writes,
du = P^T dO + k_to_end dS_after, and dS before the chunk = q_decayed^T dO + state_decay dS_after - W^T du),
and pushes the gradients through P and A with the same halving (_decayed_matmuls); with packed documents the
same masks zero dP and dA across documents and k_to_end's gradient outside the last row's document.
tests/test_delta_rule.py checks it against autograd through _chunk_forward.
"""
import torch
import torch.nn.functional as F

CHUNK = 64  # positions per chunk; a power of two (the recursive halving needs it)
LOG2E = 1.4426950408889634  # G is kept in log2 units: exp(G_i - G_j) = exp2(log2(e) (G_i - G_j)), and on the
                            # CPU torch.exp2 takes about half the time of torch.exp (float32, AVX2)
# chunks the autograd Function processes at once (bench/bench_delta_rule.py --against): the forward frees its
# temporaries, so it takes larger groups (fewer, larger ops); the backward's temporaries set the op's peak
# memory (B=1 H=4 K=V=64 T=2048: 3 chunks 18.5 MB, 4 chunks 19.9 MB, at about the same speed; 18.8 MB with
# 3 since _chunk_matrices fills preallocated buffers)
GROUP_FORWARD, GROUP_BACKWARD = 8, 3
# sequences of at most KEEP_CHUNKS chunks (512 steps) keep their chunk operators from the forward for the backward
# (_ChunkedDeltaRule): the backward then recomputes nothing. Op forward + backward at B=8 T=256, H=4 K=V=64: 1.2x
# faster at 1.4x the peak memory (still 1.5x below autograd's); the KDA and GDN models at that shape 1.06x.
# Longer sequences recompute, so what the op holds stays a few copies of its inputs (T=2048: 4.3x below autograd).
KEEP_CHUNKS = 8
# torch before 2.13 gives _ChunkedDeltaRule wrong gradients under torch.compile (seen on 2.11; 2.13 is pinned)
_OLD_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def _to_chunks(x, T_pad, C):
    """[B, T, H, *rest] -> [B, H, N, C, *rest] float32, zero-padded in time up to T_pad = N * C."""
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    x = x.to(_compute_dtype(x))
    if T_pad > T:
        x = F.pad(x, (0, 0) * len(rest) + (0, 0, 0, T_pad - T))
    return x.reshape(B, T_pad // C, C, H, *rest).movedim(3, 1).contiguous()  # contiguous: 2-3x faster ops


def _from_chunks(x, T):
    """[B, H, N, C, D] -> [B, T, H, D] (drops the padding)."""
    B, H, N, C, D = x.shape
    return x.movedim(1, 3).reshape(B, N * C, H, D)[:, :T]


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

    q, k [..., C, K]  G [..., C, K] or [..., C, 1] (cumulative log2 decay from the chunk start)
    beta [..., C, 1]  doc [..., C, 1] document ids (packed documents: cross-document pairs are 0). Returns
      P     [..., C, C]: (q_i * exp(G_i - G_j)) . k_j for j <= i, else 0
      T_inv [..., C, C]: (I + A)^-1 with A[i,j] = beta_i (k_i * exp(G_i - G_j)) . k_j for j < i
    A per-head gate (G [..., C, 1]) factors out of the dot products: P and A are then two matmuls times
    one [C, C] decay matrix, and only the inverse needs the halving.
    """
    *lead, C, K = k.shape
    T_inv = k.new_zeros(*lead, C, C)                              # filled block by block, level by level
    T_inv.diagonal(dim1=-2, dim2=-1).fill_(1.0)                   # blocks of one position: 1
    if G.shape[-1] == 1:
        decay = _pair_decay(G, doc)                               # [..., C, C]
        P = (q @ k.transpose(-1, -2)) * decay
        A = beta * (k @ k.transpose(-1, -2)) * decay
        A.diagonal(dim1=-2, dim2=-1).zero_()                      # strictly lower
        for L in _levels(C):
            _invert_level(T_inv, _diag_blocks(A, L)[..., L // 2:, :L // 2], L)
        return P, T_inv
    P = k.new_zeros(*lead, C, C)
    P.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))          # P[i,i] = q_i . k_i: no decay
    for L in _levels(C):                                          # L: the block size at this level
        h = L // 2
        halves = lambda x: x.reshape(*lead, C // L, 2, h, x.shape[-1]).unbind(-3)  # low, high: [..., C/L, h, D]
        (G_low, G_high), (k_low, k_high), q_high = halves(G), halves(k), halves(q)[1]
        beta_high = halves(beta)[1]                               # [..., C/L, h, 1]
        same = 1.0
        if doc is not None:                                       # [..., C/L, h, h]: same document
            doc_low, doc_high = halves(doc)
            same = (doc_high == doc_low.transpose(-1, -2)).float()
        G_ref = G_low[..., h - 1:, :]                             # [..., C/L, 1, K]: last of the low half
        k_low_t = (k_low * torch.exp2(G_ref - G_low)).transpose(-1, -2)  # [..., C/L, K, h], exponent <= 0
        from_ref = torch.exp2(G_high - G_ref)                            # exponent <= 0
        _diag_blocks(P, L)[..., h:, :h] = _masked((q_high * from_ref) @ k_low_t, same)
        _invert_level(T_inv, same * beta_high * ((k_high * from_ref) @ k_low_t), L)
    return P, T_inv


def _levels(C):
    """The block sizes of the recursive halving: 2, 4, ..., C."""
    return [2 ** i for i in range(1, C.bit_length())]


def _invert_level(T_inv, A21, L):
    """One doubling of the inverse, in place: T_inv [..., C, C] holds the inverses of the diagonal blocks of
    size L/2; A21 [..., C/L, L/2, L/2] are the lower-left quarters of A's diagonal blocks of size L. Writes
    the lower-left quarters of T_inv's blocks of size L:
        [[T11, 0], [A21, T22]]^-1 = [[T11^-1, 0], [-T22^-1 A21 T11^-1, T22^-1]]
    (T11^-1 and T22^-1 are copied out first, so autograd never sees a tensor it saved change.)"""
    h = L // 2
    blocks = _diag_blocks(T_inv, L)                               # [..., C/L, L, L], a view
    T11_inv = blocks[..., :h, :h].clone(memory_format=torch.contiguous_format)
    T22_inv = blocks[..., h:, h:].clone(memory_format=torch.contiguous_format)
    blocks[..., h:, :h] = -(T22_inv @ A21) @ T11_inv


def _diag_blocks(M, L):
    """The L x L blocks on the diagonal of M [..., C, C], as a view [..., C/L, L, L]."""
    *lead, C, _ = M.shape
    return M.view(*lead, C // L, L, C // L, L).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _pair_decay(G, doc=None, strict=False):
    """Per-head gate: [..., C, C] exp(G_i - G_j) for j <= i (j < i if strict; and the same document), else 0.
    G [..., C, 1]; the exponent is set to -inf where the result is 0 before exp2, so nothing overflows."""
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    decay = torch.exp2((G - G.transpose(-1, -2)).masked_fill(~causal, float("-inf")))
    return decay if doc is None else decay * (doc == doc.transpose(-1, -2))


NO_DOCS = (None, 1.0, 1.0, 1.0)  # _doc_masks without packed documents: nothing masked


def _masked(x, mask):
    """x * mask, or x itself for the mask 1.0 of NO_DOCS (no pass over x to multiply it by one)."""
    return x if isinstance(mask, float) else x * mask


def _chunk_operators(q, k, v, G, beta, masks=NO_DOCS):
    """The state-independent per-chunk operators, for all chunks at once.

    q (scaled), k [..., C, K]  v [..., C, V]  G [..., C, K or 1]  beta [..., C, 1]; masks: _doc_masks
    (doc, cont, last, carry) of packed documents, or NO_DOCS. Returns
      P [..., C, C], T_inv [..., C, C]           (see _chunk_matrices)
      WU [..., C, K+V] = T_inv @ [beta k exp(G), beta v] = [W, U]
      q_decayed [..., C, K] = q exp(G)           k_to_end [..., C, K] = k exp(G_last - G)
      state_decay [..., K or 1, 1] = exp(G_last)
    """
    doc, cont, last, carry = masks
    P, T_inv = _chunk_matrices(q, k, G, beta, doc)
    decay_from_start = _masked(torch.exp2(G), cont)               # exponent <= 0; 0 after a boundary
    XY = torch.cat([k * decay_from_start, v], dim=-1) * beta
    G_last = G[..., -1:, :]                                       # [..., 1, K or 1]
    k_to_end = _masked(k * torch.exp2(G_last - G), last)          # k_j decayed to the chunk end
    state_decay = _masked(torch.exp2(G_last), carry).transpose(-1, -2)
    return P, T_inv, T_inv @ XY, q * decay_from_start, k_to_end, state_decay


def _chunk_forward(q, k, v, G, beta, S0, masks=NO_DOCS):
    """The chunked recurrence on chunked float tensors (module docstring), differentiable by autograd.

    q (scaled), k [B,H,N,C,K]  v [B,H,N,C,V]  G [B,H,N,C,K or 1]  beta [B,H,N,C,1]  S0 [B,H,K,V].
    A chunk that starts from state S writes u = U - W S, so
        O      = q_decayed S + P u
        S_next = state_decay S + k_to_end^T u
    The loop over chunks carries S with two [C,K] @ [K,V]-sized matmuls per chunk; O's two come after it,
    for all chunks at once. Returns O [B,H,N,C,V], the states [B,H,N+1,K,V] (entry n: the state before
    chunk n; the last: the final state) and the chunk operators (_chunk_operators' tuple).
    """
    K = k.shape[-1]
    ops = _chunk_operators(q, k, v, G, beta, masks)
    P, _, WU, q_decayed, k_to_end, state_decay = ops
    W, U = WU[..., :K], WU[..., K:]
    k_to_end_t = k_to_end.transpose(-1, -2)                       # [B,H,N,K,C]
    states, writes = [S0], []
    for n in range(q.shape[2]):
        writes.append(U[:, :, n] - W[:, :, n] @ states[-1])       # u [B,H,C,V]
        states.append(state_decay[:, :, n] * states[-1] + k_to_end_t[:, :, n] @ writes[-1])
    S = torch.stack(states, dim=2)                                # [B,H,N+1,K,V]
    O = q_decayed @ S[:, :, :-1] + P @ torch.stack(writes, dim=2)  # [B,H,N,C,V]
    return O, S, ops


def _decayed_matmuls(M, a, b, G):
    """The two decayed products the backward of P and A needs, elementwise in the K channels:
        F[i] = sum_{j<i} M[i,j] exp(G_i - G_j) b_j        B[j] = sum_{i>j} M[i,j] exp(G_i - G_j) a_i
    M [..., C, C] (its strict lower triangle is read)  a, b [..., C, K]  G [..., C, K or 1]. Built by the same
    recursive halving as _chunk_matrices: the pairs (i in a high half, j in its low half) factor through
    the low half's last position r, with both exponents <= 0. A per-head gate (G [..., C, 1]) needs no halving:
    F = (M * decay) b and B = (M * decay)^T a with the [C, C] decay matrix."""
    C, K = b.shape[-2:]
    if G.shape[-1] == 1:                                          # per-head gate: one [C, C] decay matrix
        M = M * _pair_decay(G, strict=True)                       # M's strict lower triangle
        return M @ b, M.transpose(-1, -2) @ a
    F_, B_ = torch.zeros_like(b), torch.zeros_like(a)
    for L in _levels(C):
        h, n = L // 2, C // L
        halves = lambda x: x.reshape(*x.shape[:-2], n, 2, h, x.shape[-1]).unbind(-3)  # low, high: [..., n, h, D]
        G_low, G_high = halves(G)
        G_ref = G_low[..., h - 1:, :]                             # [..., n, 1, K or 1]
        to_ref, from_ref = (G_ref - G_low).exp2_(), (G_high - G_ref).exp2_()
        M21 = _diag_blocks(M, L)[..., h:, :h]                     # rows in the high half, columns in the low
        mm = _thin_matmul if h <= 2 else torch.matmul
        F_.view(*b.shape[:-2], n, 2, h, K)[..., 1, :, :].addcmul_(mm(M21, halves(b)[0] * to_ref), from_ref)
        B_.view(*a.shape[:-2], n, 2, h, K)[..., 0, :, :].addcmul_(mm(M21.transpose(-1, -2), halves(a)[1] * from_ref), to_ref)
        del to_ref, from_ref                                      # not alive while the next level allocates
    return F_, B_


def _thin_matmul(a, b):
    """a [..., m, h] @ b [..., h, n] for a tiny inner dimension h, as h broadcast outer products summed in
    place. For [h, h] @ [h, 64] with h <= 2 (the first levels of the halving) torch's CPU bmm runs its scalar
    loop for small products, about 4x slower than this."""
    out = a[..., :1] * b[..., :1, :]
    for i in range(1, a.shape[-1]):
        out.addcmul_(a[..., i:i + 1], b[..., i:i + 1, :])
    return out


def _chunk_backward(q, k, v, G, beta, S, dO, dS_final, masks=NO_DOCS, ops=None):
    """Gradients of _chunk_forward, by hand: take the chunk operators the forward made (ops) or
    recompute them from the inputs, run the recurrence backwards over chunks (du_n = P^T dO_n + k_to_end
    dS after chunk n, and dS before it = q_decayed^T dO_n + state_decay dS after it - W^T du_n), then push
    the gradients through the operators for all chunks at once.

    Shapes as _chunk_forward; S [B,H,N+1,K,V] its states; dO [B,H,N,C,V]; dS_final [B,H,K,V].
    Returns dq, dk [..,C,K], dv [..,C,V], dg [..,C,K or 1] (of the per-step log decays, not of G),
    dbeta [..,C,1], dS0 [B,H,K,V].
    """
    K = k.shape[-1]
    if ops is None:
        ops = _chunk_operators(q, k, v, G, beta, masks)
    P, T_inv, WU, q_decayed, k_to_end, state_decay = ops
    del ops
    doc, last = masks[0], masks[2]
    same_doc = 1.0 if doc is None else (doc == doc.transpose(-1, -2)).float()   # [..., C, C]
    W, U = WU[..., :K], WU[..., K:]
    S_start = S[:, :, :-1]                                        # [B,H,N,K,V]
    # backwards over chunks: du = P^T dO + k_to_end dS_after,
    # dS before the chunk = q_decayed^T dO + state_decay dS_after - W^T du
    from_out = q_decayed.transpose(-1, -2) @ dO                  # [B,H,N,K,V]
    du_out = P.transpose(-1, -2) @ dO                             # [B,H,N,C,V]
    dS_after, du = [dS_final], []                                 # dS_after[m]: grad of the state after chunk N-1-m
    for n in reversed(range(q.shape[2])):
        du.append(du_out[:, :, n] + k_to_end[:, :, n] @ dS_after[-1])
        dS_after.append(from_out[:, :, n] + state_decay[:, :, n] * dS_after[-1]
                        - W[:, :, n].transpose(-1, -2) @ du[-1])
    dS0 = dS_after.pop()
    dS_next = torch.stack(dS_after[::-1], dim=2)                  # [B,H,N,K,V]: grad of the state after chunk n
    du = torch.stack(du[::-1], dim=2)                             # [B,H,N,C,V]
    del from_out, du_out, dS_after, P                             # dels: what backward holds at its peak

    # through the chunk map (u = U - W S, O = q_decayed S + P u, S_next = state_decay S + k_to_end^T u)
    u = U - W @ S_start                                           # [B,H,N,C,V]
    dq_decayed = dO @ S_start.transpose(-1, -2)                   # [B,H,N,C,K]
    # dP and dA side by side for _decayed_matmuls, which reads only their strict lower triangles (dP's
    # diagonal is taken apart below)
    dPA = u.new_empty(2, *dO.shape[:-1], dO.shape[-2])            # [2, B,H,N,C,C]
    dP, dA = dPA.unbind(0)
    torch.matmul(dO, u.transpose(-1, -2), out=dP)
    dWU = torch.cat([du @ S_start.transpose(-1, -2), du], dim=-1)
    dWU[..., :K].neg_()                                           # dW = -du S^T
    dk_to_end = u @ dS_next.transpose(-1, -2)                     # [B,H,N,C,K]
    dG_last = (S_start * dS_next).sum(-1)[..., None, :] * state_decay.transpose(-1, -2)  # [B,H,N,1,K]
    del u, du, dS_next

    # through the operators
    dXY = T_inv.transpose(-1, -2) @ dWU                           # WU = T_inv XY
    del dWU, T_inv
    torch.matmul(dXY, WU.transpose(-1, -2), out=dA).neg_()        # T_inv = (I + A)^-1
    dPA = _masked(dPA, same_doc)
    del WU, W, U
    dX, dY = dXY[..., :K], dXY[..., K:]
    decay_from_start = _masked(torch.exp2(G), masks[1])
    dX_decayed = dX * decay_from_start
    k_terms_X = dX_decayed * beta
    dbeta = (dX_decayed * k).sum(-1, keepdim=True) + (dY * v).sum(-1, keepdim=True)
    dv = beta * dY
    del dXY, dX, dY, dX_decayed
    # the terms that do not go through P or A, summed now so that their parts are freed early (in place
    # where a temporary is not read again: fewer fresh buffers)
    dk = torch.addcmul(k_terms_X, dk_to_end, _masked((G[..., -1:, :] - G).exp2_(), last))
    dG = (q_decayed * dq_decayed).addcmul_(k, k_terms_X)
    dG[..., -1:, :] += dG_last
    dq = dq_decayed.mul_(decay_from_start)
    # k_j exp(G_last - G_j) depends on g_i for j < i <= last: its gradient reaches g_i as
    # sum_{j<i} to_end_j = sum_j to_end_j - sum_{j>=i} to_end_j, the second part a reversed cumsum like dG's
    to_end = dk_to_end.mul_(k_to_end)
    dG -= to_end
    to_end_total = to_end.sum(-2, keepdim=True)                   # [..., 1, K]
    del dq_decayed, decay_from_start, k_terms_X, q_decayed, dk_to_end, k_to_end, to_end
    # P[i,j] = (q_i exp(G_i - G_j)) . k_j  and  A[i,j] = beta_i (k_i exp(G_i - G_j)) . k_j, in one pass
    dP_diag = dPA[0].diagonal(dim1=-2, dim2=-1)[..., None].clone()  # P[i,i] = q_i . k_i: no decay (a copy: dPA is freed)
    del dP, dA
    (from_P, from_A), (to_P, to_A) = _decayed_matmuls(dPA, torch.stack([q, beta * k]), k.expand(2, *k.shape), G)
    del dPA
    dbeta = dbeta + (k * from_A).sum(-1, keepdim=True)
    beta_from_A = beta * from_A                                   # (fused in-place updates: fewer passes)
    dq.add_(from_P).addcmul_(dP_diag, k)                          # dq += from_P + dP_diag k
    dk.add_(to_P).add_(to_A).add_(beta_from_A).addcmul_(dP_diag, q)
    dG.addcmul_(q, from_P).addcmul_(k, beta_from_A.sub_(to_P).sub_(to_A))  # + k (beta from_A - to_P - to_A)
    dg = dG.flip(-2).cumsum(-2).flip(-2).add_(to_end_total)      # G = cumsum(g) within each chunk
    if G.shape[-1] == 1:                                          # per-head gate: G broadcast over K
        dg = dg.sum(-1, keepdim=True)
    return dq, dk, dv, dg, dbeta, dS0


class _ChunkedDeltaRule(torch.autograd.Function):
    """The chunked delta rule with the hand-written backward above. Both directions walk the sequence a few
    chunks at a time (forward in order, backward in reverse), so the temporaries are those of a few chunks,
    not of the whole sequence. What the forward saves depends on the length (KEEP_CHUNKS):
      - up to KEEP_CHUNKS chunks: the inputs, the chunk states [B,H,N+1,K,V], and each group's chunked
        inputs and chunk operators (P, T_inv, W|U, q_decayed, k_to_end, state_decay), so the backward
        recomputes nothing; both directions walk groups of GROUP_BACKWARD chunks;
      - longer: only the inputs and the chunk states; the backward recomputes each group's operators (the
        forward walks GROUP_FORWARD chunks a group, the backward GROUP_BACKWARD)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, scale, cu_seqlens, grad_enabled):
        B, T, H, K = q.shape
        states = [S0 if S0 is not None else q.new_zeros(B, H, K, v.shape[-1], dtype=_compute_dtype(q))]
        outs, kept, ctx.masks = [], [], []
        # (grad mode is off inside forward, and needs_input_grad ignores it: the caller passes it)
        keep = -(-T // CHUNK) <= KEEP_CHUNKS and grad_enabled and any(ctx.needs_input_grad[:6])
        for t0, t1 in _groups(T, GROUP_BACKWARD if keep else GROUP_FORWARD):
            *chunked, masks = _chunked_inputs(q, k, v, g, beta, scale, t0, t1, cu_seqlens)
            with torch.autocast(q.device.type, enabled=False):   # float32 also under autocast, as the backward
                O, S, ops = _chunk_forward(*chunked, states[-1], masks)
            outs.append(_from_chunks(O, t1 - t0))
            states += S[:, :, 1:].unbind(2)
            if keep:
                kept += [*chunked, *ops]
                ctx.masks.append(masks)
            del ops                                               # not kept: freed before the next group's
        S = torch.stack(states, dim=2)                            # [B,H,N+1,K,V]
        ctx.save_for_backward(q, k, v, g, beta, S, *kept)
        ctx.scale, ctx.has_S0, ctx.cu_seqlens = scale, S0 is not None, cu_seqlens
        return torch.cat(outs, dim=1).to(q.dtype), S[:, :, -1].clone()  # a copy: decode updates it in place

    @staticmethod
    def backward(ctx, do, dS_final):
        q, k, v, g, beta, S, *kept = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        grads = [S.new_empty(x.shape) for x in inputs]
        dS = torch.zeros_like(S[:, :, -1]) if dS_final is None else dS_final.to(S.dtype)
        groups = _groups(q.shape[1], GROUP_BACKWARD)
        n = len(kept) // len(groups)                              # kept: each group's 5 chunked inputs, 6 operators
        for i, (t0, t1) in reversed(list(enumerate(groups))):
            if kept:
                chunked, masks, ops = kept[n * i:n * i + 5], ctx.masks[i], kept[n * i + 5:n * (i + 1)]
            else:
                (*chunked, masks), ops = _chunked_inputs(q, k, v, g, beta, ctx.scale, t0, t1, ctx.cu_seqlens), None
            N, C = chunked[0].shape[2:4]
            n0 = t0 // C
            dO = _to_chunks(do[:, t0:t1], N * C, C).to(S.dtype)   # [B,H,N,C,V]
            dq, *group_grads, dS = _chunk_backward(*chunked, S[:, :, n0:n0 + N + 1], dO, dS, masks, ops)
            group_grads = [dq * ctx.scale, *group_grads]          # not item assignment: Dynamo 2.11 fails on it
            for grad, x, gr in zip(grads, inputs, group_grads):
                grad[:, t0:t1] = _from_chunks(gr, t1 - t0).reshape(grad[:, t0:t1].shape)
            del chunked, masks, ops, dO, group_grads              # before the next group allocates its own
        grads = [gr.to(x.dtype) for gr, x in zip(grads, inputs)]
        return (*grads, dS if ctx.has_S0 else None, None, None, None)


def _compute_dtype(x):
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _groups(T, group):
    """[(t0, t1)]: the time spans of the fewest groups of at most `group` chunks, their sizes as equal as the
    chunk count allows (4 chunks at most 3 a group: 2 + 2, not 3 + 1; at B=8 T=256 the op's forward + backward
    1.05x to 1.11x faster and its peak memory 1.27x lower, bench/bench_delta_rule.py --T 256 --B 8 --against)."""
    N = -(-T // CHUNK)
    n = -(-N // group)
    bounds = [i * N // n for i in range(n + 1)]                   # chunk index where each group starts
    return [(a * CHUNK, min(b * CHUNK, T)) for a, b in zip(bounds, bounds[1:])]


def _chunked_inputs(q, k, v, g, beta, scale, t0=0, t1=None, cu_seqlens=None):
    """[B,T,H,*] inputs, time steps t0 (a multiple of CHUNK) to t1 -> chunked float tensors: q * scale,
    k [B,H,N,C,K], v [B,H,N,C,V], G [B,H,N,C,K or 1] (cumulative log2 decay from each chunk start),
    beta [B,H,N,C,1], and the chunks' _doc_masks (NO_DOCS without cu_seqlens)."""
    C = CHUNK
    q, k, v, g, beta = (x[:, t0:t1] for x in (q, k, v, g, beta))
    T_pad = -(-q.shape[1] // C) * C                               # padded steps: g=0, beta=0, k=0
    G = _to_chunks(g, T_pad, C).cumsum(3) * LOG2E                # log2 units: every decay is an exp2
    masks = NO_DOCS
    if cu_seqlens is not None:  # this span's chunks of the masks over the whole (padded) sequence
        n0, N = t0 // C, T_pad // C
        doc, cont, last, carry = (m[n0:n0 + N] for m in _doc_masks(cu_seqlens, n0 * C + T_pad, C))
        masks = (doc.expand(q.shape[0], q.shape[2], N, C, 1), cont, last, carry)
    return (_to_chunks(q, T_pad, C) * scale, _to_chunks(k, T_pad, C), _to_chunks(v, T_pad, C),
            G if g.dim() == 4 else G[..., None], _to_chunks(beta, T_pad, C)[..., None], masks)


def delta_rule_torch(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None):
    """Chunked gated delta rule (see the module docstring for the math), with a hand-written backward.

    q, k [B,T,H,K]  v [B,T,H,V]  g [B,T,H,K] (per channel) or [B,T,H] (per head), g <= 0
    beta [B,T,H] in (0,1)  initial_state [B,H,K,V] (float32) or None.
    cu_seqlens: int64 [n_docs + 1] packed documents (B == 1, checked by the caller), or None.
    Returns (o [B,T,H,V] in q's dtype, final_state [B,H,K,V] float32 or None).
    Computes in float32 (float64 for float64 inputs).
    """
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"delta_rule: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"beta{tuple(beta.shape)} do not match")
    if g.shape not in (q.shape, q.shape[:3]):
        raise ValueError(f"delta_rule: g must be [B,T,H,K] or [B,T,H], got {tuple(g.shape)}")
    scale = K ** -0.5 if scale is None else scale
    if _OLD_TORCH and torch.compiler.is_compiling():
        raise RuntimeError(f"delta_rule: the torch backend under torch.compile needs torch >= 2.13 ({torch.__version__} "
                           f"computes its gradients wrongly there); train eagerly, or on CUDA with the triton backend")
    S0 = initial_state.to(_compute_dtype(q)) if initial_state is not None else None
    o, S = _ChunkedDeltaRule.apply(q, k, v, g, beta, S0, scale, cu_seqlens, torch.is_grad_enabled())
    return o, (S if output_final_state else None)


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
    Computes in float32 (float64 for float64 inputs), as delta_rule_torch. Per chunk: O = q S0 + tril(q k^T) v;
    the chunk-start states are a cumulative sum of k^T v.
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
    S0 = q.new_zeros(B, H, K, V, dtype=qc.dtype) if initial_state is None else initial_state.to(qc.dtype)
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
