"""Context parallelism: one sequence split over the N ranks of a context group (torch.distributed).

This module owns the layout of a split sequence and the distributed piece of every mixer; model.py
calls it when a forward gets `cp=ContextParallel(group)`; train.py builds the groups
(`train.context_parallel: N`).

Layout (one for the whole model): a row of T tokens is cut into 2N pieces of L = T / 2N tokens, and
rank r holds pieces r and 2N-1-r (an early and a late piece: the load-balanced causal split, every
rank has the same amount of causal attention work). `cp.split(rows [B, T])` gives the rank's tokens
as [2B, L]: the two pieces side by side in the batch (rows 0..B-1 piece r, rows B..2B-1 piece
2N-1-r). Everything per token (embedding, norms, MLP, loss) runs on that as on any batch; the mixers
read `cp.positions(...)` for the true positions and exchange what crosses pieces:

    global attention   K/V all-gathered (autograd: all-gather forward, reduce of the grads backward);
                       each piece attends to the keys up to its own end with the causal mask
    window attention   only the window-1 keys before each piece (its "halo") cross over
    short conv         the conv_size-1 inputs before each piece (a halo)
    MLA                the latent rows [c_kv | k_rope] are gathered; K/V expanded from them locally
    DSA                the indexer keys are gathered too; each piece picks its top-k among the keys
                       up to its own end (sparse stage and dense_warmup's indexer loss)
    delta rule (KDA, GDN) and linear attention: each piece runs from a zero state and also returns
                       the affine map it applies to an incoming state, S_out = M S_in + Z (one call:
                       the state's columns evolve independently, so v is widened by K zero columns
                       with the identity as their initial state); the (Z, M) pairs of all pieces are
                       all-gathered, a scan in piece order gives every piece's true initial state S_in,
                       and the outputs are corrected by S_in's contribution, o += S_in^T (M_t^T q_t)
                       (flash-linear-attention's ops/cp design, with an all-gather instead of a
                       send/recv chain). Linear attention: M = I, Z = sum k v^T.

Gradients: every rank's loss is its share of its group's mean loss: its own sum of the loss divided
by (the group's counted targets / N), so the N losses average to the group's mean (with equal counts:
each rank's own mean). Averaging the parameter gradients over all W = data x context ranks (plain
DDP over the world; the cross-piece gradients have already flowed back through the collectives)
then gives exactly the gradient of the mean over data ranks of the groups' mean losses, what DDP
gives without context parallelism. The collectives run on the context group, never on DDP's group.

Not supported (refused at config time, config.py): mixer kinds not in SUPPORTED, packed documents
(cu_seqlens), torch.compile; decode (generate) runs the whole sequence on one rank as before.
"""
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import kernels

BLOCK_Q = 128  # queries per checkpointed block of global attention on the torch path


class _AllGather(torch.autograd.Function):
    """x [*] on every rank -> [N, *] (rank order); backward: the grads summed over ranks, own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce autograd's buffer in place
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce_scatter
        return grad[ctx.rank], None


def all_gather(x, group):
    return _AllGather.apply(x, group)


SUPPORTED = ("attn", "mla", "kda", "gdn", "linear")   # mixer kinds with a distributed piece here


def unsupported(mcfg):
    """The first mixer kind of the model that context parallelism cannot run, or None."""
    for lc in mcfg.layer_configs():
        if lc.kind not in SUPPORTED:
            return lc.kind
    return None


def _blocks_checkpointed(attend, q, k, v):
    """attend(q, k, v) (queries ending at the last key) query block by query block, each block under
    activation checkpointing: autograd keeps q, k, v, not the [block, S] probabilities of the torch
    path's offset queries (recomputed block by block in backward), so the memory stays O(T)."""
    T, S = q.shape[1], k.shape[1]
    outs = []
    for t0 in range(0, T, BLOCK_Q):
        end = S - T + min(T, t0 + BLOCK_Q)
        outs.append(checkpoint(attend, q[:, t0:t0 + BLOCK_Q], k[:, :end], v[:, :end], use_reentrant=False))
    return torch.cat(outs, dim=1)


class ContextParallel:
    """The rank's place in a context group of N ranks, and the distributed op of every mixer."""

    def __init__(self, group=None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n_pieces = 2 * self.size
        self.pieces = (self.rank, self.n_pieces - 1 - self.rank)   # early, late

    # -- layout
    def split(self, rows):
        """rows [B, T, ...] (the full rows, the same on every rank of the group) -> [2B, T/2N, ...]."""
        T = rows.shape[1]
        if T % self.n_pieces:
            raise ValueError(f"context parallel: sequence length {T} is not divisible by 2N = {self.n_pieces}")
        chunks = rows.chunk(self.n_pieces, dim=1)
        return torch.cat([chunks[p] for p in self.pieces], dim=0)

    def piece_ranges(self, x):
        """(rows, start, end) of the rank's two pieces in x [2B, L, ...]: the rows of the batch that
        hold each piece and the positions start .. end-1 it covers."""
        B, L = x.shape[0] // 2, x.shape[1]
        return [(slice(h * B, (h + 1) * B), p * L, (p + 1) * L) for h, p in enumerate(self.pieces)]

    def positions(self, x):
        """Absolute positions [2B, L] of the rank's tokens x [2B, L, ...]."""
        B2, L = x.shape[:2]
        start = torch.tensor(self.pieces, device=x.device).repeat_interleave(B2 // 2) * L
        return start[:, None] + torch.arange(L, device=x.device)

    def _by_piece(self, x):
        """x [2B, L, ...] on every rank -> the list of all 2N pieces [B, L, ...] in sequence order."""
        g = all_gather(x, self.group)                              # [N, 2B, L, ...]
        B = x.shape[0] // 2
        out = [None] * self.n_pieces
        for r in range(self.size):
            out[r], out[self.n_pieces - 1 - r] = g[r, :B], g[r, B:]
        return out

    def gather(self, x):
        """The whole sequence [B, T, ...] in order, from every rank's x [2B, L, ...]."""
        return torch.cat(self._by_piece(x), dim=1)

    def halo(self, x, n):
        """The n rows before each of the rank's pieces: a list of two [B, min(n, start), ...]
        (shorter at the start of the sequence). Only the last min(n, L) rows of every piece travel."""
        B, L = x.shape[0] // 2, x.shape[1]
        if n == 0:
            return [x[:B, :0], x[B:, :0]]
        tails = self._by_piece(x[:, L - min(n, L):])
        need = -(-n // L)                                          # pieces reached back
        out = []
        for h, p in enumerate(self.pieces):
            prev = tails[max(0, p - need):p]
            out.append(torch.cat(prev, dim=1)[:, -n:] if prev else x[h * B:(h + 1) * B, :0])
        return out

    def halo_padded(self, x, n):
        """halo() left-padded with zeros to n rows, as one [2B, n, ...] tensor (the short conv's past)."""
        rows = []
        for h in self.halo(x, n):
            pad = h.new_zeros(h.shape[0], n - h.shape[1], *h.shape[2:])
            rows.append(torch.cat([pad, h], dim=1))
        return torch.cat(rows, dim=0)

    def tokens_per_rank(self, targets):
        """The counted targets (not -1) of the whole group / N: each rank's loss is its sum over this,
        so the ranks' losses average to the group's mean even where the counts differ."""
        n = (targets != -1).sum().float()
        dist.all_reduce(n, group=self.group)
        return n / self.size

    # -- mixers
    def attention(self, q, k, v, *, window=None, sinks=None, scale=None, backend=None, gathered=False):
        """Causal attention of the rank's queries q [2B, L, Hq, D] over keys k, v [2B, L, Hkv, D]
        (or, gathered=True, the whole sequence's [B, T, Hkv, D]). A window sends only halos."""
        B = q.shape[0] // 2
        if window is not None and not gathered:
            ks, vs = self.halo(k, window - 1), self.halo(v, window - 1)
            keys = [(torch.cat([ks[h], k[h * B:(h + 1) * B]], 1), torch.cat([vs[h], v[h * B:(h + 1) * B]], 1))
                    for h in range(2)]
        else:
            k_all, v_all = (k, v) if gathered else (self.gather(k), self.gather(v))
            keys = [(k_all[:, :end], v_all[:, :end]) for _, _, end in self.piece_ranges(q)]
        attend = partial(kernels.attention, window=window, sinks=sinks, scale=scale, backend=backend)
        if window is None and kernels._pick(backend, q) == "torch":
            attend = partial(_blocks_checkpointed, attend)
        return torch.cat([attend(q[h * B:(h + 1) * B], kh, vh) for h, (kh, vh) in enumerate(keys)], dim=0)

    def _initial_states(self, finals, V):
        """Scan over the 2N pieces: finals [2B, H, K, V + K] = (Z | M) of the rank's pieces ->
        the true initial state [2B, H, K, V] of each of them (S_out = M S_in + Z)."""
        S, starts = None, {}
        for p, f in enumerate(self._by_piece(finals)):
            if p > self.pieces[1]:
                break
            starts[p] = torch.zeros_like(f[..., :V]) if S is None else S
            S = f[..., :V] if S is None else f[..., V:] @ S + f[..., :V]
        return torch.cat([starts[p] for p in self.pieces], dim=0)

    def delta_rule(self, q, k, v, g, beta, *, scale=None, backend=None):
        """kernels.delta_rule over the whole sequence; q, k [2B, L, H, K], v [2B, L, H, V]."""
        B2, L, H, K = k.shape
        V = v.shape[-1]
        v_ext = torch.cat([v, v.new_zeros(B2, L, H, K)], dim=-1)               # columns of M ride along
        eye = torch.eye(K, device=q.device).expand(B2, H, K, K)
        s0 = torch.cat([torch.zeros(B2, H, K, V, device=q.device), eye], dim=-1)
        o_ext, final = kernels.delta_rule(q, k, v_ext, g, beta, scale=scale, initial_state=s0,
                                          output_final_state=True, backend=backend)
        S_in = self._initial_states(final, V)                                   # [2B, H, K, V]
        o0, mq = o_ext[..., :V], o_ext[..., V:]                                 # mq_t = M_t^T (scale q_t)
        return (o0.float() + torch.einsum("bthk,bhkv->bthv", mq.float(), S_in)).to(o0.dtype)

    def linear_attention(self, q, k, v, *, scale=None):
        """kernels.linear_attention over the whole sequence (M = I, Z = sum_t k_t v_t^T)."""
        Z = torch.einsum("bthk,bthv->bhkv", k.float(), v.float())
        S, starts = None, {}
        for p, z in enumerate(self._by_piece(Z)):
            starts[p] = torch.zeros_like(z) if S is None else S
            S = z if S is None else S + z
        S_in = torch.cat([starts[p] for p in self.pieces], dim=0)
        return kernels.linear_attention(q, k, v, scale=scale, initial_state=S_in)[0]


class SplitRows:
    """model(x, y) on full rows [B, T] -> (this rank's logits [2B, L, vocab], this rank's loss share),
    for loops that read only the loss (text eval): long rows are evaluated under CP too."""

    def __init__(self, model, cp):
        self.model, self.cp = model, cp

    def __call__(self, x, y):
        return self.model(self.cp.split(x), self.cp.split(y), cp=self.cp)
