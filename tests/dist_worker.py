"""Run under torchrun by tests/test_scale.py: several short trainings in one process group.

    torchrun --standalone --nproc_per_node=2 tests/dist_worker.py SPEC.json

SPEC.json: a list of [config dict, out_dir]; each is trained in turn with the same process group.
With HYBRID_TEST_MUON_FP32=1, torch.optim.Muon orthogonalises in float32 (newton_schulz_fp32).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from config import from_raw  # noqa: E402
from train import train  # noqa: E402


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz orthogonalisation (torch.optim._muon._zeropower_via_newtonschulz)
    in float32 instead of bfloat16, for tests that compare runs whose gradients differ by reduction order:
    in bfloat16 a 1e-7 difference can flip a rounding of the update. Same iteration: X = G / |G|_F (the
    wide way round), then ns_steps times X <- a X + (b A + c A^2) X with A = X X^T."""
    a, b, c = ns_coefficients
    tall = grad.shape[0] > grad.shape[1]
    X = grad.float().T if tall else grad.float()
    X = X / X.norm().clamp(min=eps)
    for _ in range(ns_steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


if __name__ == "__main__":
    if os.environ.get("HYBRID_TEST_MUON_FP32") == "1":
        torch.optim._muon._zeropower_via_newtonschulz = newton_schulz_fp32
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    dist.init_process_group("gloo")
    for raw in runs:
        train(from_raw(raw), quiet=True)
    dist.destroy_process_group()
