"""Run configs: YAML files with `model`, `data` and `train` sections, plus dotted overrides.

    cfg = load_config("configs/x.yaml", ["--train.max_steps=200", "--model.n_layer=4"])

Without a path the overrides apply to the embedded default, configs/default.yaml. Every bad value is
refused while loading with a ConfigError: one line naming the key and what is allowed.
"""
import copy
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import yaml

from data import SYNTHETIC_KINDS
from model import ConfigError, ModelConfig, build, positive, require

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.yaml")
DATA_KINDS = ("stdlib", "bin") + SYNTHETIC_KINDS
PARALLEL = ("ddp", "fsdp")
OPTIMIZERS = ("adamw", "muon")
PRECISIONS = ("auto", "bf16", "fp32")
STOP_METRICS = ("val_acc", "val_loss", "val_bpb")  # train.stop_at keys: *_acc must reach >=, the rest <=


def higher_is_better(name):
    """Accuracies (names ending in acc) are better higher; losses, bits per byte and steps lower."""
    return name.endswith("acc")


def reaches(name, value, target):
    """Whether a metric's value reaches a target: from above for an accuracy, from below otherwise."""
    return value >= target if higher_is_better(name) else value <= target


@dataclass
class DataConfig:
    kind: str = "stdlib"                # stdlib (embedded corpus), bin (prepared shards), mqar, palindrome, stack, backcopy
    dir: Optional[str] = None           # bin: folder of train_*.bin / val_*.bin; stdlib: cache folder
    n_pairs: int = 8                    # mqar: key-value pairs per sequence
    mqar_vocab: Optional[int] = None    # mqar, palindrome, stack, backcopy: tokens used (null = model.vocab_size)
    pack: bool = False                  # stdlib/bin: rows of whole documents, boundaries to the model
    bos: bool = False                   # stdlib/bin: every row starts with the end-of-text token (a BOS at
    #                                     position 0 of every row, train and eval; the attention-sink study)
    seed: Optional[int] = None          # mqar, palindrome, stack, backcopy: the seed of the generated training
    #                                     and val batches (null = train.seed, which also seeds the init)
    mqar_mix: list = field(default_factory=list)  # mqar: train on [[length, n_pairs], ...] (Zoology's
    #                                     mixture, shorter rows zero-padded); eval stays at seq_len, n_pairs,
    #                                     plus val_acc_<length>x<pairs> for each other setting

    def check(self, path, model):
        require(self.kind in DATA_KINDS, f"{path}.kind", f"one of {', '.join(DATA_KINDS)}", self.kind)
        require(self.kind != "bin" or self.dir, f"{path}.dir", "a folder of prepared shards when kind is bin", self.dir)
        positive(f"{path}.n_pairs", self.n_pairs)
        require(not self.pack or self.kind not in SYNTHETIC_KINDS, f"{path}.pack",
                f"false for {self.kind} (it packs text corpora)", self.pack)
        require(not self.bos or self.kind not in SYNTHETIC_KINDS, f"{path}.bos",
                f"false for {self.kind} (it starts text rows with end-of-text)", self.bos)
        require(self.seed is None or self.seed >= 0, f"{path}.seed", "an integer >= 0 or null", self.seed)
        require(self.seed is None or self.kind in SYNTHETIC_KINDS, f"{path}.seed",
                f"null for {self.kind} (text corpora are read in order; it seeds the generated tasks)", self.seed)
        require(not (self.bos and self.pack), f"{path}.bos", "false with data.pack (packed rows already start "
                "documents with end-of-text)", self.bos)
        for item in self.mqar_mix:
            require(isinstance(item, (list, tuple)) and len(item) == 2 and all(type(v) is int and v > 0 for v in item),
                    f"{path}.mqar_mix", "a list of [length, n_pairs] pairs of positive ints", self.mqar_mix)
        if self.mqar_vocab is not None:
            require(4 <= self.mqar_vocab <= model.vocab_size, f"{path}.mqar_vocab",
                    f"between 4 and model.vocab_size={model.vocab_size}", self.mqar_vocab)

    def refuse_unused(self, path):
        """Refuse a setting of the generated tasks that this kind would ignore (see refuse_unused)."""
        require(self.kind == "mqar" or self.n_pairs == DataConfig.n_pairs, f"{path}.n_pairs",
                f"left at {DataConfig.n_pairs} for {self.kind} (it sets mqar's pairs)", self.n_pairs)
        require(self.kind == "mqar" or not self.mqar_mix, f"{path}.mqar_mix", f"empty for {self.kind} (a mixture of "
                f"mqar settings)", self.mqar_mix)
        require(self.kind in SYNTHETIC_KINDS or self.mqar_vocab is None, f"{path}.mqar_vocab",
                f"null for {self.kind} (the tokens of the generated tasks)", self.mqar_vocab)


@dataclass
class TrainConfig:
    max_steps: int = 300
    batch_size: int = 8                 # sequences per GLOBAL micro-batch (each of W ranks gets batch_size / W)
    seq_len: int = 256
    grad_accum: int = 1                 # micro-batches per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0              # 0 = off
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 10
    ckpt_interval: int = 100
    out_dir: str = "out"
    seed: int = 1337
    device: str = "auto"                # auto, cpu, cuda, cuda:N
    sample_tokens: int = 200            # tokens sampled at the end of a text run (0 = none)
    parallel: str = "ddp"               # under torchrun: ddp (replicated) or fsdp (FSDP2 fully_shard)
    optimizer: str = "adamw"            # adamw, or muon (blocks' 2-D matrices; AdamW for the rest)
    muon_lr: float = 0.02               # peak lr of the Muon group (same warmup + cosine as lr)
    precision: str = "auto"             # auto (bf16 autocast on CUDA, fp32 on CPU), bf16, fp32
    compile: bool = False               # torch.compile the model
    keep_last: int = 3                  # checkpoints kept in out_dir (older ones are deleted)
    max_bad_steps: int = 5              # non-finite losses in a row before the run stops
    threads: int = 0                    # torch CPU threads (0 = torch's default: OMP_NUM_THREADS or all cores)
    init_from: Optional[str] = None     # a checkpoint (file or folder) whose weights start a fresh run
                                        # (e.g. one `convert.py from-hf` wrote); --resume takes precedence
    stop_at: dict = field(default_factory=dict)  # early stop after an eval, e.g. {val_acc: 0.99}
    context_parallel: int = 1           # N ranks share every sequence (context_parallel.py); data x context

    def refuse_unused(self, path):
        """Refuse Muon's lr with another optimizer (see refuse_unused)."""
        require(self.optimizer == "muon" or self.muon_lr == TrainConfig.muon_lr, f"{path}.muon_lr",
                f"left at {TrainConfig.muon_lr} with optimizer {self.optimizer} (it is Muon's lr; set "
                f"{path}.optimizer: muon)", self.muon_lr)

    def check(self, path, model):
        for key in ("max_steps", "batch_size", "seq_len", "grad_accum", "log_interval", "eval_interval",
                    "eval_batches", "ckpt_interval", "keep_last", "max_bad_steps"):
            positive(f"{path}.{key}", getattr(self, key))
        require(self.lr > 0, f"{path}.lr", "> 0", self.lr)
        require(0 <= self.min_lr_ratio <= 1, f"{path}.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        require(self.warmup_steps >= 0, f"{path}.warmup_steps", "an integer >= 0", self.warmup_steps)
        require(self.seed >= 0, f"{path}.seed", "an integer >= 0", self.seed)
        require(self.weight_decay >= 0, f"{path}.weight_decay", ">= 0", self.weight_decay)
        for key in ("beta1", "beta2"):
            require(0 <= getattr(self, key) < 1, f"{path}.{key}", "in [0, 1)", getattr(self, key))
        require(self.grad_clip >= 0, f"{path}.grad_clip", ">= 0 (0 = off)", self.grad_clip)
        require(isinstance(self.threads, int) and not isinstance(self.threads, bool) and self.threads >= 0,
                f"{path}.threads", "an integer >= 0 (0 = torch's default)", self.threads)
        require(self.sample_tokens >= 0, f"{path}.sample_tokens", "an integer >= 0", self.sample_tokens)
        require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
                f"{path}.device", "auto, cpu, cuda or cuda:N", self.device)
        require(self.parallel in PARALLEL, f"{path}.parallel", f"one of {', '.join(PARALLEL)}", self.parallel)
        require(self.optimizer in OPTIMIZERS, f"{path}.optimizer", f"one of {', '.join(OPTIMIZERS)}", self.optimizer)
        require(self.muon_lr > 0, f"{path}.muon_lr", "> 0", self.muon_lr)
        require(self.precision in PRECISIONS, f"{path}.precision", f"one of {', '.join(PRECISIONS)}", self.precision)
        for key, value in self.stop_at.items():
            require(key in STOP_METRICS, f"{path}.stop_at.{key}", f"one of {', '.join(STOP_METRICS)}", key)
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                    f"{path}.stop_at.{key}", "a finite number (the target the eval metric must reach)", value)
            if higher_is_better(key):  # an accuracy above 1 is never reached: the run would never stop early
                require(0 < value <= 1, f"{path}.stop_at.{key}", "in (0, 1] (an accuracy)", value)
        N = self.context_parallel
        positive(f"{path}.context_parallel", N)
        if N > 1:
            require(self.seq_len % (2 * N) == 0, f"{path}.context_parallel",
                    f"N with seq_len={self.seq_len} divisible by 2N (each rank holds two pieces)", N)
            from context_parallel import unsupported
            kind = unsupported(model)
            require(kind is None, f"{path}.context_parallel", f"1 with {kind} layers (not supported)", N)
            require(not self.compile, f"{path}.context_parallel", "1 with train.compile (not supported)", N)


def check_world(tc, world):
    """train.context_parallel against the number of ranks (known at start-up, before any model)."""
    require(world % tc.context_parallel == 0, "train.context_parallel",
            f"a divisor of the number of ranks {world}", tc.context_parallel)


@dataclass
class Config:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    raw: dict                           # the dict it was built from (what checkpoints store)


def apply_override(raw, arg):
    """Apply one `--a.b.c=value` (value parsed as YAML: 3, 1e-3, null, true, [a, b]) to dict `raw`."""
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError(f"{arg}: overrides look like --section.key=value (e.g. --train.max_steps=200)")
    key, text = arg[2:].split("=", 1)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    node, parts = raw, key.split(".")
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: is not a section, cannot set {key}")
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: YAML keeps the last, so the settings of
    the first (a second `model:` section, a repeated `lr:`) were lost without a word. Merge keys (<<) may
    still be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice in one mapping (first at line {first[key] + 1}); "
                        f"YAML would keep only the last", key_node.start_mark)
                first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(path):
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        start = getattr(e, "context_mark", None)
        if start is not None and getattr(e, "context", None):
            problem += f" ({e.context} at line {start.line + 1}, column {start.column + 1})"
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config ({e})") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of sections (key: value lines) at the top, got a "
                          f"{type(raw).__name__}")
    return raw if raw is not None else {}


def from_raw(raw):
    """Validate a config dict (model/data/train sections) into a Config."""
    require(isinstance(raw, dict), "config", "a mapping with model, data and train sections", raw)
    for section in raw:
        require(section in ("model", "data", "train"), section, "a section: model, data or train", section)
    model = ModelConfig.from_dict(raw.get("model") or {})
    data = build(DataConfig, raw.get("data"), "data")
    data.check("data", model)
    train = build(TrainConfig, raw.get("train"), "train")
    train.check("train", model)
    reported = ("val_loss", "val_acc") if data.kind in SYNTHETIC_KINDS else ("val_loss", "val_bpb")
    for key in train.stop_at:
        require(key in reported, f"train.stop_at.{key}", f"a metric data.kind={data.kind} reports "
                f"({', '.join(reported)})", key)
    require(not data.pack or train.context_parallel == 1, "train.context_parallel",
            "1 with data.pack (packed documents are not split over ranks yet)", train.context_parallel)
    return Config(model, data, train, copy.deepcopy(raw))


def refuse_unused(cfg):
    """Refuse settings a config gives that its choices would ignore (a MoE key on a dense MLP, mqar's n_pairs
    on a text corpus): run where a config is about to train (load_config, train.train, ablate). A checkpoint's
    saved config is not checked: its model is what it is."""
    cfg.model.mlp.refuse_unused("model.mlp")
    cfg.data.refuse_unused("data")
    cfg.train.refuse_unused("train")
    return cfg


def load_config(path=None, overrides=()):
    raw = read_yaml(path or DEFAULT_CONFIG)
    for arg in overrides:
        apply_override(raw, arg)
    return refuse_unused(from_raw(raw))


def split_args(argv):
    """Split argv into (config path or None, dotted overrides, other args). `--a.b value` (a space
    instead of `=`) is refused with a hint at the `=` form."""
    path, overrides, rest = None, [], []
    for i, a in enumerate(argv):
        if a.startswith("--") and "=" not in a and "." in a:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "VALUE"
            raise ConfigError(f"{a}: an override needs '=' (no space): {a}={value}")
        if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0]:
            overrides.append(a)
        elif not a.startswith("-") and a.endswith((".yaml", ".yml")) and path is None:
            path = a
        else:
            rest.append(a)
    return path, overrides, rest
