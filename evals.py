"""Evaluations of a trained model, usable from the sweep runner (ablate.py) and standalone.

    python evals.py val --ckpt out/x                      # val loss (+ bits per byte for text)
    python evals.py mqar --ckpt out/x --n_batches 16      # MQAR accuracy by key-query distance
    python evals.py needle --ckpt out/x --factors 1,2,4   # a fact planted at a depth, asked at the end
    python evals.py length --ckpt out/x --factor 4        # loss by position up to 4x the training length
    python evals.py streaming --ckpt out/x --budget 64    # StreamingLLM eviction: full / window / sinks+window
    python evals.py kv_policies --ckpt out/x --budgets 32,64   # the serving engine's KV policies vs full
    python evals.py palindrome --ckpt out/x --seq_len 512 # copy in reverse (Kimi Linear), any length
    python evals.py stack --ckpt out/x --seq_len 512      # what each pop returns (Kimi Linear), any length
    python evals.py attention_sinks --ckpt out/x          # share of attention on position 0, per layer
    python evals.py --help ; python evals.py mqar --help

Every eval is a function `eval_<name>(model, cfg, **options) -> dict`: the flat float entries are the
scores (the sweep table shows them); list entries are curves (the sweep plots them). Options are
keyword arguments with defaults; the command line exposes each as `--option`.
"""
import argparse
import inspect
import json
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

import kernels
from data import SYNTHETIC_KINDS, synthetic_batches
from data.mqar import mqar_batch
from data.tokens import with_bos
from model import Attention, apply_rope, rope_angles

# ----------------------------------------------------------------------------------------------
# helpers


def _device(model):
    return model.wte.weight.device


def _is_text(cfg):
    return cfg.data.kind not in SYNTHETIC_KINDS


def _synthetic(cfg, n, seq_len, seed):
    """n sequences of the config's synthetic task (MQAR, palindrome, stack) at any length -> x, y."""
    return synthetic_batches(cfg.data, cfg.data.mqar_vocab or cfg.model.vocab_size, seq_len)(n, seed)


def _mqar_args(cfg, seq_len=None, n_pairs=None):
    return (seq_len or cfg.train.seq_len, n_pairs or cfg.data.n_pairs, cfg.data.mqar_vocab or cfg.model.vocab_size)


def _val_tokens(cfg):
    """The validation token stream of a text config (a flat numpy array) and its end-of-text id."""
    from data import make_dataset
    data = make_dataset(cfg)
    return np.concatenate([np.asarray(s.tokens) for s in data.val]), data.val[0].eot_id


def _text_batch(cfg, n, length, offset=0):
    """n val windows of length+1 tokens, spread over the val stream -> x, y [n, length]; with
    data.bos the inputs start with end-of-text, as the training rows do (data/tokens.py TokenLoader)."""
    toks, eot = _val_tokens(cfg)
    if len(toks) < length + 2:
        raise ValueError(f"the val split holds {len(toks)} tokens, fewer than one window of {length + 1}")
    starts = np.linspace(offset, len(toks) - length - 2, n).astype(np.int64)
    buf = torch.from_numpy(np.stack([toks[s:s + length + 1].astype(np.int64) for s in starts]))
    if cfg.data.bos:
        return with_bos(buf[:, 1:-1], eot), buf[:, 1:]
    return buf[:, :-1], buf[:, 1:]


def distance_buckets(max_dist):
    """Power-of-two bucket edges [1, 2, 4, ...] covering distances up to max_dist."""
    edges = [1]
    while edges[-1] <= max_dist:
        edges.append(edges[-1] * 2)
    return edges


# ----------------------------------------------------------------------------------------------
# validation loss / bits per byte


@torch.no_grad()
def eval_val(model, cfg, n_batches=10):
    """The dataset's own eval: val_loss and val_bpb (text) or val_loss and val_acc (MQAR)."""
    from data import make_dataset
    return make_dataset(cfg).evaluate(model, n_batches, _device(model))


# ----------------------------------------------------------------------------------------------
# MQAR accuracy by recall distance


@torch.no_grad()
def eval_mqar(model, cfg, n_batches=8, batch_size=32, seq_len=0, n_pairs=0, seed=7):
    """Accuracy on fresh MQAR sequences (a seed stream unused by training and val), overall and by
    the distance between a key and its query in power-of-two buckets [1,2), [2,4), ...
    seq_len / n_pairs 0 = the training settings."""
    T, P, V = _mqar_args(cfg, seq_len, n_pairs)
    edges = distance_buckets(T)
    hit, cnt = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    for i in range(n_batches):
        x, y, dist = mqar_batch(batch_size, T, P, V, [seed, 2 * 10 ** 9 + i])
        pred = model(x.to(_device(model)))[0].argmax(-1).cpu()
        mask = y >= 0
        ok, d = (pred[mask] == y[mask]).numpy(), dist[mask].numpy()
        b = np.searchsorted(edges, d, side="right") - 1
        np.add.at(hit, b, ok)
        np.add.at(cnt, b, 1)
    by_distance = [{"lo": edges[j], "hi": edges[j + 1], "acc": hit[j] / cnt[j], "n": int(cnt[j])}
                   for j in range(len(cnt)) if cnt[j] > 0]
    out = {"acc": float(hit.sum() / cnt.sum()), "by_distance": by_distance}
    short, long_ = cnt[:5].sum(), cnt[5:].sum()  # distance < 32 vs >= 32
    if short:
        out["acc_d<32"] = float(hit[:5].sum() / short)
    if long_:
        out["acc_d>=32"] = float(hit[5:].sum() / long_)
    return out


# ----------------------------------------------------------------------------------------------
# Needle retrieval


def _needle_mqar(model, cfg, contexts, depths, n_trials, seed):
    """Synthetic-vocab needle for MQAR models: the n_pairs key-value block (as in training) sits at
    `depth` of a context of zeros (MQAR's filler token); every key is queried in the last n_pairs
    positions; score = accuracy of the values predicted there."""
    _, P, V = _mqar_args(cfg)
    half, rng = V // 2, np.random.default_rng(seed)
    grid = []
    for L in contexts:
        for depth in depths:
            x = np.zeros((n_trials, L), dtype=np.int64)
            y = np.full((n_trials, L), -1, dtype=np.int64)
            q0 = L - P
            start = int(round(depth * (q0 - 2 * P)))
            for b in range(n_trials):
                keys = rng.choice(np.arange(1, half), P, replace=False)
                vals = rng.choice(np.arange(half, V), P, replace=False)
                x[b, start:start + 2 * P:2], x[b, start + 1:start + 2 * P:2] = keys, vals
                order = rng.permutation(P)
                x[b, q0:], y[b, q0:] = keys[order], vals[order]
            x, y = torch.from_numpy(x), torch.from_numpy(y)
            pred = model(x.to(_device(model)))[0].argmax(-1).cpu()
            acc = (pred[y >= 0] == y[y >= 0]).float().mean().item()
            grid.append({"context": L, "depth": depth, "acc": acc})
    return grid


@torch.no_grad()
def _greedy(model, prompt, n_new):
    """Greedy continuation of prompt [B, T] by n_new tokens with the model's cached decode."""
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + n_new)
    logits, out = model.step(prompt, cache)[:, -1], []
    for _ in range(n_new):
        out.append(logits.argmax(-1))
        logits = model.step(out[-1][:, None], cache)[:, -1]
    return torch.stack(out, 1)


def _needle_text(model, cfg, contexts, depths, n_trials, seed):
    """Byte-level needle: filler from the val corpus, the fact "secret = 48213" planted at `depth`,
    the query "secret = " at the end; score = exact match of the 5 greedy digits. With data.bos the
    prompt starts with end-of-text, as the training rows do (it counts in the context length)."""
    if cfg.model.vocab_size < 256:
        raise ValueError("the text needle needs a byte-level model (vocab_size >= 256)")
    toks, eot = _val_tokens(cfg)
    bos = [int(eot)] if cfg.data.bos else []
    rng = np.random.default_rng(seed)
    query = list(b"\nThe secret number is ")
    grid = []
    for L in contexts:
        for depth in depths:
            prompts, answers = [], []
            for _ in range(n_trials):
                number = f"{rng.integers(10000, 100000)}"
                fact = list(f"\nThe secret number is {number}.\n".encode())
                n_fill = L - len(bos) - len(fact) - len(query)
                s = int(rng.integers(0, len(toks) - n_fill - 1))
                filler = [int(t) if t < 256 else 10 for t in toks[s:s + n_fill]]
                at = int(round(depth * n_fill))
                prompts.append(bos + filler[:at] + fact + filler[at:] + query)
                answers.append(number)
            out = _greedy(model, torch.tensor(prompts, device=_device(model)), 5).cpu().tolist()
            acc = float(np.mean([bytes(t % 256 for t in o).decode("latin-1") == a for o, a in zip(out, answers)]))
            grid.append({"context": L, "depth": depth, "acc": acc})
    return grid


@torch.no_grad()
def eval_needle(model, cfg, factors=(1, 2, 4), depths=(0.0, 0.25, 0.5, 0.75, 1.0), n_trials=16, seed=11):
    """A fact planted at a controlled depth, asked at the end, in contexts of `factors` x the training
    length (so longer than every window and than training). MQAR models: the synthetic-vocab needle
    (_needle_mqar); byte-level text models: "The secret number is 48213." (_needle_text)."""
    contexts = [int(f * cfg.train.seq_len) for f in factors]
    if not _is_text(cfg) and cfg.data.kind != "mqar":
        raise ValueError(f"needle: defined for text and MQAR models, not data.kind={cfg.data.kind}")
    fn = _needle_text if _is_text(cfg) else _needle_mqar
    grid = fn(model, cfg, contexts, depths, n_trials, seed)
    out = {"grid": grid}
    for L in contexts:
        f = L / cfg.train.seq_len
        out[f"acc@{f:g}x"] = float(np.mean([g["acc"] for g in grid if g["context"] == L]))
    return out


# ----------------------------------------------------------------------------------------------
# Loss by position (length extrapolation)


@torch.no_grad()
def eval_length(model, cfg, factor=4, n_seqs=16, n_buckets=16, seed=13):
    """Loss by position over contexts of factor x the training length (one parallel forward).
    Text: next-token loss on val windows. MQAR: loss and accuracy at the query positions of
    sequences of that length (same pairs, so the gaps grow)."""
    T = int(factor * cfg.train.seq_len)
    if _is_text(cfg):
        x, y = _text_batch(cfg, n_seqs, T)
    else:
        x, y = _synthetic(cfg, n_seqs, T, [seed, 3 * 10 ** 9])
    logits = model(x.to(_device(model)))[0].float().cpu()
    ce = F.cross_entropy(logits.transpose(1, 2), y.clamp(min=0), reduction="none")   # [n, T]
    ok = (logits.argmax(-1) == y).float()
    mask = (y >= 0).float()
    edges = np.linspace(0, T, n_buckets + 1).astype(int)
    curve = []
    for a, b in zip(edges[:-1], edges[1:]):
        m = mask[:, a:b].sum().item()
        if m:
            curve.append({"lo": int(a), "hi": int(b), "loss": (ce[:, a:b] * mask[:, a:b]).sum().item() / m,
                          "acc": (ok[:, a:b] * mask[:, a:b]).sum().item() / m})
    def mean_over(lo, hi):
        m = mask[:, lo:hi].sum().item()
        return (ce[:, lo:hi] * mask[:, lo:hi]).sum().item() / m if m else float("nan")
    t0 = cfg.train.seq_len
    return {"by_position": curve, "loss@1x": mean_over(0, t0), f"loss@{factor:g}x": mean_over(T - t0, T)}


# ----------------------------------------------------------------------------------------------
# StreamingLLM eviction


def global_layers(model):
    """Indices of the global softmax attention layers (kind attn without a window)."""
    return [i for i, b in enumerate(model.blocks) if isinstance(b.mixer, Attention) and b.mixer.cfg.window is None]


def _streaming_attention(mixer, x, cache, budget, n_sinks, keep_heads=None, sink_values=True):
    """One decode step of a global Attention layer with an evicting cache.

    cache: dict with pre-RoPE keys k and values v [B, S, Hkv, D]. The new token's key joins the cache;
    if the cache then holds more than `budget` keys, the oldest are dropped, keeping the first
    `n_sinks` (StreamingLLM's attention sinks; 0 = window only). Keys are rotated at their positions
    inside the cache, 0..n, the query at n (its own slot), so positions never exceed the budget.
    budget None = keep everything (positions are then the absolute ones: the model's own decode).
    keep_heads (bool [Hq], with a budget): only these query heads keep the n_sinks first tokens (and
    budget - n_sinks recent keys); the others see the most recent `budget` keys alone. sink_values False:
    once the cache evicts, the n_sinks first tokens keep their keys but read as zero values (a sink that
    draws attention and writes nothing)."""
    c = mixer.cfg
    B = x.shape[0]
    q = mixer.wq(x).view(B, 1, c.n_heads, c.head_dim)
    k = mixer.wk(x).view(B, 1, c.n_kv_heads, c.head_dim)
    v = mixer.wv(x).view(B, 1, c.n_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = mixer.q_norm(q), mixer.k_norm(k)
    cache["k"] = torch.cat([cache["k"], k], 1)
    cache["v"] = torch.cat([cache["v"], v], 1)
    if budget is None:
        return mixer.wo(_attend_cached(mixer, q, cache["k"], cache["v"]).reshape(B, 1, -1))
    evicting = cache["k"].shape[1] > budget
    if keep_heads is None:
        cache["k"], cache["v"] = _evict(cache["k"], budget, n_sinks), _evict(cache["v"], budget, n_sinks)
        v = cache["v"] if sink_values or not evicting else _zero_first(cache["v"], n_sinks)
        return mixer.wo(_attend_cached(mixer, q, cache["k"], v).reshape(B, 1, -1))
    # the cache holds the first n_sinks tokens and the last `budget` keys: each head set reads its part
    cache["k"], cache["v"] = _evict(cache["k"], budget + n_sinks, n_sinks), _evict(cache["v"], budget + n_sinks, n_sinks)
    v = _evict(cache["v"], budget, n_sinks)
    v = v if sink_values or not evicting else _zero_first(v, n_sinks)
    o_sinks = _attend_cached(mixer, q, _evict(cache["k"], budget, n_sinks), v)
    o_window = _attend_cached(mixer, q, cache["k"][:, -budget:], cache["v"][:, -budget:])
    o = torch.where(keep_heads[:, None], o_sinks, o_window)          # [B, 1, Hq, D]
    return mixer.wo(o.reshape(B, 1, -1))


def _zero_first(v, n):
    """v [B, S, ...] with its first n rows zero (a copy)."""
    v = v.clone()
    v[:, :n] = 0
    return v


def _evict(t, budget, n_sinks):
    """The first n_sinks and the last budget - n_sinks rows of t [B, S, ...] (all of t if S <= budget)."""
    S = t.shape[1]
    return t if S <= budget else torch.cat([t[:, :n_sinks], t[:, S - (budget - n_sinks):]], 1)


def _attend_cached(mixer, q, k, v):
    """The query [B, 1, Hq, D] over cached pre-RoPE keys k, v [B, S, Hkv, D], rotated at slots 0..S-1
    (the query at S - 1)."""
    c, S = mixer.cfg, k.shape[1]
    if c.rope:
        cos, sin = rope_angles(torch.arange(S, device=q.device), c.head_dim, c.rope_theta)
        k = apply_rope(k, cos, sin)
        q = apply_rope(q, cos[-1:], sin[-1:])
    return kernels.attention(q, k, v, sinks=mixer.sinks, backend=mixer.backend)


@torch.no_grad()
def streaming_logits(model, x, budget=None, n_sinks=4, keep_heads=None, sink_values=True):
    """Token-by-token decode of x [B, L] where every global attention layer keeps an evicting cache
    (see _streaming_attention); other layers (windowed attention, delta rule) use their own caches.
    Returns logits [B, L, vocab]. budget None = full cache (equals model.forward). keep_heads
    {layer index: bool [Hq]}: only these heads keep the n_sinks first tokens (a global layer not in it:
    none of its heads); None = every head. sink_values False: the kept first tokens read as zero values
    once the caches evict (_streaming_attention)."""
    B, L = x.shape
    caches = []
    for i, block in enumerate(model.blocks):
        m = block.mixer
        if isinstance(m, Attention) and m.cfg.window is None:
            empty = model.wte.weight.new_zeros(B, 0, m.cfg.n_kv_heads, m.cfg.head_dim)
            keep = None if keep_heads is None else keep_heads.get(i, torch.zeros(m.cfg.n_heads, dtype=torch.bool))
            caches.append({"k": empty, "v": empty, "keep_heads": None if keep is None else keep.to(x.device)})
        else:
            caches.append(m.new_cache(B, L, x.device, model.wte.weight.dtype))
    out = []
    for t in range(L):
        h = model.wte(x[:, t:t + 1])
        for block, cache in zip(model.blocks, caches):
            a = block.norm1(h)
            if isinstance(cache, dict):
                h = h + _streaming_attention(block.mixer, a, cache, budget, n_sinks, cache["keep_heads"], sink_values)
            else:
                h = h + block.mixer(a, cache, t)
            h = h + block.mlp(block.norm2(h))
        out.append(model.lm_head(model.norm_f(h)))
    return torch.cat(out, 1)


@torch.no_grad()
def eval_streaming(model, cfg, factor=2, budget=64, n_sinks=4, n_seqs=4, sink_heads=0, full=True):
    """StreamingLLM (seed 004): perplexity on streams of factor x the training length for a full
    cache, a recent window of `budget` keys, and n_sinks first tokens + the most recent budget -
    n_sinks keys (positions inside the cache, keys re-rotated). Evicts from global softmax attention
    layers (kind attn without a window) only; MLA layers are not supported. sink_heads > 0 adds
    `ppl_sinks_heads`: the first tokens kept only for the sink_heads heads (over all global layers)
    that put the most attention on position 0 (as evals.attention_sinks measures it), the window alone
    for every other head: how much of the window's loss those heads account for. full=False skips the
    full cache (it does not depend on the budget: a study of several budgets decodes it once)."""
    kinds = [b.mixer.cfg.kind for b in model.blocks]
    if "mla" in kinds:
        raise ValueError("evals.streaming: evicts only from global softmax attention layers (kind attn "
                         "without a window); this model has MLA layers, which it does not support")
    if not global_layers(model):
        raise ValueError(f"evals.streaming: evicts only from global softmax attention layers (kind attn "
                         f"without a window); this model's layers are {', '.join(sorted(set(kinds)))}")
    L = int(factor * cfg.train.seq_len)
    if _is_text(cfg):
        x, y = _text_batch(cfg, n_seqs, L, offset=12345)
    else:
        x, y = _synthetic(cfg, n_seqs, L, [17, 4 * 10 ** 9])
    x = x.to(_device(model))
    policies = [("window", budget, 0, None), ("sinks+window", budget, n_sinks, None)]
    if full:
        policies.insert(0, ("full", None, 0, None))
    if sink_heads:
        policies.append(("sinks_heads", budget, n_sinks, _top_sink_heads(model, cfg, sink_heads)))
    out = {}
    for name, b, s, keep in policies:
        logits = streaming_logits(model, x, b, s, keep).float().cpu()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-1).item()
        out[f"ppl_{name}"] = math.exp(min(nll, 50.0))
    return out


def _top_sink_heads(model, cfg, n):
    """{layer: bool [Hq]} marking the n heads of the global attention layers with the largest share of
    attention on position 0."""
    layers = global_layers(model)
    skip = min(16, cfg.train.seq_len // 2)
    shares = {i: r["key0_heads"] for i, r in layer_attention_shares(model, cfg, layers, skip=skip).items()}
    ranked = sorted(((s, i, h) for i, per_head in shares.items() for h, s in enumerate(per_head)), reverse=True)
    keep = {i: torch.zeros(len(per_head), dtype=torch.bool) for i, per_head in shares.items()}
    for _, i, h in ranked[:n]:
        keep[i][h] = True
    return keep


def attention_shares(q, k, scale, sinks=None, n_first=4, skip=16):
    """Where softmax attention goes, averaged over heads and over the queries at positions >= skip.

    q [B, T, Hq, D], k [B, T, Hkv, D] (RoPE applied), causal; sinks [Hq] learned sink logits or None.
    Returns the mean share on key 0, on keys 0..n_first-1, on the learned sink (0 without sinks), and
    what key 0 would get if every query attended uniformly (mean of 1 / (t + 1)); `key0_heads` is key 0's
    share per head [Hq] (a list), averaged over batch and queries."""
    B, T, Hq, D = q.shape
    k = k.repeat_interleave(Hq // k.shape[2], 2)
    s = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, Hq, 1, 1).expand(B, Hq, T, 1)], -1)
    p = s.softmax(-1)[:, :, skip:]                                             # [B, H, T - skip, T (+1)]
    t = torch.arange(skip, T, dtype=torch.float32)
    return {"key0": p[..., 0].mean().item(), "key0_heads": p[..., 0].mean((0, 2)).tolist(),
            "first": p[..., :n_first].sum(-1).mean().item(),
            "learned": p[..., T].mean().item() if sinks is not None else 0.0,
            "uniform": (1.0 / (t + 1)).mean().item()}


@torch.no_grad()
def layer_attention_shares(model, cfg, layers, n_seqs=8, n_first=4, skip=16):
    """{layer: attention_shares} of the given global attention layers on n_seqs validation sequences of
    the training length."""
    T = cfg.train.seq_len
    x = (_text_batch(cfg, n_seqs, T, offset=4242) if _is_text(cfg) else _synthetic(cfg, n_seqs, T, [29, 6 * 10 ** 9]))[0]
    captures = {i: _Capture() for i in layers}
    h = model.wte(x.to(_device(model)))
    for i, block in enumerate(model.blocks):
        h = block(h, captures.get(i), 0)
    out = {}
    for i in layers:
        q, k, _, scale, sinks = captures[i].qkv
        out[i] = attention_shares(q, k, scale, sinks, n_first, skip)
    return out


@torch.no_grad()
def eval_attention_sinks(model, cfg, n_seqs=8, n_first=4, skip=16, head_threshold=0.3):
    """Attention sinks (StreamingLLM): the share of attention on position 0 per global attention layer.

    Per global softmax attention layer: the share on position 0 (`key0_L<i>`), on the first n_first
    positions (`first_L<i>`) and on the learned sink (`learned_L<i>`, gpt-oss sinks), averaged over heads
    and over the queries at positions >= skip of n_seqs validation sequences of the training length, and
    the share on position 0 of the layer's most sink-like head (`key0_maxhead_L<i>`); `uniform` is key 0's
    share under uniform attention, the level without a sink. `sink_heads`: the fraction of all these
    layers' heads whose share on position 0 exceeds head_threshold (Gu et al. 2024's sink ratio, with
    their threshold 0.3); `sink_heads_L<i>` the same fraction within layer i. Layers of other kinds are
    skipped."""
    layers = global_layers(model)
    if not layers:
        raise ValueError("evals.attention_sinks: the model has no global softmax attention layer (kind attn "
                         "without a window)")
    if skip >= cfg.train.seq_len:
        raise ValueError(f"evals.attention_sinks.skip: must be below the training length {cfg.train.seq_len} "
                         f"(got {skip})")
    out, heads = {}, []
    for i, shares in layer_attention_shares(model, cfg, layers, n_seqs, n_first, skip).items():
        out["uniform"] = shares.pop("uniform")
        per_head = shares.pop("key0_heads")
        heads += per_head
        out[f"key0_maxhead_L{i}"] = max(per_head)
        out[f"sink_heads_L{i}"] = sum(h > head_threshold for h in per_head) / len(per_head)
        out.update({f"{name}_L{i}": v for name, v in shares.items()})
    out["key0_mean"] = sum(out[f"key0_L{i}"] for i in layers) / len(layers)
    out["sink_heads"] = sum(h > head_threshold for h in heads) / len(heads)
    return out


# ----------------------------------------------------------------------------------------------
# KV policies of the serving engine (engine.py, kv_policies.py)


class _Capture:
    """A cache view for one global layer (the engine's hooks in model.py): records q, k, v of a whole
    sequence and returns the full causal attention."""

    def attend(self, mixer, q, k, v):
        self.qkv = (q, k, v, mixer.cfg.head_dim ** -0.5, mixer.sinks)
        return kernels.attention(q, k, v, sinks=mixer.sinks, backend=mixer.backend)

    def attend_latent(self, mixer, q_lat, latent, iq, iw, ik):
        rows = latent[:, :, None]
        self.qkv = (q_lat, rows, rows[..., :mixer.cfg.kv_lora_rank], mixer.scale, None)
        return kernels.attention(q_lat, rows, self.qkv[2], scale=mixer.scale, backend=mixer.backend)


def attention_selection_errors(q, k, v, scale, sinks, budget, n_sinks=4, page=16, n_last=64):
    """Relative error ||o - o_full|| / ||o_full|| of the last n_last queries when each reads only
    `budget` keys (seed 004's comparison): sinks + recent window, Quest pages (top budget/page pages by
    the upper bound from per-channel min / max keys, the query's own page always), exact top-k scores.
    q [1,T,Hq,D] k [1,T,Hkv,D] v [1,T,Hkv,Dv] (one sequence, roped as the layer reads them)."""
    T, Hq = q.shape[1], q.shape[2]
    G, n_last = Hq // k.shape[2], min(n_last, T)
    qf = q[0, T - n_last:].float().transpose(0, 1)                            # [Hq, n, D]
    kf = k[0].float().repeat_interleave(G, 1).transpose(0, 1)                 # [Hq, T, D]
    vf = v[0].float().repeat_interleave(G, 1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale                                  # [Hq, n, T]
    qpos = torch.arange(T - n_last, T)[:, None]
    kpos = torch.arange(T)[None, :]
    causal = kpos <= qpos                                                     # [n, T]

    def read(keep):
        s = scores.masked_fill(~(keep & causal), float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float().view(Hq, 1, 1).expand(Hq, n_last, 1)], -1)
        return s.softmax(-1)[..., :T] @ vf
    full = read(torch.ones_like(causal))
    window = (kpos < n_sinks) | (kpos > qpos - (budget - n_sinks))
    n_pages = math.ceil(T / page)
    kp = F.pad(kf, (0, 0, 0, n_pages * page - T), value=float("nan")).view(Hq, n_pages, page, -1)
    kmin, kmax = kp.nan_to_num(float("inf")).amin(2), kp.nan_to_num(float("-inf")).amax(2)   # [Hq, pages, D]
    ub = torch.maximum(qf[:, :, None] * kmin[:, None], qf[:, :, None] * kmax[:, None]).sum(-1)  # [Hq, n, pages]
    pidx = torch.arange(n_pages)
    ub = ub.masked_fill(pidx * page > qpos, float("-inf")).masked_fill(pidx == qpos // page, float("inf"))
    top = ub.topk(min(max(1, budget // page), n_pages), -1).indices
    quest = torch.zeros(Hq, n_last, n_pages, dtype=torch.bool).scatter(-1, top, True).repeat_interleave(page, -1)[..., :T]
    best = scores.masked_fill(~causal, float("-inf")).topk(min(budget, T), -1).indices
    topk = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, best, True)
    ref = full.norm()
    return {name: ((read(keep) - full).norm() / ref).item()
            for name, keep in [("sinks+window", window), ("quest", quest), ("exact_topk", topk)]}


def _policy_layers(model):
    from kv_policies import applies_to
    return [i for i, b in enumerate(model.blocks) if applies_to(b.mixer)]


@torch.no_grad()
def eval_kv_policies(model, cfg, policies=("streaming", "h2o", "snapkv", "quest", "offload"), budgets=(32, 64),
                     factor=2, n_seqs=4, block_size=16):
    """KV policies of the serving engine against the full cache, each at each budget.

    Sequences of factor x the training length, the first half
    (text) or the key-value pairs (MQAR) as the prompt, the rest teacher-forced through the engine;
    perplexity (text) or accuracy (MQAR) of the forced part for the full cache and each policy x budget;
    the relative error of the attention output of the global layers' last 64 queries when each reads
    `budget` keys (sinks + window, Quest pages, exact top-k); KB of global-layer cache per sequence in
    fast memory (offload: + the whole context on file)."""
    from engine import Engine, Request
    layers = _policy_layers(model)
    if not layers:
        raise ValueError("kv_policies: the model has no global attention layer (attn without window, dense mla)")
    L = int(factor * cfg.train.seq_len)
    if _is_text(cfg):
        x, y = _text_batch(cfg, n_seqs, L, offset=777)
        n_prompt = L // 2
    else:
        _, P, V = _mqar_args(cfg)
        x, y, _ = mqar_batch(n_seqs, L, P, V, [23, 4 * 10 ** 9])
        n_prompt = 2 * P
    text = _is_text(cfg)

    def score(policy, budget):
        reqs = [Request(x[b, :n_prompt].tolist(), L - n_prompt, force=x[b, n_prompt:].tolist()) for b in range(n_seqs)]
        Engine(model, max_batch=n_seqs, block_size=block_size, kv_policy=policy, kv_budget=budget,
               keep_logits=True).run(reqs)
        logits = torch.stack([torch.stack(r.logits) for r in reqs])               # [n, L - n_prompt, V]
        target = y[:, n_prompt - 1:L - 1]
        if text:
            return math.exp(min(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-1).item(), 50.0))
        m = target >= 0
        return (logits.argmax(-1)[m] == target[m]).float().mean().item()
    metric = "ppl" if text else "acc"
    key_bytes = per_token = 0  # over the global layers: one cached key, one cached token (key + value)
    for i in layers:
        m, es = model.blocks[i].mixer, model.wte.weight.element_size()
        mla = hasattr(m.cfg, "kv_lora_rank")
        key = (m.cfg.kv_lora_rank + m.cfg.rope_dim) if mla else m.cfg.n_kv_heads * m.cfg.head_dim
        key_bytes, per_token = key_bytes + key * es, per_token + (1 if mla else 2) * key * es
    captures = {i: _Capture() for i in layers}
    h = model.wte(x[:1].to(_device(model)))
    for i, block in enumerate(model.blocks):
        h = block(h, captures.get(i), 0)
    out = {f"{metric}_full": score("full", None), "cache_kB_full": L * per_token / 1e3, "rows": []}
    for budget in budgets:
        errs = [attention_selection_errors(*captures[i].qkv, budget, page=block_size) for i in layers]
        row = {"budget": budget, **{f"err_{k}": sum(e[k] for e in errs) / len(errs) for k in errs[0]}}
        out["rows"].append(row)
        bounds = 2 * math.ceil(L / block_size) * key_bytes                   # quest's min / max keys
        for policy in policies:
            fast = {"quest": L * per_token + bounds, "offload": min(L, budget) * per_token + bounds}.get(
                policy, min(L, budget) * per_token)                            # offload: selected pages in memory
            out["rows"].append({"policy": policy, "budget": budget, metric: score(policy, budget),
                                "cache_kB": fast / 1e3})
    return out


# ----------------------------------------------------------------------------------------------
# Palindrome and Stack (Kimi Linear's synthetic tasks, data/tasks.py)


@torch.no_grad()
def _labelled_accuracy(model, make, n_batches, batch_size, seed):
    """acc: labelled positions predicted right; seq_acc: sequences with every labelled position right."""
    hit = cnt = seq_ok = n_seq = 0
    for i in range(n_batches):
        x, y = make(batch_size, [seed, 5 * 10 ** 9 + i])
        pred = model(x.to(_device(model)))[0].argmax(-1).cpu()
        mask = y >= 0
        ok = (pred == y) | ~mask
        hit, cnt = hit + (ok & mask).sum().item(), cnt + mask.sum().item()
        seq_ok, n_seq = seq_ok + ok.all(1).sum().item(), n_seq + len(y)
    return {"acc": hit / cnt if cnt else float("nan"), "seq_acc": seq_ok / n_seq}


def _task_eval(model, cfg, kind, n_batches, batch_size, seq_len, seed):
    if cfg.data.kind != kind:
        raise ValueError(f"{kind}: the model was trained on data.kind={cfg.data.kind}, not {kind}")
    T = seq_len or cfg.train.seq_len
    return _labelled_accuracy(model, lambda n, s: _synthetic(cfg, n, T, s), n_batches, batch_size, seed)


def eval_palindrome(model, cfg, n_batches=4, batch_size=32, seq_len=0, seed=19):
    """Palindrome (copy n tokens in reverse) at seq_len (0 = the training length): accuracy over the
    reversed half, and the share of sequences reversed without a mistake."""
    return _task_eval(model, cfg, "palindrome", n_batches, batch_size, seq_len, seed)


def eval_stack(model, cfg, n_batches=4, batch_size=32, seq_len=0, seed=23):
    """Stack (push / pop stream) at seq_len (0 = the training length): accuracy of the popped
    tokens, and the share of sequences with every pop right."""
    return _task_eval(model, cfg, "stack", n_batches, batch_size, seq_len, seed)


EVALS = {"val": eval_val, "mqar": eval_mqar, "needle": eval_needle, "length": eval_length,
         "streaming": eval_streaming, "kv_policies": eval_kv_policies, "palindrome": eval_palindrome,
         "stack": eval_stack, "attention_sinks": eval_attention_sinks}



def _at_least(lo):
    return (lambda v: v >= lo), f">= {lo}"


_POSITIVE = _at_least(1)
_ABOVE_0 = ((lambda v: v > 0), "> 0")
KV_POLICIES = ("streaming", "h2o", "snapkv", "quest", "offload")
# option -> (test, what is allowed), per eval; tuples are tested element by element
OPTION_RULES = {
    "val": {"n_batches": _POSITIVE},
    "mqar": {"n_batches": _POSITIVE, "batch_size": _POSITIVE, "seq_len": _at_least(0), "n_pairs": _at_least(0)},
    "needle": {"factors": _ABOVE_0, "depths": ((lambda v: 0 <= v <= 1), "in [0, 1]"), "n_trials": _POSITIVE},
    "length": {"factor": ((lambda v: v >= 1), ">= 1 (a multiple of the training length)"),
               "n_seqs": _POSITIVE, "n_buckets": _POSITIVE},
    "streaming": {"factor": _ABOVE_0, "budget": _POSITIVE, "n_sinks": _at_least(0), "n_seqs": _POSITIVE,
                  "sink_heads": _at_least(0), "full": ((lambda v: True), "true or false")},
    "kv_policies": {"policies": ((lambda v: v in KV_POLICIES), f"one of {', '.join(KV_POLICIES)}"),
                    "budgets": _POSITIVE, "factor": _ABOVE_0, "n_seqs": _POSITIVE, "block_size": _POSITIVE},
    "palindrome": {"n_batches": _POSITIVE, "batch_size": _POSITIVE, "seq_len": _at_least(0)},
    "stack": {"n_batches": _POSITIVE, "batch_size": _POSITIVE, "seq_len": _at_least(0)},
    "attention_sinks": {"n_seqs": _POSITIVE, "n_first": _POSITIVE, "skip": _at_least(0),
                        "head_threshold": ((lambda v: 0 <= v < 1), "in [0, 1)")},
}


def check_options(name, options, cfg=None):
    """Refuse (ValueError, one line) an unknown option, a value out of range, or an eval that does not
    apply to the checkpoint's data (cfg); run before anything is computed."""
    allowed = eval_options(name)
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(f"evals.{name}.{key}: unknown option; allowed: {', '.join(allowed)}")
        test, what = OPTION_RULES[name].get(key, _at_least(0) if key == "seed" else ((lambda v: True), ""))
        values = value if isinstance(value, (tuple, list)) else [value]
        default = allowed[key][0] if isinstance(allowed[key], (tuple, list)) else allowed[key]
        kind = type(default) if isinstance(default, (str, bool)) else (int, float)  # the type the default has
        typed = lambda v: isinstance(v, kind) and (kind is bool or not isinstance(v, bool))  # noqa: E731
        if not values or not all(typed(v) and test(v) for v in values):
            raise ValueError(f"evals.{name}.{key}: must be {what}{' (each)' if isinstance(value, (tuple, list)) else ''}"
                             f" (got {value!r})")
    if name == "streaming" and options.get("n_sinks", 4) >= options.get("budget", 64):
        raise ValueError(f"evals.streaming.budget: must be larger than n_sinks={options.get('n_sinks', 4)} "
                         f"(got {options.get('budget', 64)})")
    if name == "kv_policies" and "streaming" in options.get("policies", KV_POLICIES):
        small = [b for b in options.get("budgets", (32, 64)) if isinstance(b, int) and b <= 4]
        if small:
            raise ValueError(f"evals.kv_policies.budgets: must be larger than 4 (the sink tokens of policy "
                             f"streaming; got {small[0]})")
    if cfg is not None and name in ("palindrome", "stack") and cfg.data.kind != name:
        raise ValueError(f"evals.{name}: the model was trained on data.kind={cfg.data.kind}, not {name}")
    if cfg is not None and name == "mqar" and cfg.data.kind != "mqar":
        use = ("val, needle, length or streaming" if _is_text(cfg) else
               f"val, length, streaming{', ' + cfg.data.kind if cfg.data.kind in ('palindrome', 'stack') else ''} "
               f"or attention_sinks")
        raise ValueError(f"evals.mqar: the checkpoint was trained on data.kind {cfg.data.kind}, not mqar; use {use}")


def run_eval(name, model, cfg, options=None):
    """Run eval `name` with a dict of options (checked first: check_options)."""
    fn = EVALS[name]
    check_options(name, options or {}, cfg)
    model.eval()
    return fn(model, cfg, **(options or {}))


def eval_options(name):
    """{option: default} of eval `name`."""
    sig = inspect.signature(EVALS[name])
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def scalars(result):
    """The flat float entries of an eval result (what the sweep table shows)."""
    return {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# ----------------------------------------------------------------------------------------------
# command line


def _parse_value(default):
    if isinstance(default, (tuple, list)):
        kind = type(default[0]) if default else float
        return lambda s: tuple(kind(v) for v in s.split(","))
    if isinstance(default, bool):
        return _parse_bool
    return type(default)


def _parse_bool(s):
    if s.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ValueError(s)                                       # argparse: "invalid true or false value"
    return s.lower() in ("1", "true", "yes")


def _named(parse, default):
    """argparse names the type in its message: 'invalid comma-separated float list value: ...'."""
    if isinstance(default, (tuple, list)):
        parse.__name__ = f"comma-separated {type(default[0]).__name__ if default else 'float'} list"
    if isinstance(default, bool):
        parse.__name__ = "true or false"
    return parse


def first_sentence(doc):
    """The first sentence of a docstring, on one line."""
    text = " ".join(doc.split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="eval", required=True, metavar="EVAL", help=", ".join(EVALS))
    for name, fn in EVALS.items():
        sp = sub.add_parser(name, help=first_sentence(fn.__doc__), description=fn.__doc__)
        sp.add_argument("--ckpt", required=True, help="checkpoint file or run folder (latest ckpt_*.pt)")
        sp.add_argument("--device", default="cpu")
        sp.add_argument("--json", action="store_true", help="print the whole result as JSON")
        for key, default in eval_options(name).items():
            sp.add_argument(f"--{key}", type=_named(_parse_value(default), default), default=default,
                            help=f"default {','.join(map(str, default)) if isinstance(default, tuple) else default}")
    args = p.parse_args(argv)
    from data.tokens import DataError
    from model import ConfigError
    from sample import load_model
    try:
        options = {k: getattr(args, k) for k in eval_options(args.eval)}
        check_options(args.eval, options)
        from train import pick_device
        model, cfg = load_model(args.ckpt, pick_device(args.device, "--device"))
        if getattr(cfg, "converted_from", None):  # its data.kind (stdlib) is a placeholder, not its corpus
            raise ConfigError(f"evals.{args.eval}: the checkpoint was converted from {cfg.converted_from} and has no "
                              f"corpus to evaluate on; train from it (--train.init_from) and evaluate that run")
        result = run_eval(args.eval, model, cfg, options)
    except (ConfigError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            if isinstance(v, list):
                for row in v:
                    print(f"  {k}: " + ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}"
                                                 for a, b in row.items()))
            else:
                print(f"{k}: {v:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
