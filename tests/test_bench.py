"""The bench/ drivers run end to end on tiny shapes (their figures are printed, not asserted)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_nanogpt  # noqa: E402


def test_nanogpt_baseline_learns_and_bench_reports_every_kind():
    torch.manual_seed(0)
    model = bench_nanogpt.NanoGPT(vocab=17, d=32, n_layer=1, n_heads=2, max_len=16)
    opt = bench_nanogpt.nano_optimizer(model, 1e-2)
    x = torch.randint(0, 17, (4, 16))
    losses = [bench_nanogpt.train_step(model, opt, x, x.roll(-1, 1)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    rates = bench_nanogpt.main(["--kinds", "attn", "kda", "--d", "32", "--heads", "2", "--layers", "1",
                                "--T", "16", "--B", "2", "--steps", "1", "--repeat", "1", "--vocab", "17"])
    assert set(rates) == {"nanogpt", "attn", "kda"} and all(r > 0 for r in rates.values())
