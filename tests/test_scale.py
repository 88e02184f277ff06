"""Training at scale and without losing work: torchrun DDP/FSDP (CPU, gloo), Muon, checkpoints that
survive kill -9 and SIGTERM, clear errors, the cost model, corpus preparation (data/prepare.py)."""
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tiktoken
import torch

import train as train_mod
from config import ROOT, from_raw
from cost import causal_context, train_flops_per_token
from data.prepare import file_docs, prepare
from data.tokens import DataError, TokenFile, TokenLoader, open_split, write_tokens
from train import latest_checkpoint, load_checkpoint, train

PAT = r"""'s|'t| ?\w+| ?[^\s\w]+|\s+"""


def raw_config(out_dir, **train_kw):
    return {
        "model": {"vocab_size": 32, "d_model": 32, "n_layer": 2, "pattern": ["g"],
                  "layers": {"g": {"kind": "attn", "n_heads": 2}}, "mlp": {"hidden": 64}},
        "data": {"kind": "mqar", "n_pairs": 4},
        "train": {"max_steps": 5, "batch_size": 8, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2,
                  "log_interval": 1, "eval_interval": 1000, "eval_batches": 1, "ckpt_interval": 1000,
                  "out_dir": str(out_dir), **train_kw}}


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env():
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": ROOT}


# ----------------------------------------------------------------------------------------------
# Distributed


def test_ddp_and_fsdp_on_two_ranks_match_one_rank(tmp_path):
    """The same global batch on 1 or 2 ranks (gloo): the same losses, with grad accumulation."""
    runs = {"ddp": raw_config(tmp_path / "ddp", parallel="ddp", grad_accum=2),
            "fsdp": raw_config(tmp_path / "fsdp", parallel="fsdp", grad_accum=2),
            "fsdp_muon": raw_config(tmp_path / "fsdp_muon", parallel="fsdp", optimizer="muon")}
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(list(runs.values())))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                        os.path.join(ROOT, "tests", "dist_worker.py"), str(spec)],
                       capture_output=True, text=True, timeout=600, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    ref = tmp_path / "one"
    train(from_raw(raw_config(ref, grad_accum=2)), quiet=True)
    one = losses(ref)
    assert len(one) == 5
    for name in ("ddp", "fsdp"):
        two = losses(tmp_path / name)
        assert max(abs(one[s] - two[s]) for s in one) <= 1e-5, (name, one, two)
    ref_muon = tmp_path / "one_muon"
    train(from_raw(raw_config(ref_muon, optimizer="muon")), quiet=True)
    a, b = losses(ref_muon), losses(tmp_path / "fsdp_muon")
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-4, (a, b)  # Newton-Schulz runs in bf16
    # a checkpoint from 2 FSDP ranks resumes in one process
    ckpt = load_checkpoint(latest_checkpoint(str(tmp_path / "fsdp")))
    assert ckpt["world_size"] == 2 and ckpt["parallel"] == "fsdp" and len(ckpt["rng"]) == 2
    cfg = from_raw(raw_config(tmp_path / "fsdp", parallel="fsdp", grad_accum=2, max_steps=6))
    train(cfg, resume=True, quiet=True)
    assert 6 in losses(tmp_path / "fsdp")
