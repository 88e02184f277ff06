"""Kimi Linear's other synthetic tasks (beside MQAR, data/mqar.py): Palindrome and Stack.

Both are generated on the fly from a seed and labelled like MQAR: the target is -1 (ignored) except
where the answer is determined, and accuracy is data.mqar.mqar_accuracy over the labelled positions.

    palindrome  n random tokens, a separator, then the same n tokens reversed; every position whose
                next token lies in the reversed half is labelled with it (copy in reverse order).
    stack       a stream of operations on one stack: token 1 = pop, tokens 2.. = push that token;
                at every pop the label is the token it removes (the last pushed, not yet popped).
                A pop never meets an empty stack.

Kimi Linear (2025, synthetic tests, fig. 4) trains these at lengths 256-2048; its generators are not
public and its Stack tracks several stacks at once, as we read the report (not checked word for word
offline). Here: the textbook forms above, one stack; seq_len and vocab are the difficulty knobs.

And one task for the attention-sink study (issue 16), not Kimi Linear's:

    backcopy    Bigram-Backcopy (Guo et al. 2024, "Active-dormant attention heads"): BOS, then a walk on
                a fixed sparse Markov chain, except that the token after a trigger token repeats the
                token before the trigger. A head that copies is needed only after triggers and idle
                (dormant) everywhere else; every position is labelled with its next token.
"""
import functools

import numpy as np
import torch

from data.tokens import DataError  # a ValueError whose message is one line: train.py reports it so

SEP = 1   # palindrome separator
POP = 1   # stack: the pop operation
BOS = 0   # backcopy: position 0 of every sequence
TRIGGERS = 3  # backcopy: tokens 1..3 are the triggers
SUCCESSORS = 4  # backcopy: each token is followed by one of 4 fixed successors (ln 4 nats unpredictable)


def _vocab_check(task, vocab_size, need):
    if vocab_size < need:
        raise DataError(f"{task}: needs a vocab of at least {need} tokens (got {vocab_size})")


def palindrome_batch(batch_size, seq_len, vocab_size, seed):
    """-> inputs [B, T], targets [B, T]: n = T // 2 tokens from 2..vocab-1, SEP, the n reversed
    (the last one falls off the end of the inputs); targets label positions n .. 2n-1."""
    _vocab_check("palindrome", vocab_size, 3)
    if seq_len < 2:
        raise DataError(f"palindrome: seq_len must be >= 2 (got {seq_len})")
    n = seq_len // 2
    rng = np.random.default_rng(seed)
    toks = rng.integers(2, vocab_size, size=(batch_size, n))
    full = np.concatenate([toks, np.full((batch_size, 1), SEP), toks[:, ::-1]], axis=1)  # [B, 2n+1]
    full = np.concatenate([full, np.zeros((batch_size, seq_len + 1 - full.shape[1]), dtype=full.dtype)], 1)
    x, y = full[:, :seq_len].copy(), full[:, 1:seq_len + 1].copy()
    y[:, :n] = -1
    y[:, 2 * n:] = -1   # odd T: the padding position
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))


def stack_batch(batch_size, seq_len, vocab_size, seed, p_push=0.5):
    """-> inputs [B, T], targets [B, T]: each step pushes a random token from 2..vocab-1 (always on
    an empty stack, else with probability p_push) or pops; a pop is labelled with what it pops."""
    _vocab_check("stack", vocab_size, 3)
    rng = np.random.default_rng(seed)
    push = rng.random((batch_size, seq_len)) < p_push
    vals = rng.integers(2, vocab_size, size=(batch_size, seq_len))
    x = np.empty((batch_size, seq_len), dtype=np.int64)
    y = np.full((batch_size, seq_len), -1, dtype=np.int64)
    for b in range(batch_size):
        stack = []
        for t in range(seq_len):
            if push[b, t] or not stack:
                stack.append(vals[b, t])
                x[b, t] = vals[b, t]
            else:
                x[b, t], y[b, t] = POP, stack.pop()
    return torch.from_numpy(x), torch.from_numpy(y)


@functools.lru_cache(maxsize=None)
def backcopy_chain(vocab_size):
    """The fixed Markov chain of backcopy at this vocab: [vocab, SUCCESSORS] successors of every token
    (row BOS unused), distinct tokens from 1..vocab-1 drawn with probability 1/token (Zipf: the low
    tokens, the triggers among them, are frequent; about 31% of positions at vocab 64, as Guo et al. pick
    their triggers among the most frequent tokens), from a generator seeded by the vocab alone. Built once
    per vocab (cached, read-only): every batch walks the same chain."""
    rng = np.random.default_rng([2024, vocab_size])
    tokens = np.arange(1, vocab_size)
    p = 1.0 / tokens
    succ = np.zeros((vocab_size, SUCCESSORS), dtype=np.int64)
    for t in range(1, vocab_size):
        succ[t] = rng.choice(tokens, SUCCESSORS, replace=False, p=p / p.sum())
    succ.flags.writeable = False
    return succ


def backcopy_batch(batch_size, seq_len, vocab_size, seed):
    """-> inputs [B, T], targets [B, T] (the inputs shifted by one; every position labelled): BOS, a
    first token from the non-triggers, then each next token is one of the current token's SUCCESSORS
    (uniformly), or, when the current token is a trigger (1..TRIGGERS), the token before it."""
    _vocab_check("backcopy", vocab_size, TRIGGERS + SUCCESSORS + 2)
    succ = backcopy_chain(vocab_size)
    rng = np.random.default_rng(seed)
    full = np.empty((batch_size, seq_len + 1), dtype=np.int64)
    full[:, 0] = BOS
    if seq_len >= 1:
        full[:, 1] = rng.integers(TRIGGERS + 1, vocab_size, size=batch_size)
    picks = rng.integers(0, SUCCESSORS, size=(batch_size, seq_len + 1))
    rows = np.arange(batch_size)
    for t in range(1, seq_len):
        cur = full[:, t]
        full[:, t + 1] = np.where(cur <= TRIGGERS, full[:, t - 1], succ[cur, picks[rows, t]])
    x, y = full[:, :seq_len].copy(), full[:, 1:].copy()
    return torch.from_numpy(x), torch.from_numpy(y)
