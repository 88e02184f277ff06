"""The embedded default corpus: the .py files of the running Python's standard library.

Byte-level tokens (0..255) with an end-of-text token (256) after every file: vocab 257. Files are
split deterministically into train and val by a hash of their path, shuffled with a fixed seed, and
written once to token files under the cache folder; later runs reuse them.
"""
import glob
import os
import random
import sysconfig
import zlib

import numpy as np
from tqdm import tqdm

from data.tokens import write_tokens

VOCAB_SIZE, EOT = 257, 256
VAL_PERCENT = 5


def default_cache_dir():
    root = os.environ.get("HYBRID_CACHE") or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cache")
    return os.path.join(root, "stdlib-py%d.%d" % os.sys.version_info[:2])


def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return root, [f for f in files if "site-packages" not in f and "dist-packages" not in f]


def prepare_stdlib(cache_dir=None, quiet=False):
    """Write train_000.bin and val_000.bin for the stdlib corpus unless already there; return the folder."""
    cache_dir = cache_dir or default_cache_dir()
    if all(os.path.exists(os.path.join(cache_dir, f"{s}_000.bin")) for s in ("train", "val")):
        return cache_dir
    os.makedirs(cache_dir, exist_ok=True)
    root, files = stdlib_files()
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}")
    splits = {"train": [], "val": []}
    for f in files:
        rel = os.path.relpath(f, root)
        splits["val" if zlib.crc32(rel.encode()) % 100 < VAL_PERCENT else "train"].append(f)
    for split, paths in splits.items():
        random.Random(0).shuffle(paths)
        chunks, n_bytes = [], 0
        for f in tqdm(paths, desc=f"stdlib corpus ({split})", unit="file", disable=quiet):
            with open(f, "rb") as fh:
                raw = fh.read()
            n_bytes += len(raw)
            chunks.append(np.frombuffer(raw, dtype=np.uint8).astype(np.uint16))
            chunks.append(np.array([EOT], dtype=np.uint16))
        write_tokens(os.path.join(cache_dir, f"{split}_000.bin"), np.concatenate(chunks), VOCAB_SIZE, n_bytes, EOT)
    return cache_dir


def decode(tokens):
    """Byte tokens -> text (end-of-text shown as a blank line)."""
    return bytes(t if t < 256 else 10 for t in tokens).decode("utf-8", errors="replace")


def encode(text):
    return list(text.encode("utf-8"))
