"""Train a hybrid language model.

    python train.py                                   # the embedded default (configs/default.yaml)
    python train.py configs/kimi_linear.yaml --train.max_steps=200 --model.n_layer=4
    python train.py configs/x.yaml --resume           # continue from the latest checkpoint in out_dir
    python train.py configs/x.yaml --resume=path/to/ckpt.pt

Writes <out_dir>/metrics.jsonl (one JSON object per log or eval step) and <out_dir>/ckpt_<step>.pt.
"""
import glob
import json
import math
import os
import sys
import time

import torch
from tqdm import tqdm

from config import load_config, split_args
from data import make_dataset
from data.tokens import DataError
from model import GPT, ConfigError

USAGE = __doc__


def lr_at(step, tc):
    """Linear warmup to tc.lr, then cosine decay to tc.lr * tc.min_lr_ratio at max_steps."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model, tc):
    """AdamW; weight decay on matrices only (not on norms, biases, sinks, gate scalars)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not getattr(p, "no_weight_decay", False)]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or getattr(p, "no_weight_decay", False)]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2))


def pick_device(name):
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name} asked for but CUDA is not available; use cpu or auto")
    return name


def save_checkpoint(path, state):
    """Atomic: write a temporary file, fsync, rename. A kill mid-save leaves the old file intact."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(out_dir):
    paths = glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
    return max(paths, key=lambda p: int(os.path.basename(p)[5:-3])) if paths else None


def load_checkpoint(path):
    if not os.path.isfile(path):
        raise DataError(f"{path}: checkpoint not found")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt or not a checkpoint
        raise DataError(f"{path}: not a readable checkpoint ({type(e).__name__}); "
                        f"it may be truncated or corrupt") from None


def print_cache_bytes(mcfg, model):
    """One line per distinct layer: decode-cache bytes per token per layer at the weights' dtype."""
    names = [mcfg.pattern[i % len(mcfg.pattern)] for i in range(mcfg.n_layer)]
    dtype = next(model.parameters()).dtype
    for name in dict.fromkeys(names):
        mixer = model.blocks[names.index(name)].mixer
        per_token = mixer.cache_bytes_per_token(dtype)
        if per_token == 0:
            state = mixer.new_cache(1, 1, "cpu", dtype).nbytes()
            print(f"cache: {name} ({mixer.cfg.kind}) {state} bytes/layer whatever the context (fp32 state)")
        else:
            window = getattr(mixer.cfg, "window", None)
            cap = f", at most {window} tokens" if window else ""
            print(f"cache: {name} ({mixer.cfg.kind}) {per_token} bytes/token/layer ({dtype}){cap}")


def train(cfg, resume=None, quiet=False, stop_at=None):
    """Run training for `cfg`; returns the final metrics dict. stop_at: stop after that step (as if
    interrupted: the schedule still runs to max_steps)."""
    tc = cfg.train
    device = pick_device(tc.device)
    torch.manual_seed(tc.seed)
    model = GPT(cfg.model).to(device)
    data = make_dataset(cfg)
    optimizer = make_optimizer(model, tc)
    os.makedirs(tc.out_dir, exist_ok=True)
    step = 0
    if resume:
        path = latest_checkpoint(tc.out_dir) if resume is True else resume
        if path is None:
            raise DataError(f"{tc.out_dir}: no checkpoint to resume from (ckpt_*.pt)")
        ckpt = load_checkpoint(path)
        try:
            model.load_state_dict(ckpt["model"])
        except RuntimeError:
            raise DataError(f"{path}: the checkpoint's weights do not fit this config's model") from None
        optimizer.load_state_dict(ckpt["optimizer"])
        data.load_state_dict(ckpt["data"])
        torch.set_rng_state(ckpt["rng"])
        step = ckpt["step"]
    if not quiet:
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, {cfg.model.n_layer} layers "
              f"({', '.join(c.kind for c in cfg.model.layer_configs())}), device {device}")
        print_cache_bytes(cfg.model, model)
    log = open(os.path.join(tc.out_dir, "metrics.jsonl"), "a")

    def checkpoint():
        save_checkpoint(os.path.join(tc.out_dir, f"ckpt_{step}.pt"), {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "config": cfg.raw, "data": data.state_dict(), "rng": torch.get_rng_state()})

    def evaluate():
        model.eval()
        metrics = data.evaluate(model, tc.eval_batches, device)
        model.train()
        log.write(json.dumps({"step": step, **metrics}) + "\n")
        log.flush()
        return metrics

    tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum
    bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", disable=quiet, dynamic_ncols=True)
    metrics, t_last, loss_sum, n_sum = {}, time.time(), 0.0, 0
    model.train()
    while step < tc.max_steps:
        lr = lr_at(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss, aux = 0.0, {}
        for _ in range(tc.grad_accum):
            x, y = data.next_batch()
            _, loss = model(x.to(device), y.to(device))
            (loss / tc.grad_accum).backward()
            step_loss += getattr(model, "lm_loss", loss).item() / tc.grad_accum  # `loss` logs the LM part; aux losses apart
            for name, value in getattr(model, "aux_losses", {}).items():
                aux[name] = aux.get(name, 0.0) + value.item() / tc.grad_accum
        if not math.isfinite(step_loss + sum(aux.values())):
            raise FloatingPointError(f"loss is {step_loss} (aux {aux}) at step {step}; lower train.lr or check the data")
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_sum, n_sum = loss_sum + step_loss, n_sum + 1
        bar.update(1)
        if step % tc.log_interval == 0 or step == tc.max_steps:
            dt = time.time() - t_last
            tok_s = n_sum * tokens_per_step / dt
            row = {"step": step, "loss": loss_sum / n_sum, "lr": lr, "tokens_per_s": tok_s, **aux}
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{tok_s:.0f}")
            t_last, loss_sum, n_sum = time.time(), 0.0, 0
        if step % tc.eval_interval == 0 or step == tc.max_steps:
            metrics = evaluate()
            if not quiet:
                bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if step % tc.ckpt_interval == 0 or step == tc.max_steps or step == stop_at:
            checkpoint()
        if step == stop_at:
            break
    bar.close()
    log.close()
    if cfg.data.kind != "mqar" and tc.sample_tokens and not quiet:
        from data.stdlib import decode, encode
        if cfg.model.vocab_size >= 257:  # byte-level corpus
            model.eval()
            prompt = torch.tensor([encode("def ")], device=device)
            out = model.generate(prompt, tc.sample_tokens, temperature=0.8, top_k=50)
            print("\nsample:\n" + decode(out[0].tolist()))
    return metrics


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path, overrides, rest = split_args(argv)
    resume = None
    for a in rest:
        if a in ("-h", "--help"):
            print(USAGE)
            return 0
        if a == "--resume":
            resume = True
        elif a.startswith("--resume="):
            resume = a.split("=", 1)[1]
        else:
            print(f"error: unknown argument {a!r}; see python train.py --help", file=sys.stderr)
            return 2
    try:
        cfg = load_config(path, overrides)
        train(cfg, resume)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
