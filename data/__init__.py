"""Training data: token files (tokens.py), the embedded standard-library corpus (stdlib.py),
synthetic MQAR (mqar.py), Palindrome, Stack and Bigram-Backcopy (tasks.py), real corpora through Hugging Face datasets + tiktoken (prepare.py).

make_dataset(cfg) gives the object train.py uses: next_batch() -> (x, y), or (x, y, cu_seqlens) with
data.pack (packed documents, x and y [1, B*T]), evaluate(model), state_dict() / load_state_dict()
(the loader position, stored in checkpoints).
"""
import math
import os
import re

import torch

from data.mqar import mqar_accuracy, mqar_batch, mqar_mix_batch
from data.tasks import backcopy_batch, palindrome_batch, stack_batch
from data.tokens import DataError, PackedLoader, TokenLoader, open_split

SYNTHETIC_KINDS = ("mqar", "palindrome", "stack", "backcopy")  # generated on the fly; eval reports val_acc


class TextData:
    """Next-token prediction on token shards; eval reports val loss and bits per byte."""

    def __init__(self, folder, model_vocab, batch_size, seq_len, rank=0, world=1, pack=False, bos=False):
        self.train = open_split(folder, "train")
        self.val = open_split(folder, "val")
        vocab = self.train[0].vocab_size
        if vocab > model_vocab:
            raise DataError(f"{folder}: the data has token ids up to {vocab - 1}, beyond model.vocab_size="
                            f"{model_vocab}; set model.vocab_size >= {vocab}")
        self.Loader = PackedLoader if pack else (lambda *a: TokenLoader(*a, bos=bos))
        self.loader = self.Loader(self.train, batch_size, seq_len, rank, world)
        val_loader = self.Loader(self.val, batch_size, seq_len, rank, world)  # refuse a too-short val split now
        self.B, self.T, self.rank, self.world = batch_size, seq_len, rank, world
        self.notes = [_skipped_note(name, loader.skipped, len(shards), loader.need) for name, loader, shards
                      in (("train", self.loader, self.train), ("val", val_loader, self.val)) if loader.skipped]
        # bits per byte = nats/token / ln 2 * tokens/byte, from the headers of the val shards evaluated
        n_tok, n_bytes = (sum(getattr(s, n) for s in val_loader.shards) for n in ("n_tokens", "n_text_bytes"))
        self.tokens_per_byte = n_tok / n_bytes if n_bytes else 1.0

    def next_batch(self):
        return self.loader.next_batch()

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)

    @torch.no_grad()
    def evaluate(self, model, n_batches, device):
        loader = self.Loader(self.val, self.B, self.T, self.rank, self.world)  # always the same batches
        losses = []
        for _ in range(n_batches):
            x, y, *packed = loader.next_batch()
            kw = {"cu_seqlens": packed[0].to(device)} if packed else {}
            losses.append(model(x.to(device), y.to(device), **kw)[1].item())
        val_loss = sum(losses) / len(losses)
        return {"val_loss": val_loss, "val_bpb": val_loss / math.log(2) * self.tokens_per_byte}


def _skipped_note(split, skipped, n_shards, need):
    """One line naming the shards of `split` a loader skips as shorter than one global batch."""
    names = ", ".join(os.path.basename(s.path) for s in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    return (f"data: skipping {len(skipped)} of {n_shards} {split} shards, shorter than one global batch of "
            f"{need:,} tokens ({names}: {sum(s.n_tokens for s in skipped):,} tokens in all)")


def synthetic_batches(d, vocab, seq_len, train=False):
    """make(n, seed) -> x, y [n, seq_len] for a synthetic data kind (mqar, palindrome, stack, backcopy);
    train=True: MQAR draws from data.mqar_mix when it is set."""
    if d.kind == "mqar" and train and d.mqar_mix:
        return lambda n, seed: mqar_mix_batch(n, seq_len, d.mqar_mix, vocab, seed)
    if d.kind == "mqar":
        return lambda n, seed: mqar_batch(n, seq_len, d.n_pairs, vocab, seed)[:2]
    fn = {"palindrome": palindrome_batch, "stack": stack_batch, "backcopy": backcopy_batch}[d.kind]
    return lambda n, seed: fn(n, seq_len, vocab, seed)


def mixture_evals(d, vocab, seq_len):
    """{suffix: make} for the MQAR mixture's settings other than the eval's own (seq_len, n_pairs):
    each is evaluated at its own length beside val_acc, as val_acc_<length>x<pairs> (which setting
    the model learns first; mixture_setting reads the name back)."""
    settings = sorted({tuple(s) for s in d.mqar_mix} - {(seq_len, d.n_pairs)}) if d.kind == "mqar" else []
    return {f"{length}x{pairs}": (lambda n, seed, L=length, P=pairs: mqar_batch(n, L, P, vocab, seed)[:2])
            for length, pairs in settings}


def mixture_setting(metric):
    """(length, pairs) of a mixture setting's accuracy, val_acc_<length>x<pairs> (mixture_evals); else None."""
    m = re.fullmatch(r"val_acc_(\d+)x(\d+)", metric)
    return (int(m[1]), int(m[2])) if m else None


def mixture_settings(metrics):
    """[((length, pairs), metric name)] of the mixture settings' accuracies among metric names, shortest first."""
    return sorted({(setting, k) for k in metrics if (setting := mixture_setting(k))})


class SyntheticData:
    """A synthetic task (MQAR, Palindrome, Stack); batch i is generated from seed (seed, i): resumable
    exactly. Eval: loss and accuracy at the labelled positions; and under an MQAR mixture, the same for
    each of its other settings (`extra`: {suffix: make} -> val_loss_<suffix>, val_acc_<suffix>)."""

    def __init__(self, make, batch_size, seq_len, seed, rank=0, world=1, make_train=None, extra=None):
        self.make, self.B, self.T, self.seed = make, batch_size, seq_len, seed
        self.make_train = make_train or make   # training batches (the MQAR mixture), else as eval
        self.extra = extra or {}
        self.rank, self.world, self.index = rank, world, 0
        make(1, 0), self.make_train(1, 0)  # refuse impossible settings now

    def next_batch(self):
        x, y = self.make_train(self.world * self.B, [self.seed, self.index])
        self.index += 1
        rows = slice(self.rank * self.B, (self.rank + 1) * self.B)
        return x[rows], y[rows]

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = int(state["index"])

    @torch.no_grad()
    def evaluate(self, model, n_batches, device):
        metrics, rows = {}, slice(self.rank * self.B, (self.rank + 1) * self.B)
        for suffix, make in {"": self.make, **self.extra}.items():
            losses, accs = [], []
            for i in range(n_batches):  # a held-out seed stream, sliced by rank like next_batch
                x, y = make(self.world * self.B, [self.seed, 10 ** 9 + i])
                x, y = x[rows].to(device), y[rows].to(device)
                logits, loss = model(x, y)
                losses.append(loss.item())
                accs.append(mqar_accuracy(logits, y))
            tail = f"_{suffix}" if suffix else ""
            metrics[f"val_loss{tail}"] = sum(losses) / len(losses)
            metrics[f"val_acc{tail}"] = sum(accs) / len(accs)
        return metrics


def corpus_codec(cfg):
    """((encode, decode), None) for the text corpus of `cfg`, or (None, why not): byte-level for the
    stdlib corpus and for shards prepared with --tokenizer bytes, else the tiktoken encoding that
    data/prepare.py recorded in the corpus's manifest.json."""
    from data.stdlib import decode, encode
    if cfg.data.kind == "stdlib":
        return (encode, decode), None
    if cfg.data.kind != "bin":
        return None, f"data.kind {cfg.data.kind} is not text"
    import json
    import os
    manifest = os.path.join(cfg.data.dir, "manifest.json")
    try:
        with open(manifest) as f:
            name = json.load(f)["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{manifest} (written by data/prepare.py) is missing or names no tokenizer"
    from data.prepare import get_encoding
    try:
        enc = get_encoding(name)
    except DataError as e:
        return None, str(e)
    return ((lambda s: enc.encode(s, allowed_special="all")), enc.decode), None


def make_dataset(cfg, rank=0, world=1):
    """The dataset of rank `rank` of `world`: train.batch_size is the global micro-batch, each rank
    reads its own batch_size / world rows of it (the global batch does not depend on world)."""
    d, t, m = cfg.data, cfg.train, cfg.model
    if t.batch_size % world:
        from model import ConfigError
        raise ConfigError(f"train.batch_size: must be divisible by the number of ranks {world} (it is the "
                          f"global micro-batch, split across ranks) (got {t.batch_size})")
    B = t.batch_size // world
    if d.kind in SYNTHETIC_KINDS:
        V = d.mqar_vocab or m.vocab_size
        seed = t.seed if d.seed is None else d.seed   # data.seed apart from train.seed: data and init crossed
        return SyntheticData(synthetic_batches(d, V, t.seq_len), B, t.seq_len, seed, rank, world,
                             synthetic_batches(d, V, t.seq_len, train=True), mixture_evals(d, V, t.seq_len))
    if d.kind == "stdlib":
        from data.stdlib import prepare_stdlib
        folder = prepare_stdlib(d.dir, quiet=rank != 0)
    else:
        folder = d.dir
    return TextData(folder, m.vocab_size, B, t.seq_len, rank, world, pack=d.pack, bos=d.bos)
