"""Serving engine: many requests decoded together over paged caches (SPEC 11).

Owns: requests and their scheduling (continuous batching: a finished request frees its place and a
waiting one joins; chunked prefill: `prefill_chunk` prompt tokens per iteration, interleaved with one
decode step of every running request), the block pools (global and windowed attention K/V, MLA latent
rows, DSA indexer keys, MFA's one key and one value head) with a block table per request, refcounted
prefix sharing and copy-on-write, the freeing of blocks that left a window, the fixed-size state slots
of delta-rule layers, the per-request slot caches of NSA layers, and the KV policies of global
attention layers (kv_policies.py).

The mixers' own code computes every projection. The engine hands each layer a cache view: paged
layers get a `PagedView` whose `attend` / `attend_latent` (the hooks in model.py) write the new rows
into the blocks and read them back through kernels.paged_attention; delta-rule layers get the rows
of their requests' state slots, written back after the forward. MFA layers page their roped key and
their value (MFA-KR: the un-roped key, so two rows a token here against one in its own cache). NSA
layers keep their own contiguous caches (model.new_cache) for max_batch requests, one row a slot;
the engine runs such a mixer one request at a time on a LayerCache of views into its slot's row
(`RowSlots`).

    engine = Engine(model, max_batch=16, prefill_chunk=64, block_size=16)
    done = engine.run([Request(prompt_ids, max_new_tokens=50, temperature=0), ...])
    done[0].out  # the generated token ids
"""
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

import kernels
from model import MFA, MLA, NSA, Attention, DeltaNet, LayerCache, sample_token

SUPPORTED = ("attn", "mla", "kda", "gdn", "linear", "nsa", "mfa")
KV_POLICIES = ("full", "streaming", "h2o", "snapkv", "quest", "offload")


class EngineError(ValueError):
    """A request or setting the engine cannot serve; the message is one line."""


@dataclass
class Request:
    prompt: list                        # token ids
    max_new_tokens: int
    temperature: float = 0.0            # 0 = greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    rid: object = None                  # a name for messages (the CLI uses the line number)
    force: Optional[list] = None        # teacher forcing (evals): emit these tokens instead of sampling
    # filled in by the engine
    out: list = field(default_factory=list)       # generated ids
    logits: list = field(default_factory=list)    # [vocab] per generated token (keep_logits=True)
    error: Optional[str] = None
    n_done: int = 0                     # tokens whose keys / state are in the cache
    n_shared: int = 0                   # prompt tokens found in shared blocks (never rewritten)
    tables: dict = field(default_factory=dict)    # group -> [block id or -1 (freed)]
    slot: int = -1                      # delta-rule state slot
    policy: dict = field(default_factory=dict)    # layer -> KV policy state (kv_policies.py)

    @property
    def tokens(self):
        return self.prompt + self.out

    @property
    def done(self):
        return len(self.out) >= self.max_new_tokens


class BlockPool:
    """`n_blocks` blocks of `block_size` tokens with refcounts. A block whose count falls to 0 returns
    to the free list. `prefix` maps a prompt prefix (a tuple of ids) to the live block that holds its
    last tokens, so equal prompt prefixes share blocks."""

    def __init__(self, n_blocks, block_size):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref = [0] * n_blocks
        self.free = list(range(n_blocks - 1, -1, -1))
        self.prefix, self.key = {}, {}
        self.peak = self.allocs = self.shares = self.copies = 0   # counters for reports and tests

    def used(self):
        return self.n_blocks - len(self.free)

    def alloc(self):
        if not self.free:
            raise EngineError(f"the block pool ({self.n_blocks} blocks) is exhausted")
        b = self.free.pop()
        self.ref[b], self.allocs = 1, self.allocs + 1
        self.peak = max(self.peak, self.used())
        return b

    def share(self, b):
        self.ref[b], self.shares = self.ref[b] + 1, self.shares + 1

    def release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)
            key = self.key.pop(b, None)
            if key is not None:
                del self.prefix[key]

    def register(self, key, b):
        if key not in self.prefix and b not in self.key:
            self.prefix[key], self.key[b] = b, key


class Group:
    """Paged layers that share one block table per request: the same window (None = global)."""

    def __init__(self, window):
        self.window, self.layers, self.pool = window, [], None
        self.store = {}                  # layer -> {name: tensor [n_blocks, block_size, heads, dim]}

    def worst_blocks(self, n_tokens, bs, chunk):
        """Blocks a request of n_tokens holds at most at once."""
        live = n_tokens if self.window is None else min(n_tokens, self.window + chunk + bs)
        return math.ceil(live / bs) + 1


# ----------------------------------------------------------------------------------------------
# What a layer sees as its cache during one forward


class Batch:
    """The block tables of one forward's requests in one group, as tensors.

    table [B, nb] (freed / missing entries -> block 0, never read), seq_lens [B] (keys after the
    forward), write_idx / write_src: flat pool rows to write and the rows of the new [B*T] tokens that
    go there (tokens of shared prompt blocks are skipped: the block already holds them)."""

    def __init__(self, reqs, T, bs, group):
        nb = max(len(r.tables[group]) for r in reqs)
        self.table = torch.tensor([[max(b, 0) for b in r.tables[group]] + [0] * (nb - len(r.tables[group]))
                                   for r in reqs], dtype=torch.long)
        self.seq_lens = torch.tensor([r.n_done + T for r in reqs])
        idx, src = [], []
        for i, r in enumerate(reqs):
            shared = r.n_shared if group is None else 0   # only the global group shares blocks
            for t in range(T):
                p = r.n_done + t
                if p >= shared:
                    idx.append(r.tables[group][p // bs] * bs + p % bs)
                    src.append(i * T + t)
        self.write_idx, self.write_src = torch.tensor(idx, dtype=torch.long), torch.tensor(src, dtype=torch.long)


class PagedView:
    """The paged cache of one attention or MLA layer for one forward (the `attend` hooks of model.py)."""

    def __init__(self, store, batch, policy=None):
        self.store, self.batch, self.policy = store, batch, policy

    def write(self, name, new):
        """new [B, T, ...] -> the pool rows of the batch's tokens."""
        pool = self.store[name]
        flat = pool.view(-1, *pool.shape[2:])
        flat[self.batch.write_idx] = new.reshape(-1, *pool.shape[2:])[self.batch.write_src].to(pool.dtype)

    def attend(self, mixer, q, k, v):
        """Attention (and MFA: one kv head): q [B,T,Hq,D] (roped), new k, v [B,T,Hkv,D] -> o [B,T,Hq,D]."""
        self.write("k", k)
        self.write("v", v)
        if self.policy is not None:  # quest / offload: page bounds; a decode step reads the top pages
            self.policy.note_keys(self, k)
            if q.shape[1] == 1:
                return self.policy.read(self, mixer, q, "k", None)
        return kernels.paged_attention(q, self.store["k"], self.store["v"], self.batch.table, self.batch.seq_lens,
                                       window=getattr(mixer.cfg, "window", None), sinks=getattr(mixer, "sinks", None),
                                       backend=mixer.backend)

    def attend_latent(self, mixer, q_lat, latent, iq, iw, ik):
        """MLA absorbed: q_lat [B,T,H,d_c+d_rope], new rows latent [B,T,d_c+d_rope] (+ DSA iq, iw, ik)."""
        d_c = mixer.cfg.kv_lora_rank
        self.write("kv", latent[:, :, None])
        if self.policy is not None:
            self.policy.note_keys(self, latent[:, :, None])
            if q_lat.shape[1] == 1:
                return self.policy.read(self, mixer, q_lat, "kv", d_c)
        if iq is None:  # dense: MQA over the latent rows, values = their c_kv part
            kv = self.store["kv"]
            return kernels.paged_attention(q_lat, kv, kv[..., :d_c], self.batch.table, self.batch.seq_lens,
                                           scale=mixer.scale, backend=mixer.backend)
        self.write("ik", ik[:, :, None])
        outs, T = [], q_lat.shape[1]
        for b in range(q_lat.shape[0]):  # DSA: the mixer's own top-k attention on this row's rows
            rows, keys = self.rows("kv", b), self.rows("ik", b)
            o, _ = mixer._sparse_attention(q_lat[b:b + 1], rows, iq[b:b + 1], iw[b:b + 1], keys,
                                           rows.shape[1] - T, False)
            outs.append(o)
        return torch.cat(outs)

    def rows(self, name, b):
        """Row b's cached entries in order, dense: [1, seq_len, dim] (one-head pools)."""
        pool = self.store[name]
        n = int(self.batch.seq_lens[b])
        return pool[self.batch.table[b]].reshape(-1, pool.shape[-1])[:n][None]


class SlotView:
    """A delta-rule layer's cache for one forward: its requests' state slots, written back by commit."""

    def __init__(self, store, slots):
        self.store, self.slots = store, slots
        self.state, self.conv = store["state"][slots], store["conv"][slots]

    def commit(self):
        self.store["state"][self.slots] = self.state
        self.store["conv"][self.slots] = self.conv


class RowSlots:
    """An NSA layer's cache for one forward: row b is a LayerCache of views into the slot of
    request b in the layer's own contiguous cache, so the mixer's in-place writes land in the slot."""

    def __init__(self, store, slots):
        self.store, self.slots = store, slots

    def row(self, b):
        s = self.slots[b]
        return LayerCache(**{name: t[s:s + 1] for name, t in self.store.items()})


def run_block(block, x, view, pos):
    """block(x, view, pos), but an NSA mixer (one position per call) runs request by request."""
    if not isinstance(view, RowSlots):
        return block(x, view, pos)
    h = block.norm1(x)
    x = x + torch.cat([block.mixer(h[b:b + 1], view.row(b), int(pos[b])) for b in range(x.shape[0])])
    return x + block.mlp(block.norm2(x))


# ----------------------------------------------------------------------------------------------
# The engine


class Engine:
    def __init__(self, model, max_batch=8, prefill_chunk=256, block_size=16, num_blocks=None, max_len=None,
                 kv_policy="full", kv_budget=None, prefix_sharing=True, keep_logits=False, seed=0):
        for name, value in [("max_batch", max_batch), ("prefill_chunk", prefill_chunk), ("block_size", block_size)]:
            if not isinstance(value, int) or value < 1:
                raise EngineError(f"{name} must be an integer >= 1 (got {value!r})")
        if kv_policy not in KV_POLICIES:
            raise EngineError(f"kv_policy must be one of {', '.join(KV_POLICIES)} (got {kv_policy!r})")
        self.model, self.max_batch, self.chunk, self.bs = model, max_batch, prefill_chunk, block_size
        self.num_blocks, self.max_len, self.prefix_sharing, self.keep_logits = num_blocks, max_len, prefix_sharing, keep_logits
        self.kv_policy, self.kv_budget = kv_policy, kv_budget
        self.generator = torch.Generator(device=model.wte.weight.device).manual_seed(seed)
        self.policy = None
        if kv_policy != "full":
            from kv_policies import applies_to, make_policy
            if not any(applies_to(b.mixer) for b in model.blocks):  # the policy would change nothing
                kinds = ", ".join(dict.fromkeys(getattr(b.mixer.cfg, "kind", "?") for b in model.blocks))
                raise EngineError(f"kv_policy {kv_policy}: this model has no global attention layer (attn without a "
                                  f"window, dense mla) for it to apply to (its layers: {kinds}); its caches are "
                                  f"already bounded or selected: serve it with kv_policy full")
            try:
                self.policy = make_policy(kv_policy, kv_budget, self)
            except ValueError as e:
                raise EngineError(str(e)) from None
        self.groups, self.group_of, self.delta, self.rows, self.evicting = {}, {}, [], [], set()
        for i, block in enumerate(model.blocks):
            m = block.mixer
            kind = getattr(m.cfg, "kind", type(m).__name__)
            if kind not in SUPPORTED or not isinstance(m, (Attention, MLA, DeltaNet, NSA, MFA)):
                raise EngineError(f"layer {i}: mixer kind {kind!r} is not supported by the serving engine "
                                  f"(supported: {', '.join(SUPPORTED)})")
            if isinstance(m, DeltaNet):
                self.delta.append(i)
            elif isinstance(m, NSA):
                self.rows.append(i)
            elif self.policy is not None and self.policy.bounded and self.policy.applies(i):
                self.evicting.add(i)                 # kept keys live in the policy's own rows
            else:
                window = m.cfg.window if isinstance(m, Attention) else None
                self.groups.setdefault(window, Group(window)).layers.append(i)
                self.group_of[i] = window
        # compute can skip a shared prefix only when every layer reads it from shared blocks
        self.skip_shared = not self.delta and not self.rows and list(self.groups) == [None] and self.policy is None

    # -- requests ------------------------------------------------------------------------------
    def check(self, r):
        """The reason request r cannot be served, or None."""
        V = self.model.config.vocab_size
        if not r.prompt:
            return "empty prompt"
        if min(r.prompt) < 0 or max(r.prompt) >= V:
            return f"token outside the vocabulary (0..{V - 1})"
        if r.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1 (got {r.max_new_tokens})"
        n = len(r.prompt) + r.max_new_tokens
        bounded = self.policy is not None and self.policy.bounded
        if self.max_len is not None and n > self.max_len and not bounded:
            return (f"prompt {len(r.prompt)} + max_new_tokens {r.max_new_tokens} = {n} tokens exceeds the cache "
                    f"({self.max_len} tokens) under kv_policy {self.kv_policy}")
        return None

    def _setup(self, reqs):
        """Pools sized for max_batch requests of the longest context (or num_blocks per group)."""
        p = self.model.wte.weight
        longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
        for g in self.groups.values():
            n = self.num_blocks or self.max_batch * (g.worst_blocks(longest, self.bs, self.chunk) + 1)
            g.pool = BlockPool(n, self.bs)
            for i in g.layers:
                m = self.model.blocks[i].mixer
                paged = self.policy.storage if self.policy is not None and self.policy.applies(i) else None
                new = (lambda shape, name: p.new_zeros(shape)) if paged is None else \
                    (lambda shape, name: paged(shape, p.dtype, f"layer{i}_{name}"))
                if isinstance(m, (Attention, MFA)):
                    shape = (n, self.bs, getattr(m.cfg, "n_kv_heads", 1), m.cfg.head_dim)
                    g.store[i] = {"k": new(shape, "k"), "v": new(shape, "v")}
                else:
                    g.store[i] = {"kv": new((n, self.bs, 1, m.cfg.kv_lora_rank + m.cfg.rope_dim), "kv")}
                    if m.indexer is not None:
                        g.store[i]["ik"] = p.new_zeros(n, self.bs, 1, m.cfg.dsa.head_dim)
                if paged is not None:  # quest / offload: per-page min / max keys, in fast memory
                    key = g.store[i]["k" if isinstance(m, Attention) else "kv"]
                    g.store[i]["kmin"] = p.new_zeros(n, *key.shape[2:])
                    g.store[i]["kmax"] = p.new_zeros(n, *key.shape[2:])
        self.slot_store = {}
        for i in self.delta:
            c = self.model.blocks[i].mixer.new_cache(self.max_batch, 1, p.device, p.dtype)
            self.slot_store[i] = {"state": c.state, "conv": c.conv}
        self.row_store = {}
        for i in self.rows:  # NSA: the mixer's own caches, one row per slot, for the longest request
            c = self.model.blocks[i].mixer.new_cache(self.max_batch, longest, p.device, p.dtype)
            self.row_store[i] = {name: t for name, t in vars(c).items() if torch.is_tensor(t)}
        self.free_slots = list(range(self.max_batch - 1, -1, -1))

    def _fits(self, r):
        """Admission control: the pools can hold r's worst case next to the running requests'."""
        for key, g in self.groups.items():
            need = g.worst_blocks(len(r.prompt) + r.max_new_tokens, self.bs, self.chunk)
            held = sum(max(0, self.reserved[id(x)][key] - len(x.tables[key])) for x in self.running)
            if need > len(g.pool.free) - held:
                return False
        return True

    def _admit(self, r):
        r.slot = self.free_slots.pop()
        for store in [*self.slot_store.values(), *self.row_store.values()]:
            for t in store.values():
                t[r.slot].zero_()
        r.tables = {key: [] for key in self.groups}
        self.reserved[id(r)] = {key: g.worst_blocks(len(r.prompt) + r.max_new_tokens, self.bs, self.chunk)
                                for key, g in self.groups.items()}
        self.running.append(r)

    def _release(self, r):
        for key, g in self.groups.items():
            for b in r.tables[key]:
                if b >= 0:
                    g.pool.release(b)
            r.tables[key] = []
        self.free_slots.append(r.slot)
        self.running.remove(r)
        del self.reserved[id(r)]

    # -- blocks --------------------------------------------------------------------------------
    def _share_prefix(self, r):
        """Point r's global table at live blocks that hold its prompt's prefix (refcount + 1 each)."""
        g, P = self.groups.get(None), len(r.prompt)
        if g is None or not self.prefix_sharing:
            return
        for j in range(math.ceil(P / self.bs)):
            b = g.pool.prefix.get(tuple(r.prompt[:min((j + 1) * self.bs, P)]))
            if b is None:
                break
            g.pool.share(b)
            r.tables[None].append(b)
        r.n_shared = min(len(r.tables[None]) * self.bs, P)
        if self.skip_shared:
            r.n_done = min(r.n_shared, P - 1)

    def _prepare(self, r, T):
        """Blocks for positions n_done .. n_done+T-1 in every group: allocate, or copy a shared block
        on its first divergent write (copy-on-write)."""
        for key, g in self.groups.items():
            table = r.tables[key]
            for j in range(r.n_done // self.bs, (r.n_done + T - 1) // self.bs + 1):
                if j == len(table):
                    table.append(g.pool.alloc())
                elif g.pool.ref[table[j]] > 1 and min(r.n_done + T, (j + 1) * self.bs) > r.n_shared:
                    new, g.pool.copies = g.pool.alloc(), g.pool.copies + 1
                    for store in g.store.values():
                        for t in store.values():
                            t[new] = t[table[j]]
                    g.pool.release(table[j])
                    table[j] = new

    def _after(self, r, T):
        """After a forward: free window blocks no later query sees; register full prompt blocks."""
        r.n_done += T
        for key, g in self.groups.items():
            if key is None:
                continue
            for j in range((r.n_done - key + 1) // self.bs):  # block j's last key < every future query's window
                if r.tables[key][j] >= 0:
                    g.pool.release(r.tables[key][j])
                    r.tables[key][j] = -1
        g, P = self.groups.get(None), len(r.prompt)
        if g is not None and self.prefix_sharing:
            n = min(r.n_done, P)
            for j in range(n // self.bs + (n == P and P % self.bs > 0)):
                if r.tables[None][j] not in g.pool.key:
                    g.pool.register(tuple(r.prompt[:min((j + 1) * self.bs, P)]), r.tables[None][j])

    # -- forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, reqs, idx):
        """idx [B, T]: the next T tokens of each request -> logits [B, T, vocab]."""
        model, T = self.model, idx.shape[1]
        for r in reqs:
            self._prepare(r, T)
        batches = {key: Batch(reqs, T, self.bs, key) for key in self.groups}
        slots = torch.tensor([r.slot for r in reqs])
        views = []
        for i in range(len(model.blocks)):
            if i in self.slot_store:
                views.append(SlotView(self.slot_store[i], slots))
            elif i in self.row_store:
                views.append(RowSlots(self.row_store[i], slots.tolist()))
            elif i in self.evicting:
                views.append(self.policy.view(i, reqs, T))
            else:
                g = self.group_of[i]
                policy = self.policy if self.policy is not None and self.policy.applies(i) else None
                views.append(PagedView(self.groups[g].store[i], batches[g], policy))
        pos = torch.tensor([r.n_done for r in reqs])
        x = model.wte(idx)
        for block, view in zip(model.blocks, views):
            x = run_block(block, x, view, pos)
        for view in views:
            if isinstance(view, SlotView):
                view.commit()
        for r in reqs:
            self._after(r, T)
        return model.lm_head(model.norm_f(x))

    def _emit(self, r, logits):
        """Sample r's next token from logits [vocab]."""
        if self.keep_logits:
            r.logits.append(logits.float().cpu())
        if r.force is not None:
            r.out.append(r.force[len(r.out)])
            return
        token = sample_token(logits[None], r.temperature, r.top_k, r.top_p, self.generator)
        r.out.append(int(token[0]))

    def _prefill(self, r):
        P = len(r.prompt)
        idx = torch.tensor([r.prompt[r.n_done:min(P, r.n_done + self.chunk)]], device=self.model.wte.weight.device)
        logits = self._forward([r], idx)
        if r.n_done == P:
            self._emit(r, logits[0, -1])

    def _decode(self, reqs):
        idx = torch.tensor([[r.out[-1]] for r in reqs], device=self.model.wte.weight.device)
        logits = self._forward(reqs, idx)
        for r, row in zip(reqs, logits[:, -1]):
            self._emit(r, row)

    def run(self, requests, on_done=None):
        """Serve `requests` (Request objects) to completion; returns them with `out` (or `error`) set.
        on_done(request) is called as each one finishes (or is refused)."""
        ok = []
        for r in requests:
            r.error = self.check(r)
            if r.error is not None:
                on_done and on_done(r)
            else:
                ok.append(r)
        if not ok:
            return requests
        self._setup(ok)
        waiting, self.running, self.reserved = deque(ok), [], {}
        while waiting or self.running:
            while waiting and len(self.running) < self.max_batch and self._fits(waiting[0]):
                self._admit(waiting.popleft())
            if not self.running:
                r = waiting.popleft()
                r.error = "does not fit in the block pool (raise --num_blocks)"
                on_done and on_done(r)
                continue
            pre = next((r for r in self.running if r.n_done < len(r.prompt)), None)
            if pre is not None:
                if pre.n_done == 0 and not any(pre.tables.values()):
                    self._share_prefix(pre)
                self._prefill(pre)
            dec = [r for r in self.running if r.n_done == len(r.tokens) - 1 and r.out and not r.done]
            if dec:
                self._decode(dec)
            for r in [r for r in self.running if r.done]:
                self._release(r)
                on_done and on_done(r)
        return requests

    # -- reports -------------------------------------------------------------------------------
    def block_bytes(self):
        """Bytes of one block in each group (all its layers' tensors)."""
        return {key: sum(t[0].numel() * t.element_size() for s in g.store.values() for t in s.values())
                for key, g in self.groups.items()}

    def peak_cache_bytes(self):
        """Peak bytes of blocks in use (+ evicting policies' kept rows) plus the delta-rule and NSA slots."""
        per = self.block_bytes()
        paged = sum(g.pool.peak * per[key] for key, g in self.groups.items())
        paged += getattr(self.policy, "peak_bytes", 0)
        slots = [*self.slot_store.values(), *self.row_store.values()]
        return paged + sum(t.numel() * t.element_size() for s in slots for t in s.values())
