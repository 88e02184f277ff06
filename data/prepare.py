"""Tokenise a corpus into token shards for training (data.kind: bin).

    python data/prepare.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT --tokenizer gpt2 \\
        --max_tokens 1000000000 --out data/fineweb
    python data/prepare.py --dataset roneneldan/TinyStories --out data/tinystories
    python data/prepare.py --files 'corpus/**/*.txt' --out data/mycorpus --tokenizer cl100k_base

Documents come from a Hugging Face dataset (streamed: nothing is downloaded up front) or from local
text files (one file = one document). They are tokenised by tiktoken (any encoding by name; GPT-2 by
default; `--tokenizer bytes` = UTF-8 bytes, vocab 257, no download) in parallel worker processes, an end-of-text token after every document, and written as
token files (data/tokens.py: a header, then uint16 tokens, uint32 when the vocabulary needs it):

    <out>/val_000.bin          the first documents, until --val_tokens tokens (whole documents)
    <out>/train_000.bin ...    the rest, shards of at most --shard_tokens tokens, ending at document
                               boundaries (a single longer document gets a shard of its own)
    <out>/manifest.json        source, tokenizer, the shards written and the documents consumed

The manifest is rewritten atomically after every shard; running the same command again skips the
documents of the finished shards (re-reading them from the stream, not re-tokenising) and continues.
"""
import argparse
import glob
import itertools
import json
import os
import sys
from multiprocessing import Pool

if __name__ == "__main__":  # python data/prepare.py: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.tokens import DataError, check_writable, write_json, write_tokens  # noqa: E402

MANIFEST = "manifest.json"
_ENC = None  # the encoding of a worker process


class ByteEncoding:
    """--tokenizer bytes: UTF-8 bytes 0..255 and <|endoftext|> = 256 (vocab 257, like the stdlib
    corpus); needs no download. The tiktoken Encoding methods prepare.py and sample.py use."""
    name, n_vocab, eot = "bytes", 257, 256
    special_tokens_set = {"<|endoftext|>"}

    def encode_single_token(self, text):
        return self.eot

    def encode_ordinary(self, text):
        return list(text.encode("utf-8"))

    def encode(self, text, allowed_special=()):
        return self.encode_ordinary(text)

    def decode(self, tokens):
        return bytes(t if t < 256 else 10 for t in tokens).decode("utf-8", errors="replace")


OFFLINE_HINT = ("tiktoken downloads an encoding file once and caches it: copy the cached file(s) from a "
                "machine with network (its TIKTOKEN_CACHE_DIR, by default <tmp>/data-gym-cache) and set "
                "TIKTOKEN_CACHE_DIR to the folder holding them here, "
                "or use --tokenizer bytes (no download)")


def get_encoding(encoding):
    """A tiktoken Encoding from a name (gpt2, cl100k_base, o200k_base, ...), 'bytes' (ByteEncoding)
    or an Encoding object. A name whose file cannot be downloaded (offline) is one DataError line."""
    if not isinstance(encoding, str):
        return encoding
    if encoding == "bytes":
        return ByteEncoding()
    import tiktoken
    try:
        return tiktoken.get_encoding(encoding)
    except ValueError:
        raise DataError(f"--tokenizer {encoding}: not a tiktoken encoding; one of "
                        f"{', '.join(tiktoken.list_encoding_names())}, or bytes") from None
    except Exception as e:  # requests / urllib errors: no network, proxy, DNS
        raise DataError(f"--tokenizer {encoding}: the encoding file could not be downloaded "
                        f"({type(e).__name__}); {OFFLINE_HINT}") from None


def eot_of(enc):
    if "<|endoftext|>" not in enc.special_tokens_set:
        raise DataError(f"tokenizer {enc.name}: has no <|endoftext|> token to separate documents")
    return enc.encode_single_token("<|endoftext|>")


def _init_worker(encoding):
    global _ENC
    _ENC = get_encoding(encoding)


def _encode_batch(texts):
    """Worker: texts -> (one array of every document's tokens + eot, per-document token counts, utf-8 bytes)."""
    eot = eot_of(_ENC)
    docs = [_ENC.encode_ordinary(t) + [eot] for t in texts]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    n_bytes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths, n_bytes


def _batched(iterable, n):
    it = iter(iterable)
    while batch := list(itertools.islice(it, n)):
        yield batch


def prepare(docs, out, encoding="gpt2", source=None, max_tokens=None, shard_tokens=100_000_000,
            val_tokens=1_000_000, workers=None, batch_docs=64, quiet=False):
    """Tokenise the iterable of texts `docs` into shards under `out`; returns the manifest.

    encoding: a tiktoken name, or an Encoding object (tests build one locally). source: a dict that
    identifies the corpus; a rerun with the same source resumes, with another one is refused."""
    enc = get_encoding(encoding)
    settings = {"source": dict(source or {}), "tokenizer": encoding if isinstance(encoding, str) else enc.name,
                "vocab_size": enc.n_vocab, "eot_id": eot_of(enc), "shard_tokens": shard_tokens,
                "val_tokens": val_tokens}
    os.makedirs(out, exist_ok=True)
    manifest = _resume(out, settings, max_tokens, quiet)
    if manifest["complete"] or (max_tokens is not None and manifest["tokens"] >= max_tokens):
        if not quiet:
            print(f"{out}: already prepared ({manifest['tokens']:,} tokens in {len(manifest['shards'])} shards)")
        return manifest
    writer = _ShardWriter(out, manifest)
    bar = tqdm(total=max_tokens, initial=manifest["tokens"], unit="tok", unit_scale=True, desc=f"tokenise {out}",
               disable=quiet, dynamic_ncols=True)
    encoded = _encoded(docs, manifest["docs_done"], encoding, workers, batch_docs)
    try:
        for doc, n_bytes in encoded:
            writer.add(doc, n_bytes)
            bar.update(doc.size)
            if max_tokens is not None and manifest["tokens"] + writer.buffered() >= max_tokens:
                break
        else:
            manifest["complete"] = True  # the source is exhausted
        writer.flush()
    finally:
        encoded.close()  # ends the worker pool
        bar.close()
    if not quiet:
        n_val = sum(s["tokens"] for s in manifest["shards"] if s["file"].startswith("val"))
        print(f"{out}: {manifest['tokens']:,} tokens ({n_val:,} val) in {len(manifest['shards'])} shards, "
              f"vocab {enc.n_vocab} ({'uint16' if enc.n_vocab <= 2 ** 16 else 'uint32'}), "
              f"{manifest['docs_done']:,} documents")
    return manifest


def _resume(out, settings, max_tokens, quiet):
    """The manifest under `out` (a new one if there is none); a DataError if it was prepared with other
    settings or lists a shard that is missing."""
    mpath = os.path.join(out, MANIFEST)
    if not os.path.exists(mpath):
        return {**settings, "docs_done": 0, "tokens": 0, "shards": [], "complete": False}
    with open(mpath) as f:
        manifest = json.load(f)
    for key, value in settings.items():
        if manifest.get(key) != value:
            raise DataError(f"{out}: already holds a corpus prepared with {key}={manifest.get(key)!r} (now "
                            f"{value!r}); use another --out or delete {mpath}")
    for shard in manifest["shards"]:
        if not os.path.exists(os.path.join(out, shard["file"])):
            raise DataError(f"{out}: {shard['file']} is listed in {MANIFEST} but missing; delete {mpath} "
                            f"and the shards to prepare again")
    unfinished = not manifest["complete"] and (max_tokens is None or manifest["tokens"] < max_tokens)
    if not quiet and unfinished and manifest["shards"]:
        print(f"{out}: resuming after {len(manifest['shards'])} finished shards ({manifest['docs_done']:,} documents)")
    return manifest


def _encoded(docs, skip, encoding, workers, batch_docs):
    """(tokens + eot, utf-8 bytes) of every document of `docs` after the first `skip`, tokenised in
    batches by a pool of `workers` processes (default: one per CPU; 1: in this process)."""
    batches = _batched(itertools.islice(docs, skip, None), batch_docs)
    workers = os.cpu_count() if workers is None else workers
    pool = Pool(workers, initializer=_init_worker, initargs=(encoding,)) if workers > 1 else None
    if pool is None:
        _init_worker(encoding)
    try:
        for flat, lengths, n_bytes in (pool.imap(_encode_batch, batches) if pool else map(_encode_batch, batches)):
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for i in range(len(lengths)):
                yield flat[starts[i]:starts[i + 1]], int(n_bytes[i])
    finally:
        if pool is not None:
            pool.terminate()


class _ShardWriter:
    """Collects whole documents into shards: first one val shard (until val_tokens; it ends after the
    document that reaches them), then train shards of at most shard_tokens (each ends before the document
    that would overflow it). Every shard written is added to the manifest, which is rewritten then."""

    def __init__(self, out, manifest):
        self.out, self.manifest = out, manifest
        self.buf, self.tokens, self.bytes, self.docs = [], 0, 0, 0
        self.split = "val" if manifest["val_tokens"] > 0 and self.n_shards("val") == 0 else "train"

    def n_shards(self, split):
        return sum(s["file"].startswith(split) for s in self.manifest["shards"])

    def buffered(self):
        return self.tokens

    def add(self, doc, n_bytes):
        if self.split == "train" and self.buf and self.buffered() + doc.size > self.manifest["shard_tokens"]:
            self.flush()
        self.buf.append(doc)
        self.tokens += doc.size
        self.bytes += n_bytes
        self.docs += 1
        if self.split == "val" and self.buffered() >= self.manifest["val_tokens"]:
            self.flush()

    def flush(self):
        """Write the buffered documents as the next shard (nothing if none are buffered) and the manifest."""
        m = self.manifest
        if self.buf:
            tokens = np.concatenate(self.buf)
            file = f"{self.split}_{self.n_shards(self.split):03d}.bin"
            write_tokens(os.path.join(self.out, file), tokens, m["vocab_size"], self.bytes, m["eot_id"])
            m["shards"].append({"file": file, "tokens": int(tokens.size), "text_bytes": self.bytes, "docs": self.docs})
            m["docs_done"] += self.docs
            m["tokens"] += int(tokens.size)
            self.buf, self.tokens, self.bytes, self.docs, self.split = [], 0, 0, 0, "train"
        write_json(os.path.join(self.out, MANIFEST), m)


def file_docs(pattern):
    """The texts of the files matching `pattern` (recursive **), in sorted order."""
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise DataError(f"--files {pattern}: no files match")

    def read(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    return (read(p) for p in paths)


def hub_docs(dataset, name, split, text_field):
    """Texts streamed from a Hugging Face dataset (no full download). The hub's failures (no network, a
    dataset, config or split that does not exist, a stream cut mid-way) are one DataError line; the shards
    finished before a failure stay, and the same command continues after them."""
    from datasets import load_dataset
    try:
        for row in load_dataset(dataset, name, split=split, streaming=True):
            if text_field not in row:
                raise DataError(f"{dataset}: rows have no field {text_field!r} (fields: {', '.join(row)}); "
                                f"pass --text_field")
            yield row[text_field]
    except DataError:
        raise
    except Exception as e:  # datasets / huggingface_hub / requests errors: their message names the cause
        why = (str(e).strip().splitlines() or [""])[0][:300]
        raise DataError(f"--dataset {dataset}" + (f" --name {name}" if name else "") + f" --split {split}: "
                        f"reading it failed ({type(e).__name__}: {why}); check the names and the network "
                        f"(rerunning the same command continues after the shards already written)") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="Hugging Face dataset, e.g. HuggingFaceFW/fineweb-edu")
    src.add_argument("--files", help="glob of local text files, e.g. 'corpus/**/*.txt'")
    p.add_argument("--name", default=None, help="dataset config name, e.g. sample-10BT")
    p.add_argument("--split", default="train", help="dataset split to read")
    p.add_argument("--text_field", default="text")
    p.add_argument("--tokenizer", default="gpt2",
                   help="tiktoken encoding name (gpt2, cl100k_base, o200k_base; downloaded once, then cached "
                        "in TIKTOKEN_CACHE_DIR) or bytes (UTF-8 bytes, vocab 257, no download)")
    p.add_argument("--out", required=True, help="output folder (data.dir for data.kind: bin)")
    p.add_argument("--max_tokens", type=float, default=None, help="stop after about this many tokens")
    p.add_argument("--shard_tokens", type=float, default=100e6)
    p.add_argument("--val_tokens", type=float, default=1e6, help="tokens of the first documents kept for val")
    p.add_argument("--workers", type=int, default=None, help="tokeniser processes (default: all cores)")
    p.add_argument("--batch_docs", type=int, default=64, help="documents per worker task")
    a = p.parse_args(argv)
    try:
        for name, ok, allowed in [("max_tokens", a.max_tokens is None or a.max_tokens >= 1, ">= 1"),
                                  ("shard_tokens", a.shard_tokens >= 1, ">= 1"),
                                  ("val_tokens", a.val_tokens >= 1, ">= 1 (training evaluates on val_000.bin)"),
                                  ("workers", a.workers is None or a.workers >= 1, ">= 1"),
                                  ("batch_docs", a.batch_docs >= 1, ">= 1")]:
            if not ok:
                raise DataError(f"--{name}: must be {allowed} (got {getattr(a, name):g})")
        check_writable(a.out, "--out", kind="folder")
        if a.files:
            docs, source = file_docs(a.files), {"files": a.files}
        else:
            docs = hub_docs(a.dataset, a.name, a.split, a.text_field)
            source = {"dataset": a.dataset, "name": a.name, "split": a.split, "text_field": a.text_field}
        manifest = prepare(docs, a.out, a.tokenizer, source,
                           max_tokens=None if a.max_tokens is None else int(a.max_tokens),
                           shard_tokens=int(a.shard_tokens), val_tokens=int(a.val_tokens), workers=a.workers,
                           batch_docs=a.batch_docs)
        if not any(sh["file"].startswith("train") for sh in manifest["shards"]):
            raise DataError(f"{a.out}: no train shard, every document went to val (the first documents, whole, up "
                            f"to --val_tokens {int(a.val_tokens):,}; one file is one document): training cannot use it; "
                            f"prepare into a new --out with a smaller --val_tokens or more documents")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the shards finished in {a.out} are kept; the same command continues after them",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
