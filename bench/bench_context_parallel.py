"""Activation memory per rank under context parallelism, and the longest row that fits a budget.

    python bench/bench_context_parallel.py [--config configs/default.yaml] [--cps 1,2,4]
        [--seq_lens 1024,2048,4096,8192] [--budget_mib 256]

For each CP size N (N CPU ranks, gloo, spawned here) and row length T: one training forward of one
row (batch 1, fp32, the config's model randomly initialised) split over N ranks; the figure is the
largest, over ranks, of the bytes autograd keeps for backward (every saved tensor's storage counted
once: parameters excluded). That is the activation memory a training step holds at its peak, minus
transients. "longest" is the longest T of the grid whose figure fits --budget_mib.
"""
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import load_config  # noqa: E402
from model import GPT  # noqa: E402


def saved_bytes(fn, params):
    """Run fn() with grad; the bytes of the distinct storages autograd saves (parameters excluded)."""
    seen = {p.untyped_storage().data_ptr() for p in params}
    total = [0]

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total[0] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def measure(model_cfg, T, cp=None):
    torch.manual_seed(0)
    model = GPT(model_cfg)
    row = torch.randint(0, model_cfg.vocab_size, (1, T + 1))
    x, y = row[:, :-1], row[:, 1:]
    if cp is not None:
        x, y = cp.split(x), cp.split(y)
    return saved_bytes(lambda: model(x, y, cp=cp), list(model.parameters()))


def worker(rank, world, port, model_cfg, seq_lens, out):
    torch.set_num_threads(1)
    from context_parallel import ContextParallel
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cp = ContextParallel(dist.new_group(list(range(world))))
    figures = torch.tensor([float(measure(model_cfg, T, cp)) for T in seq_lens], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save(figures, out)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--seq_lens", default="1024,2048,4096,8192")
    ap.add_argument("--budget_mib", type=float, default=256)
    args = ap.parse_args()
    model_cfg = load_config(args.config).model
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    rows = {}
    for n in (int(c) for c in args.cps.split(",")):
        if n == 1:
            rows[n] = [measure(model_cfg, T) for T in seq_lens]
        else:
            out = f"/tmp/bench_cp_{os.getpid()}.pt"
            mp.spawn(worker, args=(n, free_port(), model_cfg, seq_lens, out), nprocs=n)
            rows[n] = torch.load(out).tolist()
            os.remove(out)
    mib = 2 ** 20
    print("saved activations per rank (MiB), one row of T tokens, fp32")
    print("CP  " + "".join(f"{T:>10}" for T in seq_lens) + f"   longest T <= {args.budget_mib:g} MiB")
    for n, figs in rows.items():
        fits = [T for T, b in zip(seq_lens, figs) if b <= args.budget_mib * mib]
        print(f"{n:<4}" + "".join(f"{b / mib:>10.1f}" for b in figs) + f"   {max(fits) if fits else '-':>8}")


if __name__ == "__main__":
    main()
