"""Sparse attention, pure PyTorch: the reference and CPU paths of the sparse ops (SPEC 3, 5).

    sparse_mla_attention   DSA: each query attends its own top-k latent rows (absorbed MLA form)
    block_sparse_attention NSA selection: each query attends the key blocks its GQA group selected
    index_scores, topk_select, index_topk   the DSA lightning indexer's scores and top-k choice

A query t of T sits at absolute position S - T + t and never sees a key after it. Both attention
ops gather the selected keys query block by query block, so memory is O(T * selected keys), never
T x S; a row with no visible key outputs 0 (and its inputs get zero gradient).
"""
import torch

BLOCK_Q = 64  # queries per block: the gathered keys of a block are [B, BLOCK_Q, selected, D]


def _masked_softmax(att, valid):
    """Softmax over the last dim restricted to `valid`; fully masked rows give p = 0, lse = -inf.

    att fp32 [..., n], valid bool broadcastable to att. Returns (p, lse [...]); lse carries no grad."""
    att = att.masked_fill(~valid, float("-inf"))
    empty = ~valid.any(-1, keepdim=True)
    att = att.masked_fill(empty, 0.0)                       # no -inf - -inf in an empty row
    p = att.softmax(-1).masked_fill(~valid, 0.0)
    lse = torch.logsumexp(att.detach(), -1).masked_fill(empty[..., 0], float("-inf"))
    return p, lse


def sparse_mla_attention_torch(q, kv, indices, *, d_v, scale):
    """q [B,T,H,Dk]  kv [B,S,Dk]  indices [B,T,k] int64  ->  o [B,T,H,d_v] (q's dtype), lse [B,T,H] fp32.

    Keys are kv rows, values their first d_v dims; entries < 0 or > the query's position are padding."""
    B, T, H, Dk = q.shape
    S = kv.shape[1]
    b = torch.arange(B, device=q.device)[:, None, None]
    outs, lses = [], []
    for t0 in range(0, T, BLOCK_Q):
        t1 = min(T, t0 + BLOCK_Q)
        qpos = torch.arange(S - T + t0, S - T + t1, device=q.device)
        idx = indices[:, t0:t1]                                                # [B, Tb, k]
        valid = (idx >= 0) & (idx <= qpos[None, :, None])
        rows = kv[b, idx.clamp(0, S - 1)].float()                              # [B, Tb, k, Dk]
        att = torch.einsum("bthd,btkd->bthk", q[:, t0:t1].float(), rows) * scale
        p, lse = _masked_softmax(att, valid[:, :, None])                       # [B, Tb, H, k]
        outs.append(torch.einsum("bthk,btkc->bthc", p, rows[..., :d_v]))
        lses.append(lse)
    return torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 1)


def block_sparse_attention_torch(q, k, v, block_indices, block_size, *, scale):
    """q [B,T,Hq,D]  k [B,S,Hkv,D]  v [B,S,Hkv,Dv]  block_indices [B,T,Hkv,n] (-1 = unused) -> [B,T,Hq,Dv].

    Query head h reads kv head h // (Hq // Hkv) and that kv head's selected blocks."""
    B, T, Hq, D = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(Hkv, device=q.device).view(1, 1, Hkv, 1)
    within = torch.arange(block_size, device=q.device)
    outs = []
    for t0 in range(0, T, BLOCK_Q):
        t1 = min(T, t0 + BLOCK_Q)
        qpos = torch.arange(S - T + t0, S - T + t1, device=q.device).view(1, -1, 1, 1)
        blk = block_indices[:, t0:t1]                                          # [B, Tb, Hkv, n]
        pos = (blk[..., None] * block_size + within).flatten(-2)              # [B, Tb, Hkv, n * bs]
        valid = (blk >= 0).repeat_interleave(block_size, -1) & (pos <= qpos) & (pos < S)
        pos = pos.clamp(0, S - 1)
        ks, vs = k[b, pos, h].float(), v[b, pos, h].float()                   # [B, Tb, Hkv, L, D|Dv]
        qg = q[:, t0:t1].float().view(B, t1 - t0, Hkv, G, D)
        att = torch.einsum("bthgd,bthld->bthgl", qg, ks) * scale
        p, _ = _masked_softmax(att, valid[:, :, :, None])                     # [B, Tb, Hkv, G, L]
        outs.append(torch.einsum("bthgl,bthld->bthgd", p, vs).reshape(B, t1 - t0, Hq, Dv))
    return torch.cat(outs, 1).to(q.dtype)


# ------------------------------------------------------------------ the DSA lightning indexer

def index_scores(iq, iw, ik):
    """I[b,t,s] = sum_h w[b,t,h] * ReLU(q^I[b,t,h] . k^I[b,s]) * d_I**-0.5, for every s (no mask).

    iq [B, T, H_I, d_I]  iw [B, T, H_I] (already * H_I**-0.5)  ik [B, S, d_I]  ->  [B, T, S] fp32
    Always fp32, also under autocast (the selection compares exact fp32 bits)."""
    with torch.autocast(iq.device.type, enabled=False):
        dots = torch.einsum("bthd,bsd->bths", iq.float(), ik.float()).relu()   # [B, T, H_I, S]
        return torch.einsum("bths,bth->bts", dots, iw.float()) * iq.shape[-1] ** -0.5


def topk_select(scores, qpos, k):
    """Indices [B, T, k] of the k best keys per query among s <= qpos[t]; scores [B, T, S] fp32.

    Deterministic: the order is lexicographic on (score, position), so an exact tie (common: ReLU
    zeros) goes to the most recent key, the same in the parallel path and in decode. Scores are
    mapped to order-preserving integers and packed with the position into one int64 key, so the
    top-k never depends on how torch.topk breaks ties. Keys after a query get score -inf and are
    only picked when a query sees fewer than k keys; the caller masks them (sel > qpos)."""
    S = scores.shape[-1]
    kpos = torch.arange(S, device=scores.device)
    scores = scores.float().masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf")) + 0.0
    bits = scores.contiguous().view(torch.int32)               # (+ 0.0 above: -0 -> +0)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)                   # negative floats: flip magnitude bits
    return torch.topk(key.long() * 2 ** 32 + kpos, k, dim=-1).indices  # (score, position) packed


def index_topk_torch(iq, iw, ik, k):
    """The k best visible keys of each query (query t at position S - T + t), block by block, each
    block scoring only the keys its last query sees: memory O(BLOCK_Q * S). Returns [B, T, k] int64
    sorted best first; entries < 0 or > the query's position are padding (it sees fewer than k keys)."""
    B, T, S = iq.shape[0], iq.shape[1], ik.shape[1]
    out = []
    for t0 in range(0, T, BLOCK_Q):
        t1 = min(T, t0 + BLOCK_Q)
        hi = S - T + t1                                                        # keys this block may see
        qpos = torch.arange(S - T + t0, hi, device=iq.device)
        sel = topk_select(index_scores(iq[:, t0:t1], iw[:, t0:t1], ik[:, :hi]), qpos, min(k, hi))
        out.append(torch.cat([sel, sel.new_full((B, t1 - t0, k - sel.shape[-1]), -1)], -1))
    return torch.cat(out, 1)
