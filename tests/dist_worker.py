"""Run under torchrun by tests/test_scale.py: several short trainings in one process group.

    torchrun --standalone --nproc_per_node=2 tests/dist_worker.py SPEC.json

SPEC.json: a list of [config dict, out_dir]; each is trained in turn with the same process group.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from config import from_raw  # noqa: E402
from train import train  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    dist.init_process_group("gloo")
    for raw in runs:
        train(from_raw(raw), quiet=True)
    dist.destroy_process_group()
