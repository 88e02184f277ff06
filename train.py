"""Train a hybrid language model, on one process or many (torchrun: DDP or FSDP2).

    python train.py                                   # the embedded default (configs/default.yaml)
    python train.py configs/kimi_linear.yaml --train.max_steps=200 --model.n_layer=4
    python train.py configs/x.yaml --resume           # continue from the latest checkpoint in out_dir
    python train.py configs/x.yaml --resume=path/to/ckpt.pt
    torchrun --standalone --nproc_per_node=8 train.py configs/x.yaml [--train.parallel=fsdp]

train.batch_size is the GLOBAL micro-batch: each of the W ranks reads batch_size / W sequences of it,
so a run gives the same losses on 1, 2 or 8 ranks. Only rank 0 prints and writes files.
train.context_parallel=N: every N consecutive ranks share each sequence (context_parallel.py), the
W / N groups split the batch as above: a 2-D data x context layout.

Writes <out_dir>/metrics.jsonl (one JSON object per log or eval step) and <out_dir>/ckpt_<step>.pt
(the last train.keep_last of them). SIGTERM or SIGUSR1: the current step finishes, a checkpoint is
saved, the process exits 0 (resume with --resume).
"""
import contextlib
import glob
import json
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import cost
from config import check_world, from_raw, load_config, split_args
from data import make_dataset
from data.tokens import DataError, atomic_write
from model import GPT, ConfigError

USAGE = __doc__
CKPT_VERSION = 2


def lr_at(step, tc):
    """Linear warmup to tc.lr, then cosine decay to tc.lr * tc.min_lr_ratio at max_steps."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------------------------
# Optimizers


def param_roles(model, tc, muon=None):
    """name -> 'muon' | 'decay' | 'no_decay' (decided on the unsharded model: FSDP drops attributes).

    Muon takes the 2-D hidden matrices (parameters of the blocks); AdamW takes the embedding/head,
    norms, biases, sinks, gate scalars and anything flagged `no_weight_decay` (decay on matrices only)."""
    muon = tc.optimizer == "muon" if muon is None else muon
    roles = {}
    for name, p in model.named_parameters():
        flagged = getattr(p, "no_weight_decay", False)
        if muon and name.startswith("blocks.") and p.dim() == 2 and not flagged:
            roles[name] = "muon"
        elif p.dim() >= 2 and not flagged:
            roles[name] = "decay"
        else:
            roles[name] = "no_decay"
    return roles


def make_optimizers(model, tc, roles):
    """[AdamW] or [Muon, AdamW]. Each group keeps its peak lr in 'base_lr' (the schedule scales it)."""
    by_role = {"muon": [], "decay": [], "no_decay": []}
    for name, p in model.named_parameters():
        by_role[roles[name]].append(p)
    adamw = torch.optim.AdamW(
        [{"params": by_role["decay"], "weight_decay": tc.weight_decay, "base_lr": tc.lr},
         {"params": by_role["no_decay"], "weight_decay": 0.0, "base_lr": tc.lr}],
        lr=tc.lr, betas=(tc.beta1, tc.beta2))
    if not by_role["muon"]:
        return [adamw]
    muon = torch.optim.Muon([{"params": by_role["muon"], "base_lr": tc.muon_lr}], lr=tc.muon_lr,
                            weight_decay=tc.weight_decay, momentum=0.95, nesterov=True)
    return [muon, adamw]


def make_optimizer(model, tc):
    """One AdamW over every parameter of a single-process model (for scripts with their own loop)."""
    return make_optimizers(model, tc, param_roles(model, tc, muon=False))[-1]


# ----------------------------------------------------------------------------------------------
# Devices and processes


def pick_device(name):
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name} asked for but CUDA is not available; use cpu or auto")
    return name


class Dist:
    """The process group: rank, world size, device. Single process when WORLD_SIZE is unset."""

    def __init__(self, tc):
        self.enabled = "WORLD_SIZE" in os.environ
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        device = pick_device(tc.device)
        if self.enabled and device.startswith("cuda"):
            device = f"cuda:{self.local_rank}"
            torch.cuda.set_device(self.local_rank)
        self.device = torch.device(device)
        if self.enabled and not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, device_id=self.device if self.device.type == "cuda" else None)
            self.owns_group = True
        else:
            self.owns_group = False
        self.main = self.rank == 0

    def barrier(self):
        if self.enabled:
            dist.barrier()

    def sum_(self, t):
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def gather(self, obj):
        """Every rank's obj, in rank order (a list of one without a process group)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self):
        if self.owns_group:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(path, state):
    """Atomic (temporary file, fsync, rename): a kill mid-save leaves the old checkpoint intact."""
    atomic_write(path, lambda f: torch.save(state, f))


def checkpoint_step(path):
    return int(os.path.basename(path)[5:-3])


def list_checkpoints(out_dir):
    paths = [p for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt")) if os.path.basename(p)[5:-3].isdigit()]
    return sorted(paths, key=checkpoint_step)


def latest_checkpoint(out_dir):
    paths = list_checkpoints(out_dir)
    return paths[-1] if paths else None


def prune_checkpoints(out_dir, keep_last):
    for p in list_checkpoints(out_dir)[:-keep_last]:
        os.remove(p)


def load_checkpoint(path):
    if not os.path.isfile(path):
        raise DataError(f"{path}: checkpoint not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt or not a checkpoint
        raise DataError(f"{path}: not a readable checkpoint ({type(e).__name__}); "
                        f"it may be truncated or corrupt") from None
    if not isinstance(ckpt, dict) or not {"model", "step", "config"} <= set(ckpt):
        raise DataError(f"{path}: not a training checkpoint (no model, step and config)")
    return ckpt


def _flatten(d, prefix):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_model_matches(path, ckpt, cfg, verbose=True):
    """A checkpoint resumes only into a model with the same weights (names and shapes), else it is
    refused naming the differing config keys. Settings that change no weight (dsa.stage, window,
    top_k, backend, ...) may change between runs, e.g. DSA's dense_warmup -> sparse; they are listed."""
    from dataclasses import asdict
    try:
        saved = from_raw(ckpt["config"]).model
    except ConfigError as e:
        raise DataError(f"{path}: the checkpoint's config is not valid for this code ({e})") from None
    if saved == cfg.model:
        return
    a, b = _flatten(asdict(saved), "model."), _flatten(asdict(cfg.model), "model.")
    diffs = [f"{k} {a.get(k)!r} in the checkpoint, {b.get(k)!r} here" for k in sorted(set(a) | set(b))
             if a.get(k) != b.get(k)]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in GPT(cfg.model).state_dict().items()}
    if shapes != {k: tuple(v.shape) for k, v in ckpt["model"].items()}:
        raise DataError(f"{path}: the checkpoint's model does not match this config ({'; '.join(diffs[:3])}"
                        f"{'; ...' if len(diffs) > 3 else ''}); resume with the model it was trained with")
    if verbose:
        print(f"note: resuming with changed model settings (same weights): {'; '.join(diffs)}")


def rng_state():
    """RNG states of this process as plain lists/tensors (loadable with weights_only=True)."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(mt), gauss],
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}


def set_rng_state(state):
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Metrics


def open_metrics(out_dir, resume_step):
    """metrics.jsonl for appending; on resume, rows past the checkpoint's step (written before a kill)
    and a torn last line are dropped first, so the file reads as one uninterrupted run."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if resume_step is not None and os.path.exists(path):
        keep = []
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= resume_step:
                    keep.append(line if line.endswith("\n") else line + "\n")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return open(path, "a")


class StopSignal:
    """SIGTERM / SIGUSR1 set a flag; the loop finishes its step, saves and exits 0."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.flag, self.old = False, {}
        for s in self.SIGNALS:
            try:
                self.old[s] = signal.signal(s, self.handle)
            except ValueError:  # not the main thread: no handlers
                pass

    def handle(self, signum, frame):
        self.flag = True

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)


# ----------------------------------------------------------------------------------------------
# Training


def _full(t):
    """A DTensor (FSDP) -> its full value; tensors pass through."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def print_cache_bytes(mcfg, dtype_bytes):
    """One line per distinct layer: its decode-cache bytes (cost.py's model), per token or constant."""
    for name in dict.fromkeys(mcfg.pattern[i % len(mcfg.pattern)] for i in range(mcfg.n_layer)):
        lc = mcfg.layers[name]
        one, two = (cost.mixer_cost(lc, mcfg.d_model, 1, ctx, dtype_bytes)["cache_bytes"] for ctx in (1, 2))
        if one == two:
            print(f"cache: {name} ({lc.kind}) {one:,.0f} bytes/layer whatever the context")
        else:
            window = getattr(lc, "window", None)
            cap = f", at most {window} tokens" if window else ""
            print(f"cache: {name} ({lc.kind}) {two - one:,.0f} bytes/token/layer ({dtype_bytes}-byte){cap}")


def train(cfg, resume=None, quiet=False, stop_at=None):
    """Run training for `cfg`; returns the final metrics dict. stop_at: stop after that step (as if
    interrupted: the schedule still runs to max_steps). Under torchrun every rank calls this."""
    tc = cfg.train
    check_world(tc, int(os.environ.get("WORLD_SIZE", 1)))
    pg = Dist(tc)
    try:
        return _train(cfg, pg, resume, quiet or not pg.main, stop_at)
    finally:
        pg.close()


def _train(cfg, pg, resume, quiet, stop_at):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_optimizer_state_dict)
    tc, device = cfg.train, pg.device
    fsdp = pg.enabled and tc.parallel == "fsdp"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    # data: the stdlib corpus is written once per node (local rank 0), the others wait
    if cfg.data.kind == "stdlib" and pg.enabled:
        if pg.local_rank == 0:
            from data.stdlib import prepare_stdlib
            prepare_stdlib(cfg.data.dir, quiet=quiet)
        pg.barrier()
    n_cp = tc.context_parallel  # ranks d*n_cp .. d*n_cp+n_cp-1 share the rows of data rank d
    data = make_dataset(cfg, pg.rank // n_cp, pg.world // n_cp)
    cp = None
    if n_cp > 1:  # every rank creates every group, in the same order; its own is a separate communicator
        from context_parallel import ContextParallel, SplitRows
        groups = [dist.new_group(list(range(d, d + n_cp))) for d in range(0, pg.world, n_cp)]
        cp = ContextParallel(groups[pg.rank // n_cp])

    # the checkpoint to resume from: chosen by rank 0, read by every rank (out_dir must be shared)
    ckpt, path = None, None
    if resume:
        path = (latest_checkpoint(tc.out_dir) if resume is True else resume) if pg.main else None
        path = pg.broadcast(path)
        if path is None:
            raise DataError(f"{tc.out_dir}: no checkpoint to resume from (ckpt_*.pt)")
        ckpt = load_checkpoint(path)
        check_model_matches(path, ckpt, cfg, verbose=pg.main and not quiet)

    torch.manual_seed(tc.seed)  # same init on every rank
    module = GPT(cfg.model).to(device)
    n_params = module.num_params()
    if ckpt is not None:  # weights before sharding/wrapping: FSDP shards what is loaded
        try:
            module.load_state_dict(ckpt["model"])
        except RuntimeError:
            raise DataError(f"{path}: the checkpoint's weights do not fit this config's model") from None
    roles = param_roles(module, tc)
    fwd = module
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (pg.world,))
        for block in module.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        fwd = torch.compile(module) if tc.compile else module
    else:
        if tc.compile:
            fwd = torch.compile(module)
        if pg.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP
            fwd = DDP(fwd, device_ids=[device.index] if device.type == "cuda" else None)
    optimizers = make_optimizers(module, tc, roles)
    sd_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    step, tokens_seen, skipped = 0, 0, 0
    if ckpt is not None:
        try:
            set_optimizer_state_dict(module, optimizers, ckpt["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        except (KeyError, ValueError, RuntimeError) as e:
            raise DataError(f"{path}: the optimizer state does not fit (train.optimizer={tc.optimizer}?): "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        for opt in optimizers:  # the peak lrs come from this config, not the checkpoint
            for group in opt.param_groups:
                group["base_lr"] = tc.muon_lr if isinstance(opt, torch.optim.Muon) else tc.lr
        same_world = ckpt.get("world_size") == pg.world and ckpt.get("context_parallel", 1) == n_cp
        data.load_state_dict(ckpt["data_per_rank"][pg.rank] if same_world and "data_per_rank" in ckpt
                             else ckpt["data"])
        rngs = ckpt.get("rng")
        if isinstance(rngs, list) and rngs:
            set_rng_state(rngs[pg.rank] if same_world else rngs[0])
        elif torch.is_tensor(rngs):  # version 1 checkpoints
            torch.set_rng_state(rngs)
        step, tokens_seen, skipped = ckpt["step"], ckpt.get("tokens", 0), ckpt.get("skipped_steps", 0)
        del ckpt

    if pg.main:
        os.makedirs(tc.out_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(tc.out_dir, "ckpt_*.pt.tmp*")):  # left by a kill mid-save
            os.remove(stale)
        if not resume and list_checkpoints(tc.out_dir) and not quiet:
            print(f"warning: {tc.out_dir} already holds checkpoints of an earlier run; --resume continues "
                  f"from the latest one, this fresh run will replace them as it saves")
    pg.barrier()
    if not quiet:
        kinds = ", ".join(c.kind for c in cfg.model.layer_configs())
        par = f", {pg.world} ranks ({tc.parallel})" if pg.enabled else ""
        if cp is not None:
            par += f", {pg.world // n_cp} data x {n_cp} context"
        print(f"model: {n_params / 1e6:.2f}M parameters, {cfg.model.n_layer} layers ({kinds}), device "
              f"{device.type}{par}, optimizer {tc.optimizer}" + (f", resumed at step {step}" if step else ""))
        print_cache_bytes(cfg.model, next(module.parameters()).element_size())
    log = open_metrics(tc.out_dir, step if resume else None) if pg.main else None

    def write(row):
        if log is not None:
            log.write(json.dumps(row) + "\n")
            log.flush()

    def checkpoint():
        model_sd = get_model_state_dict(module, options=sd_opts)  # collective under FSDP
        optim_sd = get_optimizer_state_dict(module, optimizers, options=sd_opts)
        rngs, positions = pg.gather(rng_state()), pg.gather(data.state_dict())
        if pg.main:
            save_checkpoint(os.path.join(tc.out_dir, f"ckpt_{step}.pt"), {
                "version": CKPT_VERSION, "model": model_sd, "optimizer": optim_sd, "step": step,
                "tokens": tokens_seen, "skipped_steps": skipped, "config": cfg.raw, "world_size": pg.world,
                "context_parallel": n_cp,
                "parallel": tc.parallel if pg.enabled else "none", "data": positions[0],
                "data_per_rank": positions, "rng": rngs})
            prune_checkpoints(tc.out_dir, tc.keep_last)
        pg.barrier()

    def evaluate():
        module.eval()
        # text: long rows are evaluated under CP too (the loss shares average to the mean below);
        # mqar reads logits against whole rows (short synthetic rows): every rank runs them whole
        evaluated = module if cp is None or cfg.data.kind == "mqar" else SplitRows(module, cp)
        with autocast():
            metrics = data.evaluate(evaluated, tc.eval_batches, device)
        module.train()
        keys = sorted(metrics)  # every rank evaluated its slice of the same global batches
        vals = pg.sum_(torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)) / pg.world
        metrics = dict(zip(keys, vals.tolist()))
        write({"step": step, **metrics})
        return metrics

    def sync_grads(last):
        """Gradient all-reduce / reduce-scatter only on the last micro-step."""
        if fsdp:
            module.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if pg.enabled and not last:
            return fwd.no_sync()
        return contextlib.nullcontext()

    flops_per_token = cost.train_flops_per_token(cfg.model, tc.seq_len)
    peak = cost.peak_flops(device)
    tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum  # global
    params = [p for p in module.parameters()]
    stopper = StopSignal()
    bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", disable=quiet, dynamic_ncols=True)
    metrics, t_last, loss_sum, n_sum, n_steps, bad_in_row = {}, time.time(), 0.0, 0, 0, 0
    aux_sums = {}
    module.train()
    try:
        while step < tc.max_steps:
            factor = lr_at(step, tc) / tc.lr
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["base_lr"] * factor
            loss_acc, aux = torch.zeros((), device=device), {}
            for micro in range(tc.grad_accum):
                x, y, *packed = data.next_batch()  # data.pack: x, y [1, B*T] and their cu_seqlens
                kw = {"cu_seqlens": packed[0].to(device)} if packed else {}
                if cp is not None:  # this rank's two pieces of every row
                    x, y, kw = cp.split(x), cp.split(y), {"cp": cp}
                with sync_grads(micro == tc.grad_accum - 1):
                    with autocast():
                        _, loss = fwd(x.to(device, non_blocking=True), y.to(device, non_blocking=True), **kw)
                    (loss / tc.grad_accum).backward()
                loss_acc += getattr(module, "lm_loss", loss).detach().float() / tc.grad_accum  # LM part only
                for name, value in getattr(module, "aux_losses", {}).items():
                    aux[name] = aux.get(name, 0.0) + value.detach().float() / tc.grad_accum
            # one all-reduce per step: the mean loss over the global batch, aux losses, the stop flag
            names = sorted(aux)
            stats = torch.stack([loss_acc, *[aux[n] for n in names],
                                 torch.tensor(float(stopper.flag), device=device)]).double()
            stats = pg.sum_(stats).tolist()
            step_loss = stats[0] / pg.world
            step_aux = {n: v / pg.world for n, v in zip(names, stats[1:-1])}
            stop_now = stats[-1] > 0
            grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(
                params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))))
            if math.isfinite(step_loss) and math.isfinite(grad_norm):
                for opt in optimizers:
                    opt.step()
                bad_in_row = 0
                loss_sum, n_sum = loss_sum + step_loss, n_sum + 1
                for n, v in step_aux.items():
                    aux_sums[n] = aux_sums.get(n, 0.0) + v
            else:  # skip the update; a run of them stops the run
                skipped, bad_in_row = skipped + 1, bad_in_row + 1
                if not quiet:
                    bar.write(f"step {step + 1}: loss {step_loss}, grad norm {grad_norm}: update skipped")
                if bad_in_row >= tc.max_bad_steps:
                    raise FloatingPointError(
                        f"loss or gradient not finite for {bad_in_row} steps in a row (steps "
                        f"{step + 2 - bad_in_row}..{step + 1}, train.max_bad_steps={tc.max_bad_steps}); "
                        f"lower train.lr or check the data")
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            step += 1
            n_steps += 1
            tokens_seen += tokens_per_step
            bar.update(1)
            if step % tc.log_interval == 0 or step == tc.max_steps:
                dt = time.time() - t_last
                tok_s = n_steps * tokens_per_step / dt
                util = cost.mfu(flops_per_token, tok_s, pg.world, peak)
                row = {"step": step, "loss": loss_sum / n_sum if n_sum else None, "lr": lr_at(step - 1, tc),
                       "tokens_per_s": tok_s, "mfu": util, "grad_norm": grad_norm, "tokens": tokens_seen,
                       "skipped_steps": skipped,
                       **({n: v / n_sum for n, v in aux_sums.items()} if n_sum else {})}
                write(row)
                post = {"loss": f"{row['loss']:.4f}" if n_sum else "nan", "tok_s": f"{tok_s:.0f}"}
                if util is not None:
                    post["mfu"] = f"{100 * util:.1f}%"
                bar.set_postfix(post)
                t_last, loss_sum, n_sum, n_steps, aux_sums = time.time(), 0.0, 0, 0, {}
            if step % tc.eval_interval == 0 or step == tc.max_steps:
                metrics = evaluate()
                if not quiet:
                    bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            if step % tc.ckpt_interval == 0 or step == tc.max_steps or step == stop_at or stop_now:
                checkpoint()
            if stop_now:
                if not quiet:
                    bar.write(f"stopped by a signal after step {step}; checkpoint saved, resume with --resume")
                break
            if step == stop_at:
                break
    finally:
        stopper.restore()
        bar.close()
        if log is not None:
            log.close()
    if (cfg.data.kind != "mqar" and tc.sample_tokens and not quiet and not fsdp and cfg.model.vocab_size >= 257
            and step == tc.max_steps):
        from data.stdlib import decode, encode  # byte-level corpus
        module.eval()
        prompt = torch.tensor([encode("def ")], device=device)
        with autocast():
            out = module.generate(prompt, tc.sample_tokens, temperature=0.8, top_k=50)
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
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
