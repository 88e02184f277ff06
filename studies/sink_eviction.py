"""Where the cost of evicting the first tokens comes from (issue 16): why window-only eviction collapses
one model that parks attention on position 0 and barely hurts another that parks as much.

For each run's last checkpoint, on the streams evals.eval_streaming decodes (factor x the training length,
its seeds), two evicting caches are compared: the first n_sinks tokens + the window ("sinks") and the
window alone ("window"). Per global attention layer it prints
- how far the window moves the residual entering the layer and the layer's attention output, relative to
  the residual's norm (mean over the tokens past the budget, where the two caches differ);
- the perplexity when only that layer evicts the first tokens (every other layer keeps them), beside
  the window in every layer, the first tokens in every layer, and the first tokens kept as keys whose
  values read as zero (do the heads need what the sink holds, or only a place to park?);
- the norm of the residual entering it at position 0 over the other positions' (a "massive activation");
and for the layer that parks most (the largest share on position 0), per head: the share on position 0,
how large the head's output is (|W_o^h o_h| with the first tokens kept, relative to the residual), how much
the window changes it, the value it reads from position 0 against the other positions (|W_o^h v_0| /
mean_j |W_o^h v_j|, on sequences of the training length; a drained sink is near 0) and how large the other
positions' values are (mean_j |W_o^h v_j| over the residual's norm): a parked head with small values
writes little wherever its attention goes. --over_training: the parked heads and their value sizes at
every checkpoint.

    python studies/sink_eviction.py runs/streaming_long/global_bos_lr1e-2_h32_4k \
        runs/streaming_long/global_bos_lr3e-3_h32_4k --budget 16 --factor 4 --n_seqs 8
"""
import argparse
import contextlib
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import evals  # noqa: E402
from data.tokens import DataError  # noqa: E402
from sample import load_model  # noqa: E402
from studies.attention_sinks import checkpoints  # noqa: E402


@contextlib.contextmanager
def inputs_of(modules):
    """Within the block: {key: [the first argument of each call]} of the modules {key: module}."""
    seen = {key: [] for key in modules}
    hooks = [m.register_forward_hook(lambda mod, a, out, key=key: seen[key].append(a[0])) for key, m in modules.items()]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def decode(model, x, budget, n_sinks):
    """evals.streaming_logits, recording -> (logits, {("h", layer): the residual entering the layer,
    ("o", layer): every head's attention output before W_o, ("h", "final"): the residual entering the last
    norm}), tensors [B, L, ...]."""
    layers = evals.global_layers(model)
    modules = ({("h", i): model.blocks[i].norm1 for i in layers} | {("o", i): model.blocks[i].mixer.wo for i in layers}
               | {("h", "final"): model.norm_f})
    with inputs_of(modules) as seen:
        logits = evals.streaming_logits(model, x, budget, n_sinks)
    return logits, {key: torch.cat(steps, 1) for key, steps in seen.items()}


def block_inputs(model, x):
    """{layer: the residual entering it [B, T, d_model]} in a forward over x."""
    with inputs_of({i: b.norm1 for i, b in enumerate(model.blocks)}) as seen:
        model(x)
    return {i: calls[0] for i, calls in seen.items()}


def perplexity(logits, y):
    return math.exp(min(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-1).item(), 50.0))


def moved(a, b):
    """Mean over tokens of |a - b| / |b| (a, b [..., d_model])."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item()


def head_outputs(mixer, o):
    """o [B, L, Hq*D] -> each head's share of the layer's output W_o^h o_h [B, L, Hq, d_model]."""
    Hq, D = mixer.cfg.n_heads, mixer.cfg.head_dim
    w = mixer.wo.weight.view(-1, Hq, D)                                     # [d_model, Hq, D]
    return torch.einsum("blhd,mhd->blhm", o.view(*o.shape[:2], Hq, D), w)


def value_sizes(block, h):
    """Per head of block's attention, on the residual h [B, T, d_model] entering it (values are not
    rotated, so |W_o^h v_j| is what the head writes when it reads key j alone): |W_o^h v_0| / mean over
    j >= 1 of |W_o^h v_j|, and that mean over the mean norm of h. -> two [Hq]."""
    mixer = block.mixer
    v = mixer.wv(block.norm1(h)).view(*h.shape[:2], mixer.cfg.n_kv_heads, mixer.cfg.head_dim)
    v = v.repeat_interleave(mixer.cfg.n_heads // mixer.cfg.n_kv_heads, 2)  # [B, T, Hq, D]
    wv = head_outputs(mixer, v.flatten(2)).norm(dim=-1)                    # [B, T, Hq]
    others = wv[:, 1:].mean((0, 1))
    return wv[:, 0].mean(0) / others, others / h[:, 1:].norm(dim=-1).mean()


def layer_rows(model, x, y, budget, n_sinks, sinks, window, inputs):
    """Per global layer: (layer, residual norm at position 0 / the others' (LLMs' sink token carries a
    "massive activation", hundreds of times the others, from the first layers on: Sun et al. 2024), the
    residual entering it moved by, its attention output moved by, perplexity with the window in it alone)."""
    layers, past = evals.global_layers(model), slice(budget, None)     # past: where the two caches differ
    rows = []
    for i in layers:
        norms = inputs[i].norm(dim=-1)
        h_s, h_w = sinks["h", i][:, past], window["h", i][:, past]
        wo = model.blocks[i].mixer.wo
        moved_out = ((wo(window["o", i][:, past]) - wo(sinks["o", i][:, past])).norm(dim=-1) / h_s.norm(dim=-1))
        keep = {j: torch.ones(model.blocks[j].mixer.cfg.n_heads, dtype=torch.bool) for j in layers if j != i}
        rows.append((i, (norms[:, 0].mean() / norms[:, 1:].mean()).item(), moved(h_w, h_s), moved_out.mean().item(),
                     perplexity(evals.streaming_logits(model, x, budget, n_sinks, keep), y)))
    return rows


def parking_heads(model, cfg, budget, sinks, window, inputs):
    """The global layer with the most attention on position 0 and, per head: its share there, what it
    writes with the first tokens kept and how much the window changes that (both over the norm of the
    residual entering the layer, mean over the tokens past the budget), and value_sizes."""
    layers, past = evals.global_layers(model), slice(budget, None)
    shares = {i: r["key0_heads"] for i, r in evals.layer_attention_shares(model, cfg, layers).items()}
    park = max(layers, key=lambda i: sum(shares[i]))
    mixer = model.blocks[park].mixer
    h = sinks["h", park][:, past].norm(dim=-1)[..., None]                   # [B, L', 1]
    c_s = head_outputs(mixer, sinks["o", park][:, past])
    c_w = head_outputs(mixer, window["o", park][:, past])
    ratio, value = value_sizes(model.blocks[park], inputs[park])
    return {"park": park, "shares": shares[park], "size": (c_s.norm(dim=-1) / h).mean((0, 1)).tolist(),
            "change": ((c_w - c_s).norm(dim=-1) / h).mean((0, 1)).tolist(), "ratio": ratio.tolist(),
            "value": value.tolist()}


@torch.no_grad()
def study(folder, budget, n_sinks, factor, n_seqs, top):
    step, path = checkpoints(folder)[-1]
    model, cfg = load_model(path)
    model.eval()
    if not evals._is_text(cfg):
        raise DataError(f"{folder}: a text model is needed (this one trains on {cfg.data.kind})")
    if not evals.global_layers(model):
        raise DataError(f"{folder}: the model has no global softmax attention layer")
    x, y = evals._text_batch(cfg, n_seqs, int(factor * cfg.train.seq_len), offset=12345)
    logits_s, sinks = decode(model, x, budget, n_sinks)
    logits_w, window = decode(model, x, budget, 0)
    inputs = block_inputs(model, evals._text_batch(cfg, n_seqs, cfg.train.seq_len, offset=4242)[0])
    r = parking_heads(model, cfg, budget, sinks, window, inputs)
    r["heads"] = sorted(range(len(r["shares"])), key=lambda k: -r["shares"][k])[:top]
    return r | {"step": step, "ppl_sinks": perplexity(logits_s, y), "ppl_window": perplexity(logits_w, y),
                "ppl_zero": perplexity(evals.streaming_logits(model, x, budget, n_sinks, sink_values=False), y),
                "layers": layer_rows(model, x, y, budget, n_sinks, sinks, window, inputs),
                "moved_final": moved(window["h", "final"][:, budget:], sinks["h", "final"][:, budget:])}


@torch.no_grad()
def over_training(folder, park, n_seqs):
    """Markdown rows, one per checkpoint: layer `park`'s heads above 0.3 on position 0, their mean value
    size and position-0 ratio (value_sizes), and the value size over all the layer's heads."""
    lines = [f"{folder}: the parking layer over training (values over the norm of the residual entering it)", "",
             "| step | layer | heads > 0.3 | value of the others, those heads / all heads | position 0 / others, those heads |",
             "|---|---|---|---|---|"]
    for step, path in checkpoints(folder):
        model, cfg = load_model(path)
        model.eval()
        parked = torch.tensor(evals.layer_attention_shares(model, cfg, [park])[park]["key0_heads"]) > 0.3
        inputs = block_inputs(model, evals._text_batch(cfg, n_seqs, cfg.train.seq_len, offset=4242)[0])
        ratio, value = value_sizes(model.blocks[park], inputs[park])
        some = lambda t: f"{t[parked].mean():.3f}" if parked.any() else "-"  # noqa: E731
        lines.append(f"| {step} | {park} | {int(parked.sum())} | {some(value)} / {value.mean():.3f} | {some(ratio)} |")
    return "\n".join(lines) + "\n"


def table(folder, r, budget, n_sinks):
    lines = [f"{folder} (step {r['step']}), budget {budget}: perplexity {r['ppl_sinks']:.2f} with the "
             f"{n_sinks} first tokens in every layer, {r['ppl_window']:.2f} with the window alone in every layer, "
             f"{r['ppl_zero']:.2f} with the first tokens' keys kept and their values zeroed", "",
             "| layer | residual norm entering it, position 0 / others | residual entering it moved by | "
             "its attention output moved by | perplexity, window in this layer only |",
             "|---|---|---|---|---|"]
    lines += [f"| {i} | {m:.2f} | {a:.3f} | {b:.3f} | {p:.2f} |" for i, m, a, b, p in r["layers"]]
    lines.append(f"| output (before the last norm) | | {r['moved_final']:.3f} | | {r['ppl_window']:.2f} (every layer) |")
    lines += ["", f"layer {r['park']}, the {len(r['heads'])} heads with the most attention on position 0 "
              "(sizes and changes relative to the residual's norm):", "",
              "| head | share on position 0 | output with the first tokens | changed by the window | value of position 0 / others | "
              "value of the others |", "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {r['shares'][k]:.3f} | {r['size'][k]:.3f} | {r['change'][k]:.3f} | {r['ratio'][k]:.2f} | {r['value'][k]:.3f} |"
              for k in r["heads"]]
    parked = [k for k, s in enumerate(r["shares"]) if s > 0.3]
    if parked:
        mean = lambda xs: sum(xs[k] for k in parked) / len(parked)  # noqa: E731
        lines.append(f"| mean of the {len(parked)} heads > 0.3 | {mean(r['shares']):.3f} | {mean(r['size']):.3f} | "
                     f"{mean(r['change']):.3f} | {mean(r['ratio']):.2f} | {mean(r['value']):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders with ckpt_<step>.pt files (the last one is read)")
    p.add_argument("--budget", type=int, default=16, help="keys kept by the evicting caches")
    p.add_argument("--n_sinks", type=int, default=4, help="first tokens kept by sinks + window")
    p.add_argument("--factor", type=float, default=4, help="stream length in training lengths")
    p.add_argument("--n_seqs", type=int, default=8)
    p.add_argument("--top", type=int, default=8, help="heads listed for the layer that parks most")
    p.add_argument("--over_training", action="store_true",
                   help="also the parking layer's value sizes at every checkpoint")
    args = p.parse_args(argv)
    try:
        evals.check_options("streaming", {"budget": args.budget, "n_sinks": args.n_sinks, "factor": args.factor})
        for folder in args.runs:
            r = study(folder, args.budget, args.n_sinks, args.factor, args.n_seqs, args.top)
            print(table(folder, r, args.budget, args.n_sinks), flush=True)
            if args.over_training:
                print(over_training(folder, r["park"], args.n_seqs), flush=True)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
