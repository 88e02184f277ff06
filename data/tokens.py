"""Token files and the training loader.

A token file is a 256-byte header of 32 little-endian int64 followed by the tokens:
    header[0] MAGIC, [1] VERSION, [2] vocab size, [3] token count, [4] bytes per token (2 = uint16,
    4 = uint32), [5] bytes of text the tokens encode (for bits per byte), [6] end-of-text id (-1 none).
A corpus is a folder of `train_*.bin` and `val_*.bin` shards (a single shard is `train_000.bin`).
"""
import glob
import json
import os
import re

import numpy as np
import torch

MAGIC, VERSION, HEADER_INTS = 0x48594252, 1, 32
HEADER_BYTES = HEADER_INTS * 8


class DataError(ValueError):
    """A missing, corrupt or incompatible data file. The message is one line."""


def check_writable(path, what, kind="file"):
    """Refuse (one DataError line) an output that cannot be written, before any work is done: `path`
    a file to write (its folder must exist) or, kind "folder", a folder to create or fill."""
    path = os.path.abspath(path)
    if kind == "file" and os.path.isdir(path):
        raise DataError(f"{what}: {path} is a folder, not a file")
    if kind == "file" and not os.path.exists(os.path.dirname(path)):
        raise DataError(f"{what}: the folder {os.path.dirname(path)} does not exist")
    existing = path if kind == "folder" else os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise DataError(f"{what}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"{what}: {existing} is not writable")


def atomic_write(path, write, mode="wb"):
    """Write a file so that a kill at any moment leaves either the old file or the new one: write(f)
    into a temporary file beside it, fsync, rename over `path`, fsync the folder (the rename).
    A failed write (disk full, ...) removes the temporary file and is one DataError line."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save turns the file's OSError into a RuntimeError
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.strerror:
            why = e.strerror
        else:
            import shutil
            folder = os.path.dirname(os.path.abspath(path))
            free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
            why = f"write failed, {free / 2 ** 20:,.0f} MiB free on its disk"
        raise DataError(f"{path}: could not be written ({why}); the temporary file was removed, the "
                        f"previous files are intact") from None
    except BaseException:  # Ctrl-C mid-write: no torn file left behind either
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:  # some filesystems cannot fsync a folder
        pass


def write_json(path, obj):
    atomic_write(path, lambda f: json.dump(obj, f, indent=1), mode="w")


def write_tokens(path, tokens, vocab_size, n_text_bytes, eot_id=-1):
    """Write a token file atomically (temporary file, fsync, rename)."""
    dtype = np.uint16 if vocab_size <= 2 ** 16 else np.uint32
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise DataError(f"{path}: token ids must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(HEADER_INTS, dtype="<i8")
    header[:7] = [MAGIC, VERSION, vocab_size, tokens.size, np.dtype(dtype).itemsize, n_text_bytes, eot_id]
    atomic_write(path, lambda f: (f.write(header.tobytes()), f.write(tokens.astype(dtype).tobytes())))


class TokenFile:
    """A token file opened by memmap, its header checked against its size."""

    def __init__(self, path):
        if not os.path.isfile(path):
            raise DataError(f"{path}: token file not found")
        size = os.path.getsize(path)
        if size < HEADER_BYTES:
            raise DataError(f"{path}: corrupt token file (only {size} bytes, shorter than its header)")
        header = np.fromfile(path, dtype="<i8", count=HEADER_INTS)
        if header[0] != MAGIC:
            raise DataError(f"{path}: not a token file (bad magic number); prepare it with data/prepare.py")
        if header[1] != VERSION:
            raise DataError(f"{path}: token file version {header[1]}, this code reads version {VERSION}")
        self.path, self.vocab_size, self.n_tokens = path, int(header[2]), int(header[3])
        itemsize, self.n_text_bytes, self.eot_id = int(header[4]), int(header[5]), int(header[6])
        if itemsize not in (2, 4) or size != HEADER_BYTES + self.n_tokens * itemsize:
            raise DataError(f"{path}: corrupt token file (header says {self.n_tokens} tokens of {itemsize} "
                            f"bytes, file holds {size - HEADER_BYTES} bytes); prepare it again")
        self.tokens = np.memmap(path, dtype=np.uint16 if itemsize == 2 else np.uint32, mode="r",
                                offset=HEADER_BYTES, shape=(self.n_tokens,))


def open_split(folder, split):
    """The shards of `split` ('train' or 'val') in `folder`, in name order."""
    paths = sorted(glob.glob(os.path.join(folder, f"{split}_*.bin")))
    if not paths:
        raise DataError(f"{folder}: no {split}_*.bin shards found; prepare the corpus first (data/prepare.py)")
    numbers = [re.fullmatch(rf"{split}_(\d+)\.bin", os.path.basename(p)) for p in paths]
    if all(numbers):  # numbered shards must run 0, 1, 2, ... without a gap
        have = {int(m.group(1)) for m in numbers}
        missing = [i for i in range(max(have) + 1) if i not in have]
        if missing:
            raise DataError(f"{folder}: shard {split}_{missing[0]:03d}.bin is missing ({len(missing)} missing of "
                            f"{max(have) + 1}); prepare the corpus again (data/prepare.py resumes)")
    shards = [TokenFile(p) for p in paths]
    vocab = {s.vocab_size for s in shards}
    if len(vocab) > 1:
        raise DataError(f"{folder}: {split} shards disagree on the vocabulary size ({sorted(vocab)})")
    return shards


def with_bos(x, bos):
    """x [B, n] -> [B, n + 1] with `bos` in column 0."""
    return torch.cat([torch.full_like(x[:, :1], bos), x], dim=1)


class TokenLoader:
    """Walks the shards in order, handing out [B, T] inputs and next-token targets.

    A shard is cut into G = world * B equal lanes, one per row of the global batch; batch i reads
    T (+1) tokens at offset i * T of every lane, so the rows of a batch come from G far-apart places
    in the corpus (not one file), and each lane is read in order. Rank r takes rows r*B .. r*B+B-1,
    so the global batch is the same whatever the world size. `state_dict()` is the position
    (shard, offset in the lanes): a resumed run continues on exactly the next tokens.
    bos=True (`data.bos`): every row starts with the shard's end-of-text token as a BOS; the row's T
    targets are the lane's next T tokens, the inputs BOS and their first T - 1.
    """

    def __init__(self, shards, batch_size, seq_len, rank=0, world=1, bos=False):
        self.shards, self.B, self.T, self.rank, self.world = shards, batch_size, seq_len, rank, world
        self.bos = bos
        if bos and any(s.eot_id < 0 for s in shards):
            raise DataError(f"{shards[0].path}: data.bos starts rows with the end-of-text token and this token "
                            f"file has none; prepare the corpus with one or set data.bos: false")
        self.need = need = world * batch_size * (seq_len + 1) + 1
        # a shard shorter than one global batch (the tail of a corpus, a shard closed before a long document)
        # cannot be cut into lanes: it is skipped (`skipped`, which train.py reports), unless all are
        self.skipped = [s for s in shards if s.n_tokens < need]
        self.shards = [s for s in shards if s.n_tokens >= need]
        if not self.shards:
            largest = max(shards, key=lambda s: s.n_tokens)
            folder, name = os.path.split(largest.path)                # name: <split>_NNN.bin
            raise DataError(f"{folder}: no {name.rsplit('_', 1)[0]} shard holds one global batch "
                            f"({need:,} tokens = train.batch_size x (seq_len + 1) + 1; the largest, "
                            f"{name}, has {largest.n_tokens:,}); lower batch_size or "
                            f"seq_len, or prepare the corpus with more tokens per shard (data/prepare.py "
                            f"--shard_tokens, --val_tokens)")
        self.shard, self.offset = 0, 0

    def state_dict(self):
        return {"shard": self.shard, "offset": self.offset, "file": os.path.basename(self.shards[self.shard].path),
                "n_shards": len(self.shards)}

    def load_state_dict(self, state):
        shard, offset = int(state["shard"]), int(state["offset"])
        if shard >= len(self.shards) or ("file" in state and os.path.basename(self.shards[shard].path) != state["file"]):
            raise DataError(f"the saved data position is in shard {state.get('file', shard)}, which this corpus "
                            f"({len(self.shards)} shards from {os.path.dirname(self.shards[0].path)}) does not have "
                            f"at that index; resume with the corpus the run was started on")
        if offset > self.shards[shard].n_tokens:
            raise DataError(f"the saved data position (offset {offset}) lies past the end of "
                            f"{self.shards[shard].path} ({self.shards[shard].n_tokens} tokens); the corpus changed")
        self.shard, self.offset = shard, offset

    def lane_length(self):
        return (self.shards[self.shard].n_tokens - 1) // (self.world * self.B)

    def next_batch(self):
        if self.offset + self.T + 1 > self.lane_length():
            self.shard, self.offset = (self.shard + 1) % len(self.shards), 0
        rows = np.arange(self.rank * self.B, (self.rank + 1) * self.B) * self.lane_length() + self.offset
        index = rows[:, None] + np.arange(self.T + 1)[None, :]                     # [B, T+1]
        buf = torch.from_numpy(self.shards[self.shard].tokens[index].astype(np.int64))
        self.offset += self.T
        if self.bos:                                                              # BOS, then T - 1 tokens
            return with_bos(buf[:, 1:-1], self.shards[self.shard].eot_id), buf[:, 1:]
        return buf[:, :-1], buf[:, 1:]


class PackedLoader(TokenLoader):
    """Packed documents (`data.pack: true`): rows made of whole documents, with their boundaries.

    Lanes as in TokenLoader, but each lane advances by what its row used. A row starts at the lane's
    offset and ends just before the last end-of-text token (EOT) that fits in T + 1 tokens, so every
    document in it is whole; each EOT starts a new document (it is the separator the next document
    begins with, and the target of the last token of the previous one). Unused tail positions are
    padding: input EOT, target -1 (ignored), a document of their own. A document longer than a row
    (no EOT in reach) is cut into row-sized pieces, each its own document (the first tokens of the
    next piece do not see the previous one). next_batch() -> (x [1, B*T], y [1, B*T], cu_seqlens
    int32): the B rows laid end to end, as GPT.forward(idx, targets, cu_seqlens) takes them.
    state_dict() holds the shard and this rank's lane offsets: a resumed run reads the same rows.
    """

    def __init__(self, shards, batch_size, seq_len, rank=0, world=1):
        super().__init__(shards, batch_size, seq_len, rank, world)
        for s in shards:
            if s.eot_id < 0:
                raise DataError(f"{s.path}: data.pack needs an end-of-text token between documents and this "
                                f"token file has none; prepare the corpus with one or set data.pack: false")
        self.offsets = [0] * batch_size

    def state_dict(self):
        return {**super().state_dict(), "offsets": list(self.offsets)}

    def load_state_dict(self, state):
        offsets = state.get("offsets")
        if offsets is None or len(offsets) != self.B:
            raise DataError(f"the saved data position is not one of a packed run with {self.B} rows per rank "
                            f"(data.pack, train.batch_size and the number of ranks must match the saved run)")
        super().load_state_dict({**state, "offset": 0})
        self.offsets = [int(o) for o in offsets]

    def _row(self, lane, T):
        """Row of lane `lane`: (x [T], y [T], document starts inside the row); advances the lane."""
        shard = self.shards[self.shard]
        start = (self.rank * self.B + lane) * self.lane_length() + self.offsets[lane]
        window = shard.tokens[start:start + T + 1].astype(np.int64)          # T + 1 tokens
        eots = np.flatnonzero(window[1:] == shard.eot_id) + 1                 # EOTs that can open a document
        used = int(eots[-1]) if len(eots) else T                              # whole documents, or a piece
        x = np.full(T, shard.eot_id, dtype=np.int64)
        y = np.full(T, -1, dtype=np.int64)
        x[:used], y[:used] = window[:used], window[1:used + 1]
        starts = [0] + [int(e) for e in eots[eots < used]] + ([used] if used < T else [])
        self.offsets[lane] += used
        return x, y, starts

    def next_batch(self):
        if max(self.offsets) + self.T + 1 > self.lane_length():   # a lane ran out: all go to the next shard
            self.shard, self.offsets = (self.shard + 1) % len(self.shards), [0] * self.B
        xs, ys, cu = [], [], []
        for lane in range(self.B):
            x, y, starts = self._row(lane, self.T)
            xs.append(x)
            ys.append(y)
            cu += [lane * self.T + s for s in starts]
        cu.append(self.B * self.T)
        return (torch.from_numpy(np.concatenate(xs))[None], torch.from_numpy(np.concatenate(ys))[None],
                torch.tensor(cu, dtype=torch.int32))
