"""KV policies for the global attention layers of the serving engine (SPEC 11, seed 004).

Owns which keys a global layer (`attn` without a window, dense `mla`: its latent rows are one-head
keys) keeps and reads. `full` is the engine's plain paged read; the others:

    streaming  StreamingLLM: n_sinks first tokens + the most recent budget - n_sinks; keys are
               re-rotated to their slot in the cache (positions never exceed the budget)
    h2o        heavy hitters: attention accumulated over every query so far (heads summed) + a recent
               window of budget / 2
    snapkv     at the end of the prompt an observation window (its last `obs` queries) votes, max-pooled
               over 7 neighbours, for the prompt keys to keep; later tokens are kept while recent
    quest      nothing evicted (paged as `full`); per page of block_size tokens a per-channel min / max
               key; each decode query reads only the budget / block_size pages with the best upper
               bound sum_d max(q_d min_d, q_d max_d) (per kv head; the newest page always)
    offload    quest's read over a pool that lives in a memory-mapped file (the slower tier); only the
               selected pages are read from it per decode step

The evicting policies (streaming, h2o, snapkv) keep each request's kept keys in its own dense rows
(at most `budget`, checked after every step once the prompt is in; a prefill chunk briefly adds its
own keys, and snapkv holds the whole prompt until its end). Their caches are bounded, so any prompt
length fits. The read with probabilities here (`attend_probs`) is the same masked softmax as
kernels.attention's torch path, returning the probabilities the policies score with.
"""
import math
import os
import tempfile

import torch
import torch.nn.functional as F

from model import MLA, Attention, apply_rope, rope_angles

EVICTING = ("streaming", "h2o", "snapkv")


def make_policy(name, budget, engine, n_sinks=4):
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"kv_budget must be an integer >= 1 for kv_policy {name} (got {budget!r})")
    if name == "streaming" and budget <= n_sinks:
        raise ValueError(f"kv_budget must be > {n_sinks} (the sink tokens) for kv_policy streaming (got {budget})")
    return (Evicting if name in EVICTING else PageSelect)(name, budget, engine, n_sinks)


def applies_to(mixer):
    """Global softmax attention layers: attn without a window, dense MLA (DSA already selects)."""
    return (isinstance(mixer, Attention) and mixer.cfg.window is None) or (isinstance(mixer, MLA) and mixer.indexer is None)


def attend_probs(q, k, v, qpos, kpos, scale, sinks=None):
    """q [T,Hq,D] k [S,Hkv,D] v [S,Hkv,Dv], absolute positions qpos [T], kpos [S] (causal on them)
    -> o [T,Hq,Dv], probabilities p [Hkv, G, T, S] (fp32)."""
    T, Hq, D = q.shape
    S, Hkv = k.shape[:2]
    G = Hq // Hkv
    qg = q.view(T, Hkv, G, D).permute(1, 2, 0, 3).float()                     # [Hkv, G, T, D]
    scores = torch.einsum("hgtd,shd->hgts", qg, k.float()) * scale
    scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    if sinks is None:
        p = scores.softmax(-1)
    else:
        sink = sinks.float().view(Hkv, G, 1, 1).expand(Hkv, G, T, 1)
        p = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    o = torch.einsum("hgts,shd->hgtd", p, v.float())                          # [Hkv, G, T, Dv]
    return o.permute(2, 0, 1, 3).reshape(T, Hq, -1).to(q.dtype), p


def layer_read(mixer):
    """(rope dims at the end of a key, rope theta, scale, sinks, value dims) of a global layer."""
    if isinstance(mixer, MLA):
        c = mixer.cfg
        return c.rope_dim, c.rope_theta, mixer.scale, None, c.kv_lora_rank
    c = mixer.cfg
    return (c.head_dim if c.rope else 0), c.rope_theta, c.head_dim ** -0.5, mixer.sinks, None


def rerotate(x, shift, rope_dims, theta):
    """Rotate the last rope_dims dims of x [N, H, D] (roped at some positions) by `shift` [N] more."""
    if not rope_dims:
        return x
    cos, sin = rope_angles(shift, rope_dims, theta)
    roped = apply_rope(x[None, :, :, x.shape[-1] - rope_dims:], cos, sin)[0]
    return torch.cat([x[..., :x.shape[-1] - rope_dims], roped], -1)


class Evicting:
    """streaming / h2o / snapkv: per request and layer, dense kept keys k [S,Hkv,D] (v [S,Hkv,Dv] or,
    for MLA, the first d_c dims of k), their absolute positions and scores."""
    bounded = True

    def __init__(self, name, budget, engine, n_sinks):
        self.name, self.budget, self.n_sinks, self.engine = name, budget, n_sinks, engine
        self.obs = max(1, min(16, budget // 4))                               # snapkv observation window
        self.peak_bytes = 0

    def applies(self, i):
        return applies_to(self.engine.model.blocks[i].mixer)

    def view(self, i, reqs, T):
        return EvictingView(self, i, reqs)

    def kept_bytes(self, reqs):
        return sum(t.numel() * t.element_size() for r in reqs for st in r.policy.values()
                   for t in (st["k"], st["v"]) if t is not None)

    def attend_row(self, mixer, r, layer, q, k, v, pos0):
        """One request: q [T,Hq,D], new k [T,Hkv,D], v [T,Hkv,Dv] or None (MLA) -> o [T,Hq,Dv]."""
        rope_dims, theta, scale, sinks, d_v = layer_read(mixer)
        T = q.shape[0]
        new_pos = torch.arange(pos0, pos0 + T)
        st = r.policy.setdefault(layer, {"k": k[:0], "v": None if v is None else v[:0], "pos": new_pos[:0],
                                         "score": torch.zeros(k.shape[1], 0)})
        k_all = torch.cat([st["k"], k])
        v_all = k_all[..., :d_v] if v is None else torch.cat([st["v"], v])
        kpos = torch.cat([st["pos"], new_pos])
        keys, qq = k_all, q
        if self.name == "streaming":  # positions inside the cache: slot j, queries at their own slots
            slots = torch.arange(len(kpos))
            keys = rerotate(k_all, slots - kpos, rope_dims, theta)
            qq = rerotate(q, slots[-T:] - new_pos, rope_dims, theta)
            o, p = attend_probs(qq, keys, v_all, slots[-T:], slots, scale, sinks)
        else:
            o, p = attend_probs(qq, keys, v_all, new_pos, kpos, scale, sinks)
        score = torch.cat([st["score"], torch.zeros(k.shape[1], T)], 1)
        if self.name == "h2o":
            score = score + p.sum((1, 2))                                       # [Hkv, S]
        P = len(r.prompt)
        if self.name == "snapkv" and pos0 + T == P:  # the prompt is in: the observation window votes
            n_obs = min(self.obs, P)
            votes = p[:, :, T - min(n_obs, T):].sum((0, 1, 2))                 # [S]
            votes = F.max_pool1d(votes[None, None], 7, stride=1, padding=3)[0, 0]
            score = votes.expand_as(score).clone()
        keep = self.keep(kpos, score.sum(0), P, pos0 + T)
        st.update(k=k_all[keep], v=None if v is None else v_all[keep], pos=kpos[keep], score=score[:, keep])
        return o

    def keep(self, kpos, score, P, n_seen):
        """Indices (in order) of the keys to keep after a step; all of them while within budget."""
        S, B = len(kpos), self.budget
        if S <= B or (self.name == "snapkv" and n_seen < P):
            return torch.arange(S)
        if self.name == "streaming":
            return torch.cat([torch.arange(self.n_sinks), torch.arange(S - (B - self.n_sinks), S)])
        recent = B // 2 if self.name == "h2o" else min(self.obs, B)
        old = score[:S - recent].clone()
        if self.name == "snapkv":  # tokens after the prompt that left the recent window go first
            old = old.masked_fill(kpos[:S - recent] >= P, -1.0)
        top = old.topk(B - recent).indices.sort().values
        return torch.cat([top, torch.arange(S - recent, S)])


class EvictingView:
    def __init__(self, policy, layer, reqs):
        self.policy, self.layer, self.reqs = policy, layer, reqs

    def _rows(self, mixer, q, k, v):
        out = [self.policy.attend_row(mixer, r, self.layer, q[b], k[b], None if v is None else v[b], r.n_done)
               for b, r in enumerate(self.reqs)]
        self.policy.peak_bytes = max(self.policy.peak_bytes, self.policy.kept_bytes(self.policy.engine.running))
        return torch.stack(out)

    def attend(self, mixer, q, k, v):
        return self._rows(mixer, q, k, v)

    def attend_latent(self, mixer, q_lat, latent, iq, iw, ik):
        return self._rows(mixer, q_lat, latent[:, :, None], None)


class PageSelect:
    """quest / offload: the engine's paged storage (offload: memory-mapped), decode reads top pages."""
    bounded = False

    def __init__(self, name, budget, engine, n_sinks):
        self.name, self.engine = name, engine
        self.n_pages = max(1, budget // engine.bs)
        self.pages_read = 0                                                     # pages brought in (decode)
        self.dir = tempfile.mkdtemp(prefix="kv_offload_") if name == "offload" else None

    def applies(self, i):
        return applies_to(self.engine.model.blocks[i].mixer)

    def storage(self, shape, dtype, name):
        """A pool tensor; for offload backed by a file (torch.from_file, shared: writes reach the file)."""
        if self.dir is None:
            return torch.zeros(shape, dtype=dtype)
        path = os.path.join(self.dir, f"{name}.bin")
        n = math.prod(shape)
        with open(path, "wb") as f:
            f.truncate(n * torch.empty((), dtype=dtype).element_size())
        return torch.from_file(path, shared=True, size=n, dtype=dtype).view(shape)

    def note_keys(self, view, k):
        """Fold the new keys k [B,T,Hkv,D] into their pages' min / max (a page's first key resets it)."""
        store, b = view.store, view.batch
        new = k.reshape(-1, *k.shape[2:])[b.write_src].to(store["kmin"].dtype)   # [n, Hkv, D]
        blocks, first = b.write_idx // self.engine.bs, b.write_idx % self.engine.bs == 0
        big = torch.finfo(store["kmin"].dtype).max
        store["kmin"][blocks[first]], store["kmax"][blocks[first]] = big, -big
        index = blocks.view(-1, 1, 1).expand_as(new)
        store["kmin"].scatter_reduce_(0, index, new, "amin")
        store["kmax"].scatter_reduce_(0, index, new, "amax")

    def read(self, view, mixer, q, kname, d_v):
        """Decode q [B,1,Hq,Dk] over the top pages of each row, per kv head -> o [B,1,Hq,Dv]."""
        _, _, scale, sinks, _ = layer_read(mixer)
        k_pool = view.store[kname]
        table, lens = view.batch.table, view.batch.seq_lens
        B, _, Hq, Dk = q.shape
        bs, Hkv = k_pool.shape[1], k_pool.shape[2]
        G, nb = Hq // Hkv, table.shape[1]
        kmin, kmax = view.store["kmin"][table].float(), view.store["kmax"][table].float()   # [B, nb, Hkv, Dk]
        qg = q[:, 0].view(B, Hkv, G, Dk).float()
        ub = torch.maximum(torch.einsum("bhgd,bnhd->bhgnd", qg, kmin), torch.einsum("bhgd,bnhd->bhgnd", qg, kmax))
        ub = ub.sum((2, 4))                                                    # [B, Hkv, nb]
        n_pages = (lens + bs - 1) // bs
        page = torch.arange(nb)
        ub = ub.masked_fill(page[None, None] >= n_pages[:, None, None], -math.inf)
        ub = ub.masked_fill(page[None, None] == (n_pages - 1)[:, None, None], math.inf)   # the newest page
        sel = ub.topk(min(self.n_pages, nb), -1).indices                      # [B, Hkv, n]
        self.pages_read += int((sel < n_pages[:, None, None]).sum())
        blocks = table.gather(1, sel.view(B, -1)).view(sel.shape)             # [B, Hkv, n]
        head = torch.arange(Hkv).view(1, Hkv, 1)
        k = k_pool[blocks, :, head].float()                                    # [B, Hkv, n, bs, Dk]: only these pages
        v = k[..., :d_v] if d_v is not None else view.store["v"][blocks, :, head].float()
        pos = sel[..., None] * bs + torch.arange(bs)                           # [B, Hkv, n, bs]
        scores = torch.einsum("bhgd,bhnsd->bhgns", qg, k) * scale
        scores = scores.masked_fill((pos >= lens[:, None, None, None])[:, :, None], -math.inf)
        scores = scores.flatten(3)                                             # [B, Hkv, G, n*bs]
        if sinks is None:
            p = scores.softmax(-1)
        else:
            p = torch.cat([scores, sinks.float().view(1, Hkv, G, 1).expand(B, Hkv, G, 1)], -1).softmax(-1)[..., :-1]
        o = torch.einsum("bhgs,bhsd->bhgd", p, v.flatten(2, 3))
        return o.reshape(B, 1, Hq, -1).to(q.dtype)
