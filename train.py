"""Train a hybrid language model, on one process or many (torchrun: DDP or FSDP2).

    python train.py                                   # the embedded default (configs/default.yaml)
    python train.py configs/kimi_linear.yaml --train.max_steps=200 --model.n_layer=4
    python train.py configs/x.yaml --resume           # continue from the latest checkpoint in out_dir
    python train.py configs/x.yaml --resume=path/to/ckpt.pt   # or a run folder: its latest checkpoint
    python train.py configs/x.yaml --overwrite        # start over in an out_dir holding another run
    torchrun --standalone --nproc_per_node=8 train.py configs/x.yaml [--train.parallel=fsdp]

train.batch_size is the GLOBAL micro-batch: each of the W ranks reads batch_size / W sequences of it,
so a run gives the same losses on 1, 2 or 8 ranks. Only rank 0 prints and writes files.
train.context_parallel=N: every N consecutive ranks share each sequence (context_parallel.py), the
W / N groups split the batch as above: a 2-D data x context layout.

Writes <out_dir>/metrics.jsonl (one JSON object per log or eval step) and <out_dir>/ckpt_<step>.pt
(the last train.keep_last of them). SIGTERM, SIGUSR1 or Ctrl-C: the current step finishes, a checkpoint
is saved, the process exits 0 (resume with --resume); a second Ctrl-C aborts at once (exit 130).
"""
import contextlib
import gc
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
import kernels
from config import check_world, from_raw, load_config, reaches, refuse_unused, split_args
from data import SYNTHETIC_KINDS, make_dataset
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


def target_reached(metrics, stop_at):
    """train.stop_at: True when every eval metric named there reached its target (accuracies from
    above, losses from below); False when stop_at is empty."""
    return bool(stop_at) and all(
        k in metrics and reaches(k, metrics[k], v) for k, v in stop_at.items())


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
        lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=True)   # fused: one kernel per step (CPU: 3x faster than the loop)
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


def pick_device(name, what="train.device"):
    """auto -> cuda if available else cpu; cuda without CUDA, or an unknown device, is a ConfigError."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"{what}: one of auto, cpu, cuda, cuda:N (got {name})")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{what}: {name} asked for but CUDA is not available; use cpu or auto")
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


def earlier_intact_checkpoint(out_dir, bad):
    """The latest checkpoint in out_dir before `bad` that loads, or None."""
    paths = [p for p in list_checkpoints(out_dir) if checkpoint_step(p) < checkpoint_step(bad)]
    for p in reversed(paths):
        try:
            load_checkpoint(p)
            return p
        except DataError:
            continue
    return None


def _flatten(d, prefix):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def refuse_compile_on_old_torch(mcfg, device):
    """train.compile with delta-rule layers on the torch backend needs torch >= 2.13: older ones compute that
    op's gradients wrongly under torch.compile (kernels/torch_delta_rule.py), so refuse rather than train on them."""
    from kernels.torch_delta_rule import _OLD_TORCH
    torch_path = mcfg.backend == "torch" or (mcfg.backend is None and device.type != "cuda")
    if _OLD_TORCH and torch_path and any(layer.kind in ("kda", "gdn") for layer in mcfg.layers.values()):
        raise ConfigError(f"train.compile: the delta-rule layers' torch path needs torch >= 2.13 under torch.compile "
                          f"(this is {torch.__version__}); set train.compile=false, or train on CUDA with the triton backend")


def check_model_matches(path, ckpt, cfg, verbose=True, what="resuming",
                        hint="resume with the model it was trained with"):
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
    a, b = (_flatten(dict(asdict(m), pattern=[m.pattern[i % len(m.pattern)] for i in range(m.n_layer)]), "model.")
            for m in (saved, cfg.model))  # a pattern and its cycled form are the same layers
    diffs = [f"{k} {a.get(k)!r} in the checkpoint, {b.get(k)!r} here" for k in sorted(set(a) | set(b))
             if a.get(k) != b.get(k)]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in GPT(cfg.model).state_dict().items()}
    if shapes != {k: tuple(v.shape) for k, v in ckpt["model"].items()}:
        raise DataError(f"{path}: the checkpoint's model does not match this config ({'; '.join(diffs[:3])}"
                        f"{'; ...' if len(diffs) > 3 else ''}); {hint}")
    if verbose and diffs:
        print(f"note: {what} with changed model settings (same weights): {'; '.join(diffs)}")


def init_weights_from(module, path, cfg, verbose=False):
    """train.init_from: a fresh run (step 0, new optimizer and data order) from a checkpoint's weights."""
    if os.path.isdir(path):
        folder, path = path, latest_checkpoint(path)
        if path is None:
            raise DataError(f"{folder}: no checkpoint (ckpt_*.pt) to initialise from (train.init_from)")
    ckpt = load_checkpoint(path)
    check_model_matches(path, ckpt, cfg, verbose, what="init_from",
                        hint="train.init_from needs a checkpoint of a model with the same weights (names and "
                        "shapes); set those keys as in the checkpoint")
    module.load_state_dict(ckpt["model"])


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
    and a torn last line are dropped first, so the file reads as one uninterrupted run. A fresh run
    (resume_step None) starts the file anew: rows of an earlier run are never mixed in."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if resume_step is None:
        return open(path, "w")
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
    """SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) set a flag; the loop finishes its step, saves and exits 0.
    A second Ctrl-C aborts at once (KeyboardInterrupt; the last checkpoint stays intact)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.flag, self.old = False, {}
        for s in self.SIGNALS:
            try:
                self.old[s] = signal.signal(s, self.handle)
            except ValueError:  # not the main thread: no handlers
                pass

    def handle(self, signum, frame):
        if signum == signal.SIGINT and self.flag:
            raise KeyboardInterrupt
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
        else:  # per token: cost.py's growth rate (a window caps attn; NSA's ring adds to a growing cache)
            window = getattr(lc, "window", None) if lc.kind == "attn" else None
            cap = f", at most {window} tokens" if window else ""
            per_token = cost.mixer_cost(lc, mcfg.d_model, 1, 1, dtype_bytes)["cache_bytes_per_token"] or two - one
            print(f"cache: {name} ({lc.kind}) {per_token:,.0f} bytes/token/layer ({dtype_bytes}-byte){cap}")


def train(cfg, resume=None, quiet=False, stop_at=None, overwrite=False):
    """Run training for `cfg`; returns the final metrics dict. stop_at: stop after that step (as if
    interrupted: the schedule still runs to max_steps). A fresh run (no resume) into an out_dir that
    holds checkpoints is refused unless overwrite (which deletes them). Under torchrun every rank
    calls this."""
    refuse_unused(cfg)
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    check_world(tc, int(os.environ.get("WORLD_SIZE", 1)))
    pg = Dist(tc)
    try:
        return _train(cfg, pg, resume, quiet, stop_at, overwrite)
    finally:
        gc.collect()  # the run's model in its reference cycles, whose FSDP mesh holds the gloo group: freed first
        pg.close()


def _train(cfg, pg, resume, quiet, stop_at, overwrite=False):
    """The loop: one optimizer step at a time, logging, evaluating and checkpointing on schedule.
    quiet: no output on any rank (otherwise rank 0 prints)."""
    run = Run(cfg, pg, resume, quiet or not pg.main, overwrite)
    loud = not quiet
    tc = cfg.train
    stopper = StopSignal()
    bar = tqdm(total=tc.max_steps, initial=run.step, desc="train", unit="step", disable=run.quiet,
               dynamic_ncols=True)
    metrics = {}
    try:
        while run.step < tc.max_steps:
            stop_now = run.train_step(stopper, bar)
            reached = False
            step = run.step
            bar.update(1)
            if step % tc.log_interval == 0 or step == tc.max_steps:
                run.log_train(bar)
            if step % tc.eval_interval == 0 or step == tc.max_steps:
                metrics = run.evaluate()
                reached = target_reached(metrics, tc.stop_at)
                if not run.quiet:
                    bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) +
                              (f" (train.stop_at {tc.stop_at} reached: stopping)" if reached else ""))
            if step % tc.ckpt_interval == 0 or step == tc.max_steps or step == stop_at or stop_now or reached:
                run.checkpoint()
            if reached:
                break
            if stop_now:
                if not run.quiet:
                    bar.write(f"stopped by a signal after step {step}; checkpoint saved, resume with --resume")
                break
            if step == stop_at:
                break
    finally:
        stopper.restore()
        bar.close()
        run.close()
    if tc.sample_tokens and loud and run.step == tc.max_steps:
        run.print_sample()  # every rank takes part (FSDP gathers the weights); rank 0 prints
    return metrics


class Run:
    """One training run on this rank: setup (precision, data, resume checkpoint, model, optimizers,
    out_dir), then train_step / log_train / evaluate / checkpoint / print_sample, called by _train."""

    def __init__(self, cfg, pg, resume, quiet, overwrite=False):
        self.cfg, self.tc, self.pg, self.quiet, self.device = cfg, cfg.train, pg, quiet, pg.device
        self.fsdp = pg.enabled and self.tc.parallel == "fsdp"
        self.check_out_dir(resume, overwrite)
        self.setup_precision()
        self.data = self.setup_data()
        ckpt, path = self.find_checkpoint(resume)
        self.setup_model(ckpt, path)
        self.step, self.tokens_seen, self.skipped = 0, 0, 0
        if ckpt is not None:
            self.restore(ckpt, path)
            del ckpt
        self.setup_out_dir(resume)
        self.setup_counters()

    # -- setup ------------------------------------------------------------------------------------

    def check_out_dir(self, resume, overwrite):
        """Refuse (every rank, before any work) an out_dir that is a file or not writable, and a fresh
        run into one that holds another run's checkpoints (--resume continues it, --overwrite deletes)."""
        out = self.tc.out_dir
        problem = None
        if self.pg.main:
            existing = os.path.abspath(out)
            while not os.path.exists(existing):
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                problem = f"train.out_dir: {existing} is a file, not a folder; pick another train.out_dir"
            elif not os.access(existing, os.W_OK | os.X_OK):
                problem = f"train.out_dir: {existing} is not writable; pick another train.out_dir"
            elif not resume and list_checkpoints(out):
                if overwrite:
                    for p in list_checkpoints(out):
                        os.remove(p)
                else:
                    latest = os.path.basename(list_checkpoints(out)[-1])
                    problem = (f"train.out_dir: {out} already holds the checkpoints of another run (latest "
                               f"{latest}); continue it with --resume, start over with --overwrite (deletes "
                               f"them), or pick another train.out_dir")
        problem = self.pg.broadcast(problem)
        if problem:
            raise DataError(problem)

    def setup_precision(self):
        """TF32 on CUDA; bf16 autocast when train.precision asks for it (auto: on CUDA)."""
        tc, device = self.tc, self.device
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
        self.autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16
                         else contextlib.nullcontext)

    def setup_data(self):
        """This rank's loader; the stdlib corpus is written once per node (local rank 0), others wait."""
        cfg, pg = self.cfg, self.pg
        if cfg.data.kind == "stdlib" and pg.enabled:
            if pg.local_rank == 0:
                from data.stdlib import prepare_stdlib
                prepare_stdlib(cfg.data.dir, quiet=self.quiet)
            pg.barrier()
        n_cp = self.tc.context_parallel  # ranks d*n_cp .. d*n_cp+n_cp-1 share the rows of data rank d
        self.cp = None
        if n_cp > 1:  # every rank creates every group, in the same order; its own is a separate communicator
            from context_parallel import ContextParallel
            groups = [dist.new_group(list(range(d, d + n_cp))) for d in range(0, pg.world, n_cp)]
            self.cp = ContextParallel(groups[pg.rank // n_cp])
        return make_dataset(cfg, pg.rank // n_cp, pg.world // n_cp)

    def find_checkpoint(self, resume):
        """(ckpt, path) to resume from, or (None, None): chosen by rank 0, read by every rank
        (out_dir must be shared)."""
        if not resume:
            return None, None
        pg, tc = self.pg, self.tc
        folder = tc.out_dir if resume is True else resume if os.path.isdir(resume) else None  # a run folder: its latest
        path = (latest_checkpoint(folder) if folder else resume) if pg.main else None
        path = pg.broadcast(path)
        if path is None:
            raise DataError(f"{folder}: no checkpoint to resume from (ckpt_*.pt)")
        try:
            ckpt = load_checkpoint(path)
        except DataError as e:
            intact = earlier_intact_checkpoint(folder, path) if folder else None
            if intact is None:
                raise
            raise DataError(f"{e}; the earlier {intact} is intact: resume from it with --resume={intact} "
                            f"(and delete {path})") from None
        if "optimizer" not in ckpt:  # convert.py from-hf writes weights only
            raise DataError(f"{path}: holds weights only (no optimizer state or data position"
                            f"{', converted from ' + ckpt['converted_from'] if 'converted_from' in ckpt else ''}): "
                            f"it cannot be resumed; start a run from it with --train.init_from={path}")
        check_model_matches(path, ckpt, self.cfg, verbose=pg.main and not self.quiet)
        return ckpt, path

    def setup_model(self, ckpt, path):
        """self.module (the GPT), self.fwd (what the loop calls: compiled / DDP / FSDP) and the optimizers."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        tc, pg, device = self.tc, self.pg, self.device
        if not kernels.runs_on(self.cfg.model.backend, device):
            raise ConfigError(f"model.backend: triton runs on a CUDA device (or under TRITON_INTERPRET=1, Triton's slow "
                              f"interpreter); this run is on {device.type}: set model.backend to null (auto: triton on "
                              f"CUDA, torch elsewhere) or torch")
        torch.manual_seed(tc.seed)  # same init on every rank
        module = GPT(self.cfg.model).to(device)
        self.n_params = module.num_params()
        if ckpt is not None:  # weights before sharding/wrapping: FSDP shards what is loaded
            try:
                module.load_state_dict(ckpt["model"])
            except RuntimeError:
                raise DataError(f"{path}: the checkpoint's weights do not fit this config's model") from None
        elif tc.init_from:
            init_weights_from(module, tc.init_from, self.cfg, verbose=pg.main and not self.quiet)
        roles = param_roles(module, tc)
        if tc.compile:
            refuse_compile_on_old_torch(self.cfg.model, device)
        fwd = module
        if self.fsdp:
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
        self.module, self.fwd = module, fwd
        self.optimizers = make_optimizers(module, tc, roles)
        self.sd_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def restore(self, ckpt, path):
        """Optimizer state, data positions, RNG states and counters from a checkpoint."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        tc, pg = self.tc, self.pg
        self.check_settings_match(ckpt, path)
        try:
            set_optimizer_state_dict(self.module, self.optimizers, ckpt["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        except (KeyError, ValueError, RuntimeError) as e:
            raise DataError(f"{path}: the optimizer state does not fit (train.optimizer={tc.optimizer}?): "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        for opt in self.optimizers:  # the peak lrs come from this config, not the checkpoint
            for group in opt.param_groups:
                group["base_lr"] = tc.muon_lr if isinstance(opt, torch.optim.Muon) else tc.lr
        same_world = (ckpt.get("world_size") == pg.world
                      and ckpt.get("context_parallel", 1) == self.tc.context_parallel)
        try:
            self.data.load_state_dict(ckpt["data_per_rank"][pg.rank] if same_world and "data_per_rank" in ckpt
                                      else ckpt["data"])
        except DataError:  # names the problem itself
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path}: the saved data position does not fit this run's data ({type(e).__name__}: "
                            f"{e}); resume with the data settings the run was trained with") from None
        rngs = ckpt.get("rng")
        if isinstance(rngs, list) and rngs:
            set_rng_state(rngs[pg.rank] if same_world else rngs[0])
        elif torch.is_tensor(rngs):  # version 1 checkpoints
            torch.set_rng_state(rngs)
        self.step, self.tokens_seen, self.skipped = ckpt["step"], ckpt.get("tokens", 0), ckpt.get("skipped_steps", 0)

    def check_settings_match(self, ckpt, path):
        """A resumed run continues on its own data: another data.kind is refused (its loader position means
        nothing here). Other changed train / data settings are allowed (a longer max_steps, another lr) and
        listed, as the model's are."""
        from dataclasses import asdict
        saved = from_raw(ckpt["config"])                             # parses: check_model_matches has read it
        if saved.data.kind != self.cfg.data.kind:
            raise DataError(f"{path}: the run trained on data.kind={saved.data.kind} and this config has data.kind="
                            f"{self.cfg.data.kind}; resume it on its own data, or start a new run from its weights "
                            f"(--train.init_from={path})")
        a, b = ({**_flatten(asdict(c.train), "train."), **_flatten(asdict(c.data), "data.")} for c in (saved, self.cfg))
        diffs = [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
                 if a.get(k) != b.get(k) and k not in ("train.out_dir", "train.device")]
        if diffs and self.pg.main and not self.quiet:
            print(f"note: resuming with changed settings: {'; '.join(diffs)}")

    def setup_out_dir(self, resume):
        """out_dir made (rank 0), stale temporary files removed, the start-up report, metrics.jsonl opened."""
        tc, pg, cfg = self.tc, self.pg, self.cfg
        if pg.main:
            os.makedirs(tc.out_dir, exist_ok=True)
            for stale in glob.glob(os.path.join(tc.out_dir, "ckpt_*.pt.tmp*")):  # left by a kill mid-save
                os.remove(stale)
        pg.barrier()
        if not self.quiet:
            kinds = ", ".join(c.kind for c in cfg.model.layer_configs())
            par = f", {pg.world} ranks ({tc.parallel})" if pg.enabled else ""
            if self.cp is not None:
                par += f", {pg.world // tc.context_parallel} data x {tc.context_parallel} context"
            print(f"model: {self.n_params / 1e6:.2f}M parameters, {cfg.model.n_layer} layers ({kinds}), device "
                  f"{self.device.type}{par}, optimizer {tc.optimizer}"
                  + (f", resumed at step {self.step}" if self.step else ""))
            print_cache_bytes(cfg.model, next(self.module.parameters()).element_size())
            for note in getattr(self.data, "notes", ()):  # text shards too short for a batch
                print(note)
            if tc.compile:  # the bar stays at its first step meanwhile
                print(f"compile: torch.compile on {self.device.type}; the first step (and the first eval) compile the "
                      f"model first, which takes seconds to minutes (up to about 10 minutes a model on 2 CPU cores)")
        self.log = open_metrics(tc.out_dir, self.step if resume else None) if pg.main else None

    def setup_counters(self):
        tc = self.tc
        self.flops_per_token = cost.train_flops_per_token(self.cfg.model, tc.seq_len)
        self.peak = cost.peak_flops(self.device)
        self.tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum  # global
        self.params = [p for p in self.module.parameters()]
        self.t_last, self.loss_sum, self.n_sum, self.n_steps, self.bad_in_row = time.time(), 0.0, 0, 0, 0
        self.aux_sums, self.grad_norm, self.moe_stats = {}, None, {}
        self.module.train()

    def close(self):
        if self.log is not None:
            self.log.close()

    # -- one optimizer step -------------------------------------------------------------------------

    def sync_grads(self, last):
        """Gradient all-reduce / reduce-scatter only on the last micro-step."""
        if self.fsdp:
            self.module.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self.pg.enabled and not last:
            return self.fwd.no_sync()
        return contextlib.nullcontext()

    def train_step(self, stopper, bar):
        """grad_accum micro-steps, one all-reduce of the stats, clip, update (or skip a non-finite one).
        Returns whether any rank was asked to stop (stopper.flag, read after the micro-steps)."""
        tc, pg, device, module = self.tc, self.pg, self.device, self.module
        factor = lr_at(self.step, tc) / tc.lr
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * factor
        loss_acc, aux = torch.zeros((), device=device), {}
        for micro in range(tc.grad_accum):
            x, y, *packed = self.data.next_batch()  # data.pack: x, y [1, B*T] and their cu_seqlens
            kw = {"cu_seqlens": packed[0].to(device)} if packed else {}
            if self.cp is not None:  # this rank's two pieces of every row
                x, y, kw = self.cp.split(x), self.cp.split(y), {"cp": self.cp}
            with self.sync_grads(micro == tc.grad_accum - 1):
                with self.autocast():
                    _, loss = self.fwd(x.to(device, non_blocking=True), y.to(device, non_blocking=True), **kw)
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
        grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(
            self.params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))))
        if math.isfinite(step_loss) and math.isfinite(grad_norm):
            for opt in self.optimizers:
                opt.step()
            self.bad_in_row = 0
            self.loss_sum, self.n_sum = self.loss_sum + step_loss, self.n_sum + 1
            for n, v in step_aux.items():
                self.aux_sums[n] = self.aux_sums.get(n, 0.0) + v
        else:  # skip the update; a run of them stops the run
            self.skipped, self.bad_in_row = self.skipped + 1, self.bad_in_row + 1
            if not self.quiet:
                bar.write(f"step {self.step + 1}: loss {step_loss}, grad norm {grad_norm}: update skipped")
            if self.bad_in_row >= tc.max_bad_steps:
                raise FloatingPointError(
                    f"loss or gradient not finite for {self.bad_in_row} steps in a row (steps "
                    f"{self.step + 2 - self.bad_in_row}..{self.step + 1}, train.max_bad_steps={tc.max_bad_steps}); "
                    f"lower train.lr or check the data")
        self.moe_stats = self.module.update_router_biases(update=self.bad_in_row == 0)  # MoE bias, load
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.step += 1
        self.n_steps += 1
        self.tokens_seen += self.tokens_per_step
        self.grad_norm = grad_norm
        return stats[-1] > 0

    # -- logging, eval, checkpoint, sample ----------------------------------------------------------

    def write(self, row):
        if self.log is not None:
            try:
                self.log.write(json.dumps(row) + "\n")
                self.log.flush()
            except OSError as e:  # disk full, a folder that went away: one line, the checkpoints stay
                last = latest_checkpoint(self.tc.out_dir)
                raise DataError(f"{self.log.name}: could not be written ({e.strerror or e}) at step {self.step}; "
                                + (f"the last checkpoint, {os.path.basename(last)}, is intact (free space, then "
                                   f"--resume)" if last else "no checkpoint was saved yet")) from None

    def log_train(self, bar):
        """A metrics.jsonl row with the mean loss and throughput since the last one; the bar's postfix."""
        dt = time.time() - self.t_last
        tok_s = self.n_steps * self.tokens_per_step / dt
        util = cost.mfu(self.flops_per_token, tok_s, self.pg.world, self.peak)
        n_sum = self.n_sum
        row = {"step": self.step, "loss": self.loss_sum / n_sum if n_sum else None,
               "lr": lr_at(self.step - 1, self.tc), "tokens_per_s": tok_s, "mfu": util,
               "grad_norm": self.grad_norm, "tokens": self.tokens_seen, "skipped_steps": self.skipped,
               **self.moe_stats, **({n: v / n_sum for n, v in self.aux_sums.items()} if n_sum else {})}
        self.write(row)
        post = {"loss": f"{row['loss']:.4f}" if n_sum else "nan", "tok_s": f"{tok_s:.0f}"}
        if util is not None:
            post["mfu"] = f"{100 * util:.1f}%"
        bar.set_postfix(post)
        self.t_last, self.loss_sum, self.n_sum, self.n_steps, self.aux_sums = time.time(), 0.0, 0, 0, {}

    def evaluate(self):
        module, pg = self.module, self.pg
        module.eval()
        # text: long rows are evaluated under CP too (the loss shares average to the mean below);
        # synthetic tasks read logits against whole rows (short rows): every rank runs them whole
        evaluated = module
        if self.cp is not None and self.cfg.data.kind not in SYNTHETIC_KINDS:
            from context_parallel import SplitRows
            evaluated = SplitRows(module, self.cp)
        with self.autocast():
            metrics = self.data.evaluate(evaluated, self.tc.eval_batches, self.device)
        module.train()
        keys = list(metrics)  # the data's order (the same on every rank), e.g. an MQAR mixture's settings by length
        vals = pg.sum_(torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)) / pg.world
        metrics = dict(zip(keys, vals.tolist()))
        self.write({"step": self.step, **metrics})
        return metrics

    def checkpoint(self):
        """Full (unsharded) model and optimizer state, every rank's RNG and data position; rank 0 writes."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        tc, pg = self.tc, self.pg
        model_sd = get_model_state_dict(self.module, options=self.sd_opts)  # collective under FSDP
        optim_sd = get_optimizer_state_dict(self.module, self.optimizers, options=self.sd_opts)
        rngs, positions = pg.gather(rng_state()), pg.gather(self.data.state_dict())
        if pg.main:
            save_checkpoint(os.path.join(tc.out_dir, f"ckpt_{self.step}.pt"), {
                "version": CKPT_VERSION, "model": model_sd, "optimizer": optim_sd, "step": self.step,
                "tokens": self.tokens_seen, "skipped_steps": self.skipped, "config": self.cfg.raw,
                "world_size": pg.world, "context_parallel": tc.context_parallel,
                "parallel": tc.parallel if pg.enabled else "none",
                "data": positions[0], "data_per_rank": positions, "rng": rngs})
            prune_checkpoints(tc.out_dir, tc.keep_last)
        pg.barrier()

    def print_sample(self):
        """The end-of-training sample of a text corpus, decoded with the corpus's own tokenizer
        (bytes for stdlib; a prepared corpus's manifest names it); or a line saying why there is none.
        Under FSDP the full weights are gathered (every rank) and rank 0 samples from a plain copy."""
        from data import corpus_codec
        cfg = self.cfg
        if cfg.data.kind in SYNTHETIC_KINDS:
            return
        model = self.module
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            full = get_model_state_dict(self.module, options=self.sd_opts)  # collective
            if not self.pg.main:
                return
            model = GPT(cfg.model).to(self.device)
            model.load_state_dict(full)
        if not self.pg.main:
            return
        codec, why = corpus_codec(cfg)
        if codec is None:
            print(f"\nno sample: {why}")
            return
        encode, decode = codec
        model.eval()
        prompt = torch.tensor([encode("def " if cfg.data.kind == "stdlib" else "The ")], device=self.device)
        with self.autocast():
            out = model.generate(prompt, self.tc.sample_tokens, temperature=0.8, top_k=50)
        print("\nsample:\n" + decode(out[0].tolist()))


def report_error(message):
    """One `error: ...` line on stderr, from rank 0 only under torchrun; there it also goes into
    torchrun's error file, so the launcher's failure summary shows this line, not "To enable
    traceback see ..."."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    print(f"error: {message}", file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        data = {"message": {"message": f"error: {message}",
                            "extraInfo": {"py_callstack": f"error: {message}", "timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError):
            with open(error_file, "w") as f:
                json.dump(data, f)


def parse_args(argv):
    """(cfg, resume, overwrite) from the command line, or None for --help; ConfigError if bad."""
    path, overrides, rest = split_args(argv)
    resume, overwrite = None, False
    for a in rest:
        if a in ("-h", "--help"):
            print(USAGE)
            return None
        if a == "--resume":
            resume = True
        elif a.startswith("--resume="):
            resume = a.split("=", 1)[1]
        elif a == "--overwrite":
            overwrite = True
        else:
            hint = " (a config file ends in .yaml or .yml)" if not a.startswith("-") and path is None else ""
            raise ConfigError(f"unknown argument {a!r}{hint}; see python train.py --help")
    return load_config(path, overrides), resume, overwrite


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        parsed = parse_args(argv)
    except ConfigError as e:
        # the same on every rank: under torchrun rank 0 alone reports it and fails, the others leave
        # quietly, so the launcher's summary names one failure (rank 0's) with this line
        report_error(e)
        return 2 if int(os.environ.get("RANK", 0)) == 0 else 0
    if parsed is None:
        return 0
    try:
        train(*parsed[:2], overwrite=parsed[2])
    except (ConfigError, DataError) as e:
        report_error(e)
        return 2
    except FloatingPointError as e:
        report_error(e)
        return 1
    except KeyboardInterrupt:
        report_error("interrupted by a second Ctrl-C; the last checkpoint saved is intact (--resume)")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
