"""Multi-query associative recall (Zoology; SPEC 8), generated on the fly from a seed.

A sequence opens with n_pairs key-value pairs (keys from the lower half of the vocabulary, values
from the upper half); each key appears once more later, as a query, at a gap drawn from a power law
that favours short gaps. The target at a query position is its value; every other target is -1
(ignored). Token 0 fills the rest.
"""
import numpy as np
import torch

from data.tokens import DataError  # a ValueError whose message is one line: train.py reports it so


def mqar_batch(batch_size, seq_len, n_pairs, vocab_size, seed, power_a=0.01):
    """-> inputs [B, T], targets [B, T] (-1 where ignored), distances [B, T] (query - key position, 0 elsewhere)."""
    half = vocab_size // 2
    if n_pairs > half - 1 or n_pairs > vocab_size - half:
        raise DataError(f"mqar: n_pairs={n_pairs} needs a vocab of at least {2 * n_pairs + 2} (got {vocab_size})")
    kv_len = 2 * n_pairs
    space = seq_len - kv_len
    if space < n_pairs:
        raise DataError(f"mqar: seq_len={seq_len} is too short for {n_pairs} pairs (need >= {3 * n_pairs})")
    rng = np.random.default_rng(seed)
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)  # favours short gaps
    p /= p.sum()
    x = np.zeros((batch_size, seq_len), dtype=np.int64)
    y = np.full((batch_size, seq_len), -1, dtype=np.int64)
    dist = np.zeros((batch_size, seq_len), dtype=np.int64)
    for b in range(batch_size):
        keys = rng.choice(np.arange(1, half), n_pairs, replace=False)
        values = rng.choice(np.arange(half, vocab_size), n_pairs, replace=False)
        x[b, 0:kv_len:2], x[b, 1:kv_len:2] = keys, values
        gaps = rng.choice(space, n_pairs, replace=False, p=p)   # slot after the kv block
        order = rng.permutation(n_pairs)
        for slot, i in zip(gaps, order):
            t = kv_len + slot
            x[b, t], y[b, t], dist[b, t] = keys[i], values[i], t - 2 * i
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(dist)


def mqar_mix_batch(batch_size, seq_len, settings, vocab_size, seed):
    """Zoology's training mixture: each row is an MQAR sequence of one (length, n_pairs) of `settings`,
    drawn uniformly, zero-padded to seq_len (padding targets -1) -> inputs, targets [B, seq_len]."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(len(settings), size=batch_size)
    x = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    y = torch.full((batch_size, seq_len), -1, dtype=torch.int64)
    for i, (length, n_pairs) in enumerate(settings):
        if length > seq_len:
            raise DataError(f"mqar: a mixture length {length} exceeds seq_len={seq_len}")
        rows = torch.from_numpy(np.nonzero(pick == i)[0])
        xi, yi, _ = mqar_batch(len(rows), length, n_pairs, vocab_size, rng.integers(2 ** 63))
        x[rows, :length], y[rows, :length] = xi, yi
    return x, y


def mqar_accuracy(logits, targets):
    """Fraction of labelled positions whose argmax is the target."""
    mask = targets >= 0
    return (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()
