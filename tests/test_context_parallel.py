"""Context parallelism (context_parallel.py) on CPU (gloo): ranks holding pieces of the sequence give
the single-process loss and gradients, per mixer kind and for the default hybrid; 2 data x 2 context.

The ranks run in torch.multiprocessing workers; each computes the single-process reference itself
(the same seed, the full batch) and rank 0 writes the largest differences to a JSON file."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from config import DEFAULT_CONFIG, read_yaml
import context_parallel
from context_parallel import ContextParallel
from model import GPT, ModelConfig

TOL = 1e-5


def small(pattern, layers, **kw):
    return {"vocab_size": 61, "d_model": 32, "n_layer": len(pattern), "pattern": pattern, "layers": layers,
            "mlp": {"hidden": 64}, **kw}


MIXERS = {
    "attn": small(["a", "s"], {"a": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "qk_norm": True},
                               "s": {"kind": "attn", "n_heads": 2, "sinks": True}}),
    "attn_window_sinks": small(["w", "v"], {
        "w": {"kind": "attn", "n_heads": 2, "window": 9, "sinks": True},
        "v": {"kind": "attn", "n_heads": 2, "window": 100, "rope": False}}),   # window > a piece
    "kda": small(["k"], {"k": {"kind": "kda", "n_heads": 2, "head_dim": 16}}),
    "gdn": small(["g"], {"g": {"kind": "gdn", "n_heads": 2, "head_dim": 16, "conv_size": 3}}),
    "linear": small(["l"], {"l": {"kind": "linear", "n_heads": 2, "head_dim": 16, "output_gate": False}}),
    "mla": small(["m"], {"m": {"kind": "mla", "n_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
                               "qk_nope_dim": 8, "qk_rope_dim": 8, "v_head_dim": 8}}),
}
for _stage in ("sparse", "dense_warmup"):  # top_k < the keys most queries see: the selection matters
    MIXERS[f"dsa_{_stage}"] = small(["m"], {"m": {**MIXERS["mla"]["layers"]["m"], "dsa": {
        "n_heads": 2, "head_dim": 8, "rope_dim": 4, "top_k": 16, "stage": _stage}}})


def default_model():
    return read_yaml(DEFAULT_CONFIG)["model"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_one(raw, B, T, cp_size, group):
    """Max |difference| of the loss and of every gradient: CP over `group` vs one process."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_dict(raw))
    idx = torch.randint(0, raw["vocab_size"], (B, T + 1))
    x, y = idx[:, :-1], idx[:, 1:]
    y = y.masked_fill(torch.rand(T) < 0.3, -1)                  # uncounted targets, unequal per piece
    _, loss = model(x, y)
    loss.backward()
    ref_loss, ref = loss.detach(), grads(model)
    model.zero_grad(set_to_none=True)
    data_rank, n_data = rank // cp_size, world // cp_size      # rows of the batch by data rank
    rows = slice(data_rank * B // n_data, (data_rank + 1) * B // n_data)
    cp = ContextParallel(group)
    _, loss = model(cp.split(x[rows]), cp.split(y[rows]), cp=cp)
    (loss / world).backward()                                   # DDP's average over all ranks
    loss = loss.detach() / world
    dist.all_reduce(loss)
    for p in model.parameters():
        dist.all_reduce(p.grad)
    got = grads(model)
    assert got.keys() == ref.keys()
    return {"loss": (loss - ref_loss).abs().item(),
            "grad": max((got[n] - ref[n]).abs().max().item() for n in ref),
            "grad_scale": max(ref[n].abs().max().item() for n in ref)}


def worker(rank, world, cp_size, port, cases, out):
    torch.set_num_threads(1)
    context_parallel.BLOCK_Q = 32                               # several checkpointed blocks per piece
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = [dist.new_group(list(range(d, d + cp_size))) for d in range(0, world, cp_size)]
    group = groups[rank // cp_size]
    result = {name: check_one(raw, B, T, cp_size, group) for name, (raw, B, T) in cases.items()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run(world, cp_size, cases, tmp_path):
    out = str(tmp_path / "result.json")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(worker, args=(world, cp_size, free_port(), cases, out), nprocs=world)
    with open(out) as f:
        result = json.load(f)
    for name, r in result.items():
        assert r["loss"] <= TOL and r["grad"] <= TOL, (name, r)
    return result


def test_two_ranks_match_one_process_per_mixer_and_default_hybrid(tmp_path):
    """CP 2: every supported mixer (pieces of 70 tokens: the delta rule crosses a chunk inside a
    piece, a window of 100 reaches back two pieces) and the default hybrid (KDA + MLA NoPE)."""
    cases = {name: (raw, 2, 280) for name, raw in MIXERS.items()}
    cases["default"] = (default_model(), 2, 128)
    run(2, 2, cases, tmp_path)


@pytest.mark.slow
def test_four_ranks_as_two_data_by_two_context(tmp_path):
    cases = {"default": (default_model(), 4, 128), "attn_window_sinks": (MIXERS["attn_window_sinks"], 4, 96)}
    run(4, 2, cases, tmp_path)


@pytest.mark.slow
def test_four_ranks_of_context(tmp_path):
    cases = {name: (raw, 2, 288) for name, raw in MIXERS.items()}
    cases["default"] = (default_model(), 2, 256)
    run(4, 4, cases, tmp_path)


@pytest.mark.slow
def test_two_ranks_match_one_process_on_triton(tmp_path):
    """The Triton kernels (under the interpreter on CPU): the delta rule with the widened state and
    attention with queries offset against the gathered keys / halos."""
    cases = {"kda": (small(["k"], {"k": {"kind": "kda", "n_heads": 1, "head_dim": 16}}, backend="triton"), 1, 64),
             "attn": (small(["a", "w"], {"a": {"kind": "attn", "n_heads": 2},
                                         "w": {"kind": "attn", "n_heads": 2, "window": 5, "sinks": True}},
                            backend="triton"), 1, 64)}
    run(2, 2, cases, tmp_path)


def test_split_and_positions_cover_the_sequence_once():
    """The pieces of all ranks put back in order are the sequence (no process group needed)."""
    T, N = 24, 3
    rows = torch.arange(T)[None].repeat(2, 1)
    seen = []
    for r in range(N):
        cp = ContextParallel.__new__(ContextParallel)
        cp.size, cp.rank, cp.n_pieces, cp.pieces = N, r, 2 * N, (r, 2 * N - 1 - r)
        part = cp.split(rows)
        assert part.shape == (4, T // (2 * N))
        assert torch.equal(cp.positions(part[..., None]), part)
        seen.append(part)
    assert sorted(torch.cat(seen).flatten().tolist()) == sorted(rows.flatten().tolist())


# ----------------------------------------------------------------------------------------------
# train.py: train.context_parallel under torchrun, and the errors


def train_config(out_dir, **train_kw):
    """A small hybrid (KDA, windowed attention with sinks, MLA) on MQAR: targets -1 except answers,
    so the pieces of a row count different numbers of targets."""
    layers = {"k": {"kind": "kda", "n_heads": 2, "head_dim": 16},
              "w": {"kind": "attn", "n_heads": 2, "window": 6, "sinks": True},
              "m": {"kind": "mla", "n_heads": 2, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8,
                    "v_head_dim": 8}}
    return {"model": {"vocab_size": 32, "d_model": 32, "n_layer": 3, "pattern": ["k", "w", "m"],
                      "layers": layers, "mlp": {"hidden": 64}},
            "data": {"kind": "mqar", "n_pairs": 4},
            "train": {"max_steps": 4, "batch_size": 4, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2,
                      "log_interval": 1, "eval_interval": 1000, "eval_batches": 1, "ckpt_interval": 1000,
                      "out_dir": str(out_dir), **train_kw}}


def torchrun(nproc, arg, script):
    from config import ROOT
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                           f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
                           f"--rdzv_endpoint=127.0.0.1:{free_port()}", script, str(arg)],
                          capture_output=True, text=True, timeout=600, env=env)


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def train_with_ranks(tmp_path, nproc, runs):
    from config import ROOT
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    r = torchrun(nproc, spec, os.path.join(ROOT, "tests", "dist_worker.py"))
    assert r.returncode == 0, r.stderr[-3000:]


def one_process_losses(tmp_path):
    from config import from_raw
    from train import train
    train(from_raw(train_config(tmp_path / "one", grad_accum=2)), quiet=True)
    return losses(tmp_path / "one")


def test_train_context_parallel_2_matches_one_process(tmp_path):
    """torchrun, 2 ranks, context_parallel 2 (DDP and FSDP2, with grad accumulation): the losses of
    one process, step by step (so the gradients and updates too)."""
    runs = {p: train_config(tmp_path / p, context_parallel=2, parallel=p, grad_accum=2) for p in ("ddp", "fsdp")}
    train_with_ranks(tmp_path, 2, list(runs.values()))
    one = one_process_losses(tmp_path)
    assert len(one) == 4
    for name in runs:
        got = losses(tmp_path / name)
        assert max(abs(one[s] - got[s]) for s in one) <= 1e-5, (name, one, got)


@pytest.mark.slow
def test_train_two_data_by_two_context_matches_one_process(tmp_path):
    runs = [train_config(tmp_path / "dxc", context_parallel=2, grad_accum=2)]
    train_with_ranks(tmp_path, 4, runs)
    one, got = one_process_losses(tmp_path), losses(tmp_path / "dxc")
    assert max(abs(one[s] - got[s]) for s in one) <= 1e-5, (one, got)


@pytest.mark.slow
def test_train_text_context_parallel_2_matches_one_process(tmp_path):
    """The embedded corpus: training losses and the eval (run under CP: split rows) of one process."""
    def text(out_dir, **kw):
        raw = train_config(out_dir, eval_interval=4, eval_batches=2, sample_tokens=0, **kw)
        raw["model"]["vocab_size"], raw["data"] = 257, {"kind": "stdlib"}
        return raw
    train_with_ranks(tmp_path, 2, [text(tmp_path / "cp", context_parallel=2)])
    from config import from_raw
    from train import train
    train(from_raw(text(tmp_path / "one")), quiet=True)
    rows = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("cp", "one")}
    evals = {name: [r["val_loss"] for r in rs if "val_loss" in r] for name, rs in rows.items()}
    assert len(evals["one"]) == 1 and abs(evals["one"][0] - evals["cp"][0]) <= 1e-5, evals
    one, got = losses(tmp_path / "one"), losses(tmp_path / "cp")
    assert max(abs(one[s] - got[s]) for s in one) <= 1e-5, (one, got)


def test_context_parallel_config_errors(tmp_path, monkeypatch):
    from config import from_raw
    from model import ConfigError
    from train import train
    bad = [({"context_parallel": 3}, "seq_len=32 divisible by 2N"),
           ({"context_parallel": 0}, "an integer >= 1"),
           ({"context_parallel": 2, "compile": True}, "train.compile")]
    for train_kw, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            from_raw(train_config(tmp_path, **train_kw))
    import context_parallel
    monkeypatch.setattr(context_parallel, "SUPPORTED", ("attn", "mla"))  # as for a future mixer kind
    with pytest.raises(ConfigError, match="train.context_parallel: must be 1 with kda layers"):
        from_raw(train_config(tmp_path, context_parallel=2))
    monkeypatch.undo()
    raw = train_config(tmp_path, context_parallel=2)
    raw["data"] = {"kind": "stdlib", "pack": True}
    with pytest.raises(ConfigError, match="data.pack"):
        from_raw(raw)
    with pytest.raises(ConfigError, match="a divisor of the number of ranks 1"):  # one process
        train(from_raw(train_config(tmp_path, context_parallel=2)), quiet=True)


def test_context_parallel_not_dividing_the_ranks_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """Checked at start-up from torchrun's WORLD_SIZE, before any process group or model."""
    from train import main
    cfg_path = tmp_path / "cp.yaml"
    cfg_path.write_text(json.dumps(train_config(tmp_path / "out", context_parallel=4, seq_len=64)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([str(cfg_path)]) == 2
    err = capsys.readouterr().err
    assert err == "error: train.context_parallel: must be a divisor of the number of ranks 2 (got 4)\n", err
