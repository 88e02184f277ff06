"""Where a model recalls on MQAR (issue 16): the effective attention of its softmax, linear, GDN and KDA
layers, and how much the keys it stores overlap.

Each of these layers is linear in its values: o_t = sum_j M[t, j] v_j per head, where M is the softmax
of q k^T for attention, causal(q k^T) for linear attention, and for the gated delta rule M also carries
the decays and the delta rule's corrections. Running the layer's op once more with v = the identity
gives M exactly. For every head this prints, over the queries of fresh sequences of each run's own
MQAR setting:
- where it recalls: the share of queries whose largest |M[t, j]| over the key-value block lies on their
  own pair i, at position 2i + o: the key's (o = 0), the value's (o = 1), or a later one whose short
  convolution still sees the key (o < its width), at the offset o where the pair ranks highest (below;
  on a tie, the one that holds the top score most often); by chance about 1 / (2 pairs);
- rank: the mean rank of the query's own pair among all pairs by |M| at their positions 2j + o (0: its
  top score; by chance (pairs - 1) / 2). A head that narrows a query down to a few candidates without
  finding its pair first shows here and not in the share above;
- contrast: the mean |M| at the query's own pair over the mean |M| at the other pairs' same positions;
- key overlap: the mean cos^2 between the k of distinct pairs at that position (0 for orthogonal keys,
  1/K for random directions in K channels).

    python studies/recall_heads.py runs/mqar_curriculum_mixers/linear_t512-s0 runs/mqar_curriculum_mixers/kda_t512-s0
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402
from data.mqar import mqar_batch  # noqa: E402
from data.tokens import DataError  # noqa: E402
from sample import load_model  # noqa: E402

OPS = ("linear_attention", "delta_rule", "attention")  # ops whose output is linear in v, in kernels/


def capture_ops(model, x):
    """Run model(x) and return, per call of one of OPS, (layer, op name, args, kwargs)."""
    calls, originals, layer = [], {name: getattr(kernels, name) for name in OPS}, [None]

    def recorder(name):
        def op(*args, **kwargs):
            calls.append((layer[0], name, args, kwargs))
            return originals[name](*args, **kwargs)
        return op
    hooks = [b.mixer.register_forward_pre_hook(lambda m, a, i=i: layer.__setitem__(0, i))
             for i, b in enumerate(model.blocks)]
    try:
        for name in OPS:
            setattr(kernels, name, recorder(name))
        with torch.no_grad():
            model(x)
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)
        for hook in hooks:
            hook.remove()
    return calls


def effective_attention(name, args, kwargs):
    """The op's M [B, H, T, T] (o = M v; H: query heads): the op rerun with v = the identity."""
    q, k, v = args[:3]
    B, T, H, _ = v.shape
    eye = torch.eye(T, dtype=v.dtype).expand(B, H, T, T).transpose(1, 2)   # [B, T, H, T]: v_j = e_j
    with torch.no_grad():
        o = getattr(kernels, name)(q, k, eye, *args[3:], **kwargs)
    o = o[0] if isinstance(o, tuple) else o                                # [B, T, Hq, T]
    return o.transpose(1, 2)


def head_stats(M, k, x, y, n_pairs, reach):
    """Per head: {at, hit, rank, contrast, overlap} over the queries (y >= 0). A pair i (key at 2i, value at
    2i + 1) can be stored at any position 2i + o the short convolution lets see its key, o < reach;
    `at` is the offset o where the query's pair ranks highest among the pairs (mean rank to 0.1; on a
    tie, the offset that most often holds the query's top score)."""
    B, H, T, _ = M.shape
    bs, ts = (y >= 0).nonzero(as_tuple=True)
    pair = (x[bs, :2 * n_pairs:2] == x[bs, ts][:, None]).float().argmax(-1)   # query's pair index i
    span = min(2 * n_pairs + reach - 1, T)                                  # positions a pair can live at
    scores = M[bs, :, ts, :span].abs()                                      # [N, H, span]
    others = torch.ones(len(bs), n_pairs, dtype=torch.bool)
    others[torch.arange(len(bs)), pair] = False
    off_diag = ~torch.eye(n_pairs, dtype=torch.bool)
    offsets = [o for o in range(reach) if 2 * (n_pairs - 1) + o < span]
    out = []
    for h in range(H):
        stored = {o: scores[:, h, torch.arange(n_pairs) * 2 + o] for o in offsets}   # [N, pairs]: pair j at 2j + o
        own = {o: st.gather(1, pair[:, None]) for o, st in stored.items()}            # [N, 1]
        ranks = {o: ((st > own[o]).sum(1) + 0.5 * ((st == own[o]).sum(1) - 1)).float().mean().item()
                 for o, st in stored.items()}                                         # 0: the pair is top
        top = scores[:, h].argmax(-1)
        hits = {o: (top == 2 * pair + o).float().mean().item() for o in offsets}
        at = min(offsets, key=lambda o: (round(ranks[o], 1), -hits[o]))      # best rank (to 0.1), then most top scores
        hit = hits[at]
        contrast = (own[at].mean() / stored[at][others].mean()).item()
        keys = torch.nn.functional.normalize(k[:, 2 * torch.arange(n_pairs) + at, h].float(), dim=-1)  # [B, pairs, K]
        overlap = (keys @ keys.transpose(1, 2))[:, off_diag].pow(2).mean().item()
        out.append({"at": at, "hit": hit, "rank": ranks[at], "contrast": contrast, "overlap": overlap,
                    "K": k.shape[-1]})
    return out


def study(run, n_seqs=16, seed=123):
    """[(layer, kind, [per-head stats])] of one run's model on n_seqs fresh sequences of its MQAR setting."""
    model, cfg = load_model(run)
    if cfg.data.kind != "mqar":
        raise ValueError(f"{run}: trained on data.kind {cfg.data.kind!r}; this study reads MQAR models")
    P, T = cfg.data.n_pairs, cfg.train.seq_len
    x, y, _ = mqar_batch(n_seqs, T, P, cfg.data.mqar_vocab or cfg.model.vocab_size, seed)
    calls = capture_ops(model, x)
    if not calls:
        raise ValueError(f"{run}: no layer of softmax, linear or delta-rule attention (pattern {cfg.model.pattern})")
    rows = []
    for layer, name, args, kwargs in calls:
        mixer = model.blocks[layer].mixer.cfg
        M, k = effective_attention(name, args, kwargs), args[1]
        k = k.repeat_interleave(M.shape[1] // k.shape[2], dim=2)             # grouped k/v heads -> per query head
        rows.append((layer, mixer.kind, head_stats(M, k, x, y, P, max(getattr(mixer, "conv_size", 0), 2))))
    return rows, (T, P)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (their latest checkpoint) or checkpoint files")
    p.add_argument("--n_seqs", type=int, default=16, help="fresh MQAR sequences per run")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--min_hit", type=float, default=0.0,
                   help="list only heads whose queries find their pair at least this often (a run with none: the head where the pairs rank highest)")
    args = p.parse_args(argv)
    lines = ["| run | setting | layer.head (kind) | pair i stored at | queries whose top score is their pair "
             "| their pair's mean rank (0: top) | contrast | key overlap cos^2 (random: 1/K) |", "|" + "---|" * 8]
    try:
        for run in args.runs:
            rows, (T, P) = study(run, args.n_seqs, args.seed)
            heads = [(layer, kind, h, s) for layer, kind, stats in rows for h, s in enumerate(stats)]
            shown = [r for r in heads if r[3]["hit"] >= args.min_hit] or [min(heads, key=lambda r: r[3]["rank"])]
            for layer, kind, h, s in shown:
                lines.append(f"| {run} | T={T} / {P} pairs | {layer}.{h} ({kind}) | 2i + {s['at']} | {s['hit']:.3f} "
                             f"| {s['rank']:.1f} of {P} | {s['contrast']:.1f} | {s['overlap']:.3f} ({1 / s['K']:.3f}) |")
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
