"""hybrid: a language model whose layers mix different attention mechanisms.

A config `pattern` names the mixer of every layer (cycled to n_layer); each mixer has a parallel
path (training, `forward`) and a cached path (`step`: prefill and decode) that give the same logits.

    GPT
      wte                       token embedding, tied with the output head
      blocks[i]: Block          x = x + mixer(norm(x));  x = x + mlp(norm(x))
        mixer                   Attention (attn), MLA (mla, + DSA Indexer), ... one class per mixer kind
        mlp                     SwiGLU
      norm_f, lm_head

The math lives in kernels/ (one function per op); this file is structure. See SPEC.md.
"""
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional, Union, get_args, get_origin

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

# ----------------------------------------------------------------------------------------------
# Config: dataclasses built from plain dicts (YAML), every bad key refused with one clear line.


class ConfigError(ValueError):
    """A bad config value. The message is one line: the dotted key and what is allowed."""


def _coerce(value, typ, path):
    """Check `value` against a dataclass field type (int, float, bool, str, list, dict, Optional)."""
    if get_origin(typ) is Union:  # Optional[X]
        if value is None:
            return None
        typ = next(t for t in get_args(typ) if t is not type(None))
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false (got {value!r})")
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer (got {value!r})")
    elif typ is float:
        if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: must be a number (got {value!r})")
        value = float(value)
    elif typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string (got {value!r})")
    elif typ in (list, dict):
        if not isinstance(value, typ):
            raise ConfigError(f"{path}: must be a {'list' if typ is list else 'mapping'} (got {value!r})")
    return value


def build(cls, d, path):
    """Make dataclass `cls` from dict `d`, refusing unknown keys, wrong types and missing keys."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: must be a mapping of keys to values (got {d!r})")
    allowed = [f.name for f in fields(cls)]
    for key in d:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}: unknown key; allowed keys: {', '.join(allowed)}")
    kwargs = {}
    for f in fields(cls):
        if f.name in d:
            kwargs[f.name] = _coerce(d[f.name], f.type, f"{path}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{path}.{f.name}: required key is missing")
    return cls(**kwargs)


def require(ok, path, allowed, value):
    """Refuse `value` at `path` unless `ok`; `allowed` says what would be accepted."""
    if not ok:
        raise ConfigError(f"{path}: must be {allowed} (got {value!r})")


def positive(path, value):
    require(value is not None and value >= 1, path, "an integer >= 1", value)


def _one_of(path, value, choices):
    require(value in choices, path, f"one of {', '.join(map(str, choices))}", value)


@dataclass
class AttnConfig:
    """Softmax attention (SPEC 1): MHA / GQA / MQA, sliding window, learned sinks, RoPE or NoPE."""
    kind: str = "attn"
    n_heads: int = 4
    n_kv_heads: Optional[int] = None    # None = n_heads (MHA); 1 = MQA
    head_dim: Optional[int] = None      # None = d_model // n_heads
    window: Optional[int] = None        # None = global; else each query sees `window` keys
    sinks: bool = False                 # learned per-head sink logits (gpt-oss)
    rope: bool = True                   # false = NoPE
    rope_theta: float = 10000.0
    qk_norm: bool = False               # RMSNorm on q and k per head

    def check(self, path, model):
        positive(f"{path}.n_heads", self.n_heads)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        positive(f"{path}.n_kv_heads", self.n_kv_heads)
        require(self.n_heads % self.n_kv_heads == 0, f"{path}.n_kv_heads",
                f"a divisor of n_heads={self.n_heads}", self.n_kv_heads)
        if self.head_dim is None:
            require(model.d_model % self.n_heads == 0, f"{path}.n_heads",
                    f"a divisor of d_model={model.d_model} (or set head_dim)", self.n_heads)
            self.head_dim = model.d_model // self.n_heads
        positive(f"{path}.head_dim", self.head_dim)
        if self.rope:
            require(self.head_dim % 2 == 0, f"{path}.head_dim", "even when rope is true", self.head_dim)
        require(self.window is None or self.window >= 1, f"{path}.window", "an integer >= 1 or null", self.window)
        require(self.rope_theta > 0, f"{path}.rope_theta", "> 0", self.rope_theta)


@dataclass
class DSAConfig:
    """DeepSeek sparse attention (SPEC 3): a lightning indexer picks top_k keys per query."""
    n_heads: int = 4                    # H_I index heads
    head_dim: int = 64                  # d_I
    rope_dim: int = 32                  # RoPE on the first rope_dim dims of index queries and keys
    top_k: int = 2048                   # keys attended per query
    stage: str = "sparse"               # dense_warmup (train the indexer only) | sparse
    loss_weight: float = 1.0            # weight of the indexer KL loss (mean over tokens)

    def check(self, path):
        positive(f"{path}.n_heads", self.n_heads)
        positive(f"{path}.head_dim", self.head_dim)
        require(0 <= self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, f"{path}.rope_dim",
                f"an even integer in [0, head_dim={self.head_dim}]", self.rope_dim)
        positive(f"{path}.top_k", self.top_k)
        _one_of(f"{path}.stage", self.stage, DSA_STAGES)
        require(self.loss_weight >= 0, f"{path}.loss_weight", ">= 0", self.loss_weight)


DSA_STAGES = ("dense_warmup", "sparse")


@dataclass
class MLAConfig:
    """Multi-head latent attention (SPEC 2): low-rank KV latent cache, decoupled RoPE, optional DSA."""
    kind: str = "mla"
    n_heads: int = 4
    q_lora_rank: Optional[int] = None   # None = direct query projection
    kv_lora_rank: int = 64              # d_c: the cached latent
    qk_nope_dim: int = 32
    qk_rope_dim: int = 16               # 0 allowed (no rope part)
    v_head_dim: int = 32
    rope: bool = True                   # false = NoPE (Kimi Linear): the rope part is dropped
    rope_theta: float = 10000.0
    dsa: Optional[dict] = None          # a DSAConfig mapping; None = dense MLA

    def check(self, path, model):
        for key in ("n_heads", "kv_lora_rank", "qk_nope_dim", "v_head_dim"):
            positive(f"{path}.{key}", getattr(self, key))
        if self.q_lora_rank is not None:
            positive(f"{path}.q_lora_rank", self.q_lora_rank)
        require(self.qk_rope_dim >= 0, f"{path}.qk_rope_dim", "an integer >= 0", self.qk_rope_dim)
        require(self.qk_rope_dim % 2 == 0, f"{path}.qk_rope_dim", "even (half-split RoPE)", self.qk_rope_dim)
        require(self.rope_theta > 0, f"{path}.rope_theta", "> 0", self.rope_theta)
        if isinstance(self.dsa, dict):
            self.dsa = build(DSAConfig, self.dsa, f"{path}.dsa")
        if self.dsa is not None:
            self.dsa.check(f"{path}.dsa")

    @property
    def rope_dim(self):
        """The rope dims actually used: 0 under NoPE."""
        return self.qk_rope_dim if self.rope else 0


@dataclass
class MLPConfig:
    kind: str = "swiglu"
    hidden: Optional[int] = None        # None = 8/3 d_model rounded up to a multiple of 64

    def check(self, path, model):
        _one_of(f"{path}.kind", self.kind, ["swiglu"])
        if self.hidden is None:
            self.hidden = 64 * math.ceil(8 * model.d_model / 3 / 64)
        positive(f"{path}.hidden", self.hidden)


# kind -> (config dataclass, mixer module); other mixers register themselves further down.
MIXERS = {}


@dataclass
class ModelConfig:
    vocab_size: int = 257
    d_model: int = 256
    n_layer: int = 6
    pattern: list = field(default_factory=lambda: ["local"] * 5 + ["global"])
    layers: dict = field(default_factory=lambda: {
        "local": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2, "window": 64, "sinks": True},
        "global": {"kind": "attn", "n_heads": 4, "n_kv_heads": 2}})
    mlp: dict = field(default_factory=dict)
    norm_eps: float = 1e-6
    init_std: float = 0.02
    backend: Optional[str] = None       # kernels backend: null (auto), torch, triton

    @classmethod
    def from_dict(cls, d, path="model"):
        cfg = build(cls, d, path)
        positive(f"{path}.vocab_size", cfg.vocab_size)
        positive(f"{path}.d_model", cfg.d_model)
        positive(f"{path}.n_layer", cfg.n_layer)
        require(cfg.norm_eps > 0, f"{path}.norm_eps", "> 0", cfg.norm_eps)
        require(cfg.init_std > 0, f"{path}.init_std", "> 0", cfg.init_std)
        require(cfg.backend in (None, *kernels.BACKENDS), f"{path}.backend",
                f"null or one of {', '.join(kernels.BACKENDS)}", cfg.backend)
        require(len(cfg.layers) > 0, f"{path}.layers", "a non-empty mapping of layer names to mixers", cfg.layers)
        layers = {}
        for name, spec in cfg.layers.items():
            lpath = f"{path}.layers.{name}"
            require(isinstance(spec, dict), lpath, "a mapping with a `kind` key", spec)
            _one_of(f"{lpath}.kind", spec.get("kind"), sorted(MIXERS))
            layers[name] = build(MIXERS[spec["kind"]][0], spec, lpath)
            layers[name].check(lpath, cfg)
        cfg.layers = layers
        require(len(cfg.pattern) > 0, f"{path}.pattern", "a non-empty list of names from layers", cfg.pattern)
        for i, name in enumerate(cfg.pattern):
            require(name in layers, f"{path}.pattern[{i}]", f"one of the names in layers ({', '.join(layers)})", name)
        cfg.mlp = build(MLPConfig, cfg.mlp, f"{path}.mlp")
        cfg.mlp.check(f"{path}.mlp", cfg)
        return cfg

    def layer_configs(self):
        """The mixer config of every layer: the pattern cycled to n_layer."""
        return [self.layers[self.pattern[i % len(self.pattern)]] for i in range(self.n_layer)]


# ----------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_angles(positions, dim, theta):
    """cos, sin [T, dim/2] for absolute `positions` [T] (half-split RoPE); [B, T, dim/2] for [B, T]."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def token_positions(x, pos, cache, cu_seqlens, cp=None):
    """Positions [T] of the tokens of x [B, T, ...]: pos .. pos+T-1; with packed documents
    (cu_seqlens, parallel path only) every token's position inside its own document; under context
    parallelism (cp) [B, T]: every row is a piece of the sequence with its own positions."""
    T = x.shape[1]
    if cp is not None:
        return cp.positions(x)
    if cu_seqlens is None:
        return torch.arange(pos, pos + T, device=x.device)
    if cache is not None:
        raise ValueError("cu_seqlens (packed documents) is for the parallel path only: call with cache=None")
    return kernels.doc_positions(cu_seqlens, T)


def apply_rope(x, cos, sin):
    """Rotate x [B, T, H, D] by angles cos, sin [T, D/2] (or [B, T, D/2]): pairs are (x[i], x[i + D/2])."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    cos, sin = cos[..., None, :], sin[..., None, :]         # broadcast over heads
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)   # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)   # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)   # down
        self.w2.residual_out = True

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LayerCache:
    """The tensors one layer keeps between `step` calls."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in vars(self).values() if torch.is_tensor(t))


class Cache:
    """Decode state of a whole model: one LayerCache per layer and the number of tokens seen."""

    def __init__(self, layers, max_len):
        self.layers, self.max_len, self.pos = layers, max_len, 0

    def nbytes(self):
        return sum(layer.nbytes() for layer in self.layers)


# ----------------------------------------------------------------------------------------------
# Softmax attention (SPEC 1)


class Attention(nn.Module):
    def __init__(self, cfg: AttnConfig, model: ModelConfig):
        super().__init__()
        self.cfg, self.backend = cfg, model.backend
        Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(model.d_model, Hq * D, bias=False)
        self.wk = nn.Linear(model.d_model, Hkv * D, bias=False)
        self.wv = nn.Linear(model.d_model, Hkv * D, bias=False)
        self.wo = nn.Linear(Hq * D, model.d_model, bias=False)
        self.wo.residual_out = True
        self.q_norm = RMSNorm(D, model.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, model.norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(Hq)) if cfg.sinks else None

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):
        """x [B, T, d_model] at absolute positions pos .. pos+T-1; cache None = parallel path.
        cu_seqlens: packed documents (B == 1), positions restart at every document.
        cp: context parallelism (context_parallel.py): x is the rank's pieces of the sequence."""
        B, T, _ = x.shape
        c = self.cfg
        positions = token_positions(x, pos, cache, cu_seqlens, cp)
        q = self.wq(x).view(B, T, c.n_heads, c.head_dim)
        k = self.wk(x).view(B, T, c.n_kv_heads, c.head_dim)
        v = self.wv(x).view(B, T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.rope:
            cos, sin = rope_angles(positions, c.head_dim, c.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = self.update_cache(cache, k, v, pos)
        if cp is not None:
            o = cp.attention(q, k, v, window=c.window, sinks=self.sinks, backend=self.backend)
        else:
            o = kernels.attention(q, k, v, window=c.window, sinks=self.sinks, backend=self.backend,
                                  cu_seqlens=cu_seqlens)
        return self.wo(o.reshape(B, T, -1))

    def new_cache(self, batch_size, max_len, device, dtype):
        """Global: K/V [B, Hkv, max_len, D]. Windowed: a ring buffer of `window` slots."""
        slots = max_len if self.cfg.window is None else min(self.cfg.window, max_len)
        shape = (batch_size, self.cfg.n_kv_heads, slots, self.cfg.head_dim)
        return LayerCache(k=torch.zeros(shape, device=device, dtype=dtype),
                          v=torch.zeros(shape, device=device, dtype=dtype))

    def update_cache(self, cache, k, v, pos):
        """Store the new k, v [B, T, Hkv, D]; return every key/value the new queries may see."""
        T, slots = k.shape[1], cache.k.shape[2]
        if self.cfg.window is None:
            if pos + T > slots:
                raise ValueError(f"context of {pos + T} tokens exceeds the cache of a global attention "
                                 f"layer (max_len={slots}); make the cache larger")
            cache.k[:, :, pos:pos + T] = k.transpose(1, 2)
            cache.v[:, :, pos:pos + T] = v.transpose(1, 2)
            return cache.k[:, :, :pos + T].transpose(1, 2), cache.v[:, :, :pos + T].transpose(1, 2)
        # ring buffer: position p lives in slot p % slots; the first new query still sees the
        # window-1 tokens before it, which are all still in the ring.
        n_old = min(pos, self.cfg.window - 1, slots)
        old = torch.arange(pos - n_old, pos, device=k.device) % slots
        k_all = torch.cat([cache.k[:, :, old].transpose(1, 2), k], dim=1)
        v_all = torch.cat([cache.v[:, :, old].transpose(1, 2), v], dim=1)
        n_new = min(T, slots)
        new = torch.arange(pos + T - n_new, pos + T, device=k.device) % slots
        cache.k[:, :, new] = k[:, T - n_new:].transpose(1, 2)
        cache.v[:, :, new] = v[:, T - n_new:].transpose(1, 2)
        return k_all, v_all


MIXERS["attn"] = (AttnConfig, Attention)


# ----------------------------------------------------------------------------------------------
# Delta-rule family (SPEC 4): Kimi Delta Attention, Gated DeltaNet, plain linear attention


DELTA_KINDS = ("kda", "gdn", "linear")


@dataclass
class DeltaConfig:
    """kda: per-channel gate (Kimi Linear); gdn: per-head gate (Gated DeltaNet); linear: no gate,
    no delta rule (S_t = S_{t-1} + k_t v_t^T)."""
    kind: str = "kda"
    n_heads: int = 4
    head_dim: Optional[int] = None      # K; None = d_model // n_heads
    v_head_dim: Optional[int] = None    # V; None = K
    conv_size: int = 4                  # causal depthwise short convolution width; 0 = none
    qk_norm: bool = True                # L2-normalise q and k per head
    output_gate: bool = True            # RMSNorm(o) * gate (sigmoid low-rank for kda, SiLU otherwise)

    def check(self, path, model):
        _one_of(f"{path}.kind", self.kind, DELTA_KINDS)
        positive(f"{path}.n_heads", self.n_heads)
        if self.head_dim is None:
            require(model.d_model % self.n_heads == 0, f"{path}.n_heads",
                    f"a divisor of d_model={model.d_model} (or set head_dim)", self.n_heads)
            self.head_dim = model.d_model // self.n_heads
        positive(f"{path}.head_dim", self.head_dim)
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        positive(f"{path}.v_head_dim", self.v_head_dim)
        require(self.conv_size >= 0, f"{path}.conv_size", "an integer >= 0 (0 = no conv)", self.conv_size)


def inverse_softplus(y):
    return y + torch.log(-torch.expm1(-y))


class DeltaNet(nn.Module):
    """q, k, v = SiLU(ShortConv(x W)); q, k L2-normalised; beta = sigmoid(x W_b);
    log decay g = -exp(A_log) * softplus(gate(x) + dt_bias); o = delta_rule(q, k, v, g, beta);
    out = W_o (RMSNorm(o) * output gate). The decode cache is the fp32 state [B, H, K, V] plus the
    last conv_size - 1 projected inputs: its size does not depend on the context length."""

    def __init__(self, cfg: DeltaConfig, model: ModelConfig):
        super().__init__()
        self.cfg, self.backend = cfg, model.backend
        d, H, K, V = model.d_model, cfg.n_heads, cfg.head_dim, cfg.v_head_dim
        self.qkv_dims = (H * K, H * K, H * V)
        self.w_qkv = nn.Linear(d, sum(self.qkv_dims), bias=False)
        if cfg.conv_size:  # depthwise: one causal filter per channel of q, k and v
            self.conv = nn.Parameter(torch.empty(sum(self.qkv_dims), cfg.conv_size))
        if cfg.kind != "linear":
            self.w_beta = nn.Linear(d, H, bias=False)
            gate_out = H * K if cfg.kind == "kda" else H
            if cfg.kind == "kda":  # low-rank per-channel gate d -> K -> H*K
                self.w_f = nn.Sequential(nn.Linear(d, K, bias=False), nn.Linear(K, gate_out, bias=False))
            else:
                self.w_f = nn.Linear(d, gate_out, bias=False)
            self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
            self.dt_bias = nn.Parameter(torch.empty(gate_out, dtype=torch.float32))
            self.A_log.no_weight_decay = self.dt_bias.no_weight_decay = True
        if cfg.output_gate:
            self.o_norm = RMSNorm(V, model.norm_eps)
            if cfg.kind == "kda":  # low-rank sigmoid gate d -> V -> H*V
                self.w_g = nn.Sequential(nn.Linear(d, V, bias=False), nn.Linear(V, H * V, bias=False))
            else:
                self.w_g = nn.Linear(d, H * V, bias=False)
        self.wo = nn.Linear(H * V, d, bias=False)
        self.wo.residual_out = True

    def reset_special_parameters(self):
        if self.cfg.conv_size:
            nn.init.uniform_(self.conv, -self.cfg.conv_size ** -0.5, self.cfg.conv_size ** -0.5)
        if self.cfg.kind != "linear":
            with torch.no_grad():
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
                dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
                self.dt_bias.copy_(inverse_softplus(dt))

    def short_conv(self, u, cache, doc_pos=None, cp=None):
        """Causal depthwise conv + SiLU over u [B, T, C]; the cache keeps the last conv_size-1 inputs.
        doc_pos [T] (packed documents): each token's position in its document; the conv then reads
        only inputs of the token's own document (tap s, s tokens back, is dropped where doc_pos < s).
        cp (context parallelism): the conv_size-1 inputs before each piece come from the other ranks."""
        if not self.cfg.conv_size:
            return F.silu(u)
        width = self.cfg.conv_size
        if cp is not None:
            past = cp.halo_padded(u, width - 1)
        elif cache is None:
            past = u.new_zeros(u.shape[0], width - 1, u.shape[2])
        else:
            past = cache.conv.to(u.dtype)
        full = torch.cat([past, u], dim=1)                                  # [B, width-1+T, C]
        if cache is not None:
            cache.conv.copy_(full[:, full.shape[1] - (width - 1):])
        if doc_pos is not None:  # the same sum tap by tap, each tap masked at document starts
            T, w = u.shape[1], self.conv.to(u.dtype)                        # w [C, width]: last tap = now
            out = sum(full[:, width - 1 - s:width - 1 - s + T] * w[:, width - 1 - s] * (doc_pos >= s)[:, None]
                      for s in range(width))
            return F.silu(out)
        out = F.conv1d(full.transpose(1, 2), self.conv.to(u.dtype)[:, None, :], groups=u.shape[2])
        return F.silu(out.transpose(1, 2))                                  # [B, T, C]

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):
        B, T, _ = x.shape
        c = self.cfg
        H, K, V = c.n_heads, c.head_dim, c.v_head_dim
        doc_pos = None if cu_seqlens is None else token_positions(x, pos, cache, cu_seqlens)
        q, k, v = self.short_conv(self.w_qkv(x), cache, doc_pos, cp).split(self.qkv_dims, dim=-1)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
        if c.qk_norm:
            q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
        state = None if cache is None else cache.state
        if c.kind == "linear":
            if state is not None and T == 1:
                o = kernels.linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state, scale=1.0)[:, None]
            elif cp is not None:
                o = cp.linear_attention(q, k, v, scale=1.0)
            else:
                o, final = kernels.linear_attention(q, k, v, scale=1.0, initial_state=state,
                                                    output_final_state=state is not None, cu_seqlens=cu_seqlens)
        else:
            beta = torch.sigmoid(self.w_beta(x).float())                    # [B, T, H]
            g = F.softplus(self.w_f(x).float() + self.dt_bias)              # [B, T, H*K] or [B, T, H]
            g = -self.A_log.exp().repeat_interleave(g.shape[-1] // H) * g   # log decay <= 0
            g = g.view(B, T, H, K) if c.kind == "kda" else g
            if state is not None and T == 1:
                o = kernels.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state,
                                            backend=self.backend)[:, None]
            elif cp is not None:
                o = cp.delta_rule(q, k, v, g, beta, backend=self.backend)
            else:
                o, final = kernels.delta_rule(q, k, v, g, beta, initial_state=state,
                                              output_final_state=state is not None, backend=self.backend,
                                              cu_seqlens=cu_seqlens)
        if state is not None and T > 1:
            state.copy_(final)
        if c.output_gate:
            gate = self.w_g(x).view(B, T, H, V)
            gate = torch.sigmoid(gate) if c.kind == "kda" else F.silu(gate)
            o = self.o_norm(o) * gate
        return self.wo(o.reshape(B, T, H * V))

    def new_cache(self, batch_size, max_len, device, dtype):
        c = self.cfg
        conv_width = max(c.conv_size - 1, 0)
        return LayerCache(state=torch.zeros(batch_size, c.n_heads, c.head_dim, c.v_head_dim, device=device),
                          conv=torch.zeros(batch_size, conv_width, sum(self.qkv_dims), device=device, dtype=dtype))


for _kind in DELTA_KINDS:
    MIXERS[_kind] = (DeltaConfig, DeltaNet)


# ----------------------------------------------------------------------------------------------
# Multi-head latent attention (SPEC 2) and DeepSeek sparse attention (SPEC 3)
#
# Dimensions: H heads, d_c = kv_lora_rank (the latent), d_nope = qk_nope_dim, d_rope = qk_rope_dim
# (0 under NoPE), d_v = v_head_dim, r_q = q_lora_rank; indexer: H_I heads of d_I dims, k = top_k.

MLA_BLOCK_Q = 256  # queries per block in the sparse path and the indexer loss: memory O(block * S)


def index_scores(iq, iw, ik):
    """I[b,t,s] = sum_h w[b,t,h] * ReLU(q^I[b,t,h] . k^I[b,s]) * d_I**-0.5, for every s (no mask).

    iq [B, T, H_I, d_I]  iw [B, T, H_I] (already * H_I**-0.5)  ik [B, S, d_I]  ->  [B, T, S] fp32"""
    dots = torch.einsum("bthd,bsd->bths", iq.float(), ik.float()).relu()   # [B, T, H_I, S]
    return torch.einsum("bths,bth->bts", dots, iw.float()) * iq.shape[-1] ** -0.5


def index_scores_selected(iq, iw, ik_sel):
    """The same score against per-query key sets: ik_sel [B, T, k, d_I] -> [B, T, k] fp32."""
    dots = torch.einsum("bthd,btkd->bthk", iq.float(), ik_sel.float()).relu()  # [B, T, H_I, k]
    return torch.einsum("bthk,bth->btk", dots, iw.float()) * iq.shape[-1] ** -0.5


def topk_select(scores, qpos, k, kmin=None):
    """Indices [B, T, k] of the k best keys per query among s <= qpos[t] (and s >= kmin[t] when
    given: packed documents); scores [B, T, S] fp32.

    Deterministic: the order is lexicographic on (score, position), so an exact tie (common: ReLU
    zeros) goes to the most recent key, the same in the parallel path and in decode. Scores are
    mapped to order-preserving integers and packed with the position into one int64 key, so the
    top-k never depends on how torch.topk breaks ties. Keys after a query get score -inf and are
    only picked when a query sees fewer than k keys; the caller masks them (sel > qpos, sel < kmin)."""
    S = scores.shape[-1]
    kpos = torch.arange(S, device=scores.device)
    hidden = kpos[None, :] > qpos[:, None]
    if kmin is not None:
        hidden = hidden | (kpos[None, :] < kmin[:, None])
    scores = scores.masked_fill(hidden[None], float("-inf")) + 0.0  # -0 -> +0
    bits = scores.contiguous().view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)                   # negative floats: flip magnitude bits
    return torch.topk(key.long() * 2 ** 32 + kpos, k, dim=-1).indices  # (score, position) packed


def kl_to_logits(p, logits, valid):
    """sum over rows of KL(p || softmax(logits)) restricted to `valid` entries; p detached, rows sum to 1."""
    logq = logits.masked_fill(~valid, float("-inf")).log_softmax(-1).masked_fill(~valid, 0.0)
    return (torch.xlogy(p, p) - p * logq).masked_fill(~valid, 0.0).sum()


class Indexer(nn.Module):
    """DSA lightning indexer: H_I small ReLU heads scoring every past key (SPEC 3)."""

    def __init__(self, cfg: DSAConfig, d_model, q_in_dim, rope_theta, eps):
        super().__init__()
        self.cfg, self.rope_theta = cfg, rope_theta
        self.wq = nn.Linear(q_in_dim, cfg.n_heads * cfg.head_dim, bias=False)  # c_q (or x) -> q^I
        self.wk = nn.Linear(d_model, cfg.head_dim, bias=False)                 # x -> k^I, one shared key
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=eps)
        self.ww = nn.Linear(d_model, cfg.n_heads, bias=False)                  # x -> per-head weights

    def forward(self, x, q_in, positions):
        """x [B, T, d_model], q_in [B, T, r_q or d_model] -> iq [B,T,H_I,d_I], iw [B,T,H_I], ik [B,T,d_I]."""
        B, T, _ = x.shape
        c = self.cfg
        iq = self.wq(q_in).view(B, T, c.n_heads, c.head_dim)
        ik = self.k_norm(self.wk(x)).view(B, T, 1, c.head_dim)
        if c.rope_dim:
            cos, sin = rope_angles(positions, c.rope_dim, self.rope_theta)
            r = c.rope_dim
            iq = torch.cat([apply_rope(iq[..., :r], cos, sin), iq[..., r:]], dim=-1)
            ik = torch.cat([apply_rope(ik[..., :r], cos, sin), ik[..., r:]], dim=-1)
        iw = self.ww(x) * c.n_heads ** -0.5
        return iq, iw, ik[:, :, 0]


class MLA(nn.Module):
    """Multi-head latent attention; with `dsa`, DeepSeek sparse attention on top.

    Parallel path: the expanded form through kernels.attention (dense), or, in the DSA sparse stage,
    the absorbed form over the top-k latent rows of each query, block by block. Decode: the absorbed
    form over a cache of [c_kv | k_rope] rows (d_c + d_rope numbers per token), plus the indexer's
    keys (d_I per token) with DSA. `absorb` (None: absorbed for 1-token steps, expanded for
    chunks; True/False: force) picks the form of dense `step`s; both equal `forward`.
    """

    def __init__(self, cfg: MLAConfig, model: ModelConfig):
        super().__init__()
        self.cfg, self.backend, self.absorb = cfg, model.backend, None
        H, d_c, d_nope, d_rope, d_v = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.rope_dim, cfg.v_head_dim
        d, r_q = model.d_model, cfg.q_lora_rank
        if r_q is None:
            self.wq = nn.Linear(d, H * (d_nope + d_rope), bias=False)             # W_q
        else:
            self.wq_a = nn.Linear(d, r_q, bias=False)                             # W_dq
            self.q_norm = RMSNorm(r_q, model.norm_eps)
            self.wq_b = nn.Linear(r_q, H * (d_nope + d_rope), bias=False)         # W_uq
        self.wkv_a = nn.Linear(d, d_c + d_rope, bias=False)                       # W_dkv
        self.kv_norm = RMSNorm(d_c, model.norm_eps)
        self.wkv_b = nn.Linear(d_c, H * (d_nope + d_v), bias=False)               # W_ukv = [W_UK_h; W_UV_h]
        self.wo = nn.Linear(H * d_v, d, bias=False)
        self.wo.residual_out = True
        self.scale = (d_nope + d_rope) ** -0.5
        self.indexer = None if cfg.dsa is None else Indexer(cfg.dsa, d, r_q or d, cfg.rope_theta, model.norm_eps)
        self.aux_loss = None

    # -- absorption: W_ukv viewed per head as W_UK [H, d_nope, d_c] and W_UV [H, d_v, d_c]
    def _w_uk_uv(self):
        c = self.cfg
        w = self.wkv_b.weight.view(c.n_heads, c.qk_nope_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_dim], w[:, c.qk_nope_dim:]

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):
        """x [B, T, d_model] at absolute positions pos .. pos+T-1; cache None = parallel path.
        cu_seqlens: packed documents (B == 1): positions restart, the indexer picks within the document.
        cp: context parallelism: the latent rows (and indexer keys) of the whole sequence are gathered."""
        B, T, _ = x.shape
        c = self.cfg
        H, d_c, d_nope, d_rope, d_v = c.n_heads, c.kv_lora_rank, c.qk_nope_dim, c.rope_dim, c.v_head_dim
        positions = token_positions(x, pos, cache, cu_seqlens, cp)
        doc_start = None if cu_seqlens is None else torch.arange(T, device=x.device) - positions  # [T]
        self.aux_loss = None
        want_loss = self.training and cache is None and self.indexer is not None
        # query: c_q = RMSNorm(x W_dq) [B, T, r_q]; q = c_q W_uq  (or q = x W_q)   [B, T, H, d_nope + d_rope]
        if c.q_lora_rank is None:
            c_q, q = None, self.wq(x)
        else:
            c_q = self.q_norm(self.wq_a(x))
            q = self.wq_b(c_q)
        q_nope, q_rope = q.view(B, T, H, d_nope + d_rope).split([d_nope, d_rope], dim=-1)
        # key/value latent: [c_kv (d_c), k_rope (d_rope)] = x W_dkv; c_kv normed; one roped key for all heads
        c_kv, k_rope = self.wkv_a(x).split([d_c, d_rope], dim=-1)          # [B, T, d_c], [B, T, d_rope]
        c_kv = self.kv_norm(c_kv)
        if d_rope:
            cos, sin = rope_angles(positions, d_rope, c.rope_theta)
            q_rope = apply_rope(q_rope, cos, sin)
            k_rope = apply_rope(k_rope[:, :, None], cos, sin)[:, :, 0]
        latent = torch.cat([c_kv, k_rope], dim=-1)                          # [B, T, d_c + d_rope]
        if self.indexer is not None:  # detached input: the indexer learns from its KL loss only
            iq, iw, ik = self.indexer(x.detach(), (x if c_q is None else c_q).detach(), positions)
        if cache is not None:
            latent, ik = self.update_cache(cache, latent, ik if self.indexer is not None else None, pos)
        if cp is not None:  # [B/2, T_total, d_c + d_rope]: the small latent rows cross over, not K/V
            latent = cp.gather(latent)
            ik = cp.gather(ik) if self.indexer is not None else None
        S = latent.shape[1]                                                 # keys visible: 0 .. S-1
        sparse = self.indexer is not None and c.dsa.stage == "sparse"
        absorb = (T == 1) if self.absorb is None else self.absorb
        kl = None
        if sparse or (cache is not None and absorb):
            w_uk, w_uv = self._w_uk_uv()
            q_abs = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)               # q~_h = q_nope_h W_UK_h^T [B,T,H,d_c]
            q_lat = torch.cat([q_abs, q_rope], dim=-1)                         # [B, T, H, d_c + d_rope]
            if sparse:
                if cp is None:
                    o_lat, kl = self._sparse_attention(q_lat, latent, iq, iw, ik, S - T, want_loss, doc_start)
                else:  # piece by piece: the piece's queries from its start, the keys up to its end
                    parts = [self._sparse_attention(q_lat[rows], latent[:, :end], iq[rows], iw[rows], ik[:, :end],
                                                    start, want_loss) for rows, start, end in cp.piece_ranges(q_lat)]
                    o_lat = torch.cat([o for o, _ in parts])
                    kl = sum(part_kl for _, part_kl in parts) if want_loss else None
            else:  # MQA with one kv head: keys [c_kv, k_rope], values c_kv. The head is broadcast to
                # all H heads as a stride-0 view (no copy): with Hq == Hkv PyTorch's SDPA takes its
                # fused path, while Hq != Hkv (enable_gqa) falls back to the ~30x slower math path on CPU.
                rows = latent[:, :, None].expand(B, S, H, d_c + d_rope)
                o_lat = kernels.attention(q_lat, rows, rows[..., :d_c], scale=self.scale,
                                          backend=self.backend)               # [B, T, H, d_c]
            o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)                    # [B, T, H, d_v]
        else:  # expanded: [k_nope_h, v_h] = c_kv W_ukv for every visible key
            Bk = latent.shape[0]
            kv = self.wkv_b(latent[..., :d_c]).view(Bk, S, H, d_nope + d_v)
            k_nope, v = kv.split([d_nope, d_v], dim=-1)                        # [B, S, H, d_nope], [B, S, H, d_v]
            k = torch.cat([k_nope, latent[:, :, None, d_c:].expand(Bk, S, H, d_rope)], dim=-1)
            q = torch.cat([q_nope, q_rope], dim=-1)                            # [B, T, H, d_nope + d_rope]
            if cp is not None:
                o = cp.attention(q, k, v, scale=self.scale, backend=self.backend, gathered=True)
            else:
                o = kernels.attention(q, k, v, scale=self.scale, backend=self.backend,
                                      cu_seqlens=cu_seqlens)                   # [B, T, H, d_v]
            if want_loss and cp is None:
                kl = self._dense_indexer_kl(q.detach(), k.detach(), iq, iw, ik, doc_start)
            elif want_loss:
                kl = sum(self._dense_indexer_kl(q[rows].detach(), k[:, :end].detach(), iq[rows], iw[rows],
                                                ik[:, :end], offset=start) for rows, start, end in cp.piece_ranges(q))
        if want_loss:  # L_I: KL summed over heads' distribution, mean over the B*T query tokens
            self.aux_loss = ("indexer_kl", c.dsa.loss_weight * kl / (B * T))
        return self.wo(o.reshape(B, T, H * d_v))

    def _sparse_attention(self, q_lat, latent, iq, iw, ik, offset, want_loss, doc_start=None):
        """Absorbed attention over each query's top-k keys, query block by query block.

        q_lat [B,T,H,d_c+d_rope]  latent [B,S,d_c+d_rope]  iq [B,T,H_I,d_I]  iw [B,T,H_I]  ik [B,S,d_I]
        Query t sits at position offset + t. doc_start [T] (packed documents, offset 0): the first key
        each query may pick; a block scores only keys from its first query's document start on.
        Returns o_lat [B,T,H,d_c] and the KL sum (or None).
        Memory per block: the index scores [B, block, S] (no grad) and the gathered rows
        [B, block, k, d_c + d_rope]; what autograd keeps is O(T * k), never T x S."""
        B, T, H, _ = q_lat.shape
        d_c = self.cfg.kv_lora_rank
        b = torch.arange(B, device=q_lat.device)[:, None, None]
        outs, kl = [], q_lat.new_zeros((), dtype=torch.float32) if want_loss else None
        for t0 in range(0, T, MLA_BLOCK_Q):
            t1 = min(T, t0 + MLA_BLOCK_Q)
            hi = offset + t1                                                   # keys this block may see
            lo = 0 if doc_start is None else int(doc_start[t0])                # ... from lo on
            qpos = torch.arange(offset + t0, offset + t1, device=q_lat.device)
            kmin = None if doc_start is None else doc_start[t0:t1] - lo
            with torch.no_grad():
                sel = topk_select(index_scores(iq[:, t0:t1], iw[:, t0:t1], ik[:, lo:hi]), qpos - lo,
                                  min(self.cfg.dsa.top_k, hi - lo), kmin) + lo  # [B, Tb, k]
            valid = sel <= qpos[None, :, None]                                 # [B, Tb, k]
            if doc_start is not None:
                valid = valid & (sel >= doc_start[None, t0:t1, None])
            rows = latent[b, sel].float()                                      # [B, Tb, k, d_c + d_rope]
            att = torch.einsum("bthd,btkd->bthk", q_lat[:, t0:t1].float(), rows) * self.scale
            p = att.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)  # [B, Tb, H, k]
            outs.append(torch.einsum("bthk,btkc->bthc", p, rows[..., :d_c]))   # [B, Tb, H, d_c]
            if want_loss:  # L_I on the selected set; the target: heads summed, L1-normalised, detached
                target = p.detach().sum(2)
                target = target / target.sum(-1, keepdim=True)
                logits = index_scores_selected(iq[:, t0:t1], iw[:, t0:t1], ik[b, sel])
                kl = kl + kl_to_logits(target, logits, valid)
        return torch.cat(outs, dim=1).to(q_lat.dtype), kl

    def _dense_indexer_kl(self, q, k, iq, iw, ik, doc_start=None, offset=0):
        """dense_warmup L_I (summed over tokens): KL(p_t || softmax(I_t)) over all s <= t
        (and s >= doc_start[t] with packed documents). Query t sits at position offset + t.

        q, k [B,T,H,d_nope+d_rope] detached. Blocks are checkpointed: autograd keeps only their inputs,
        and the [B, block, H_I, T] ReLU scores are recomputed in backward."""
        from torch.utils.checkpoint import checkpoint
        kl = 0.0
        for t0 in range(0, q.shape[1], MLA_BLOCK_Q):
            t1 = min(q.shape[1], t0 + MLA_BLOCK_Q)
            kl = kl + checkpoint(self._dense_kl_block, q[:, t0:t1], k[:, :offset + t1], iq[:, t0:t1], iw[:, t0:t1],
                                 ik[:, :offset + t1], offset + t0, None if doc_start is None else doc_start[t0:t1],
                                 use_reentrant=False)
        return kl

    def _dense_kl_block(self, q, k, iq, iw, ik, t0, doc_start=None):
        Tb, S = q.shape[1], k.shape[1]
        kpos = torch.arange(S, device=q.device)[None, :]
        valid = kpos <= torch.arange(t0, t0 + Tb, device=q.device)[:, None]
        if doc_start is not None:
            valid = valid & (kpos >= doc_start[:, None])
        with torch.no_grad():  # p_t: the main attention distribution, summed over heads, L1-normalised
            att = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * self.scale   # [B, H, Tb, S]
            p = att.masked_fill(~valid, float("-inf")).softmax(-1).sum(1)             # [B, Tb, S]
            p = p / p.sum(-1, keepdim=True)
        return kl_to_logits(p, index_scores(iq, iw, ik), valid.expand_as(p))

    def new_cache(self, batch_size, max_len, device, dtype):
        """kv [B, max_len, d_c + d_rope] = [c_kv | roped k_rope]; with DSA ik [B, max_len, d_I]."""
        kv = torch.zeros(batch_size, max_len, self.cfg.kv_lora_rank + self.cfg.rope_dim, device=device, dtype=dtype)
        if self.indexer is None:
            return LayerCache(kv=kv)
        return LayerCache(kv=kv, ik=torch.zeros(batch_size, max_len, self.cfg.dsa.head_dim, device=device, dtype=dtype))

    def update_cache(self, cache, latent, ik, pos):
        """Store latent [B, T, d_c + d_rope] (and ik [B, T, d_I]); return every row the new queries see."""
        T, slots = latent.shape[1], cache.kv.shape[1]
        if pos + T > slots:
            raise ValueError(f"context of {pos + T} tokens exceeds the cache of an MLA layer "
                             f"(max_len={slots}); make the cache larger")
        cache.kv[:, pos:pos + T] = latent
        if ik is None:
            return cache.kv[:, :pos + T], None
        cache.ik[:, pos:pos + T] = ik
        return cache.kv[:, :pos + T], cache.ik[:, :pos + T]


MIXERS["mla"] = (MLAConfig, MLA)


# ----------------------------------------------------------------------------------------------
# The model


class Block(nn.Module):
    def __init__(self, mixer_cfg, model: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(model.d_model, model.norm_eps)
        self.mixer = MIXERS[mixer_cfg.kind][1](mixer_cfg, model)
        self.norm2 = RMSNorm(model.d_model, model.norm_eps)
        self.mlp = SwiGLU(model.d_model, model.mlp.hidden)

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):
        x = x + self.mixer(self.norm1(x), cache, pos, cu_seqlens=cu_seqlens, cp=cp)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(c, config) for c in config.layer_configs())
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for m in self.modules():  # mixers with parameters of their own init (gates, decays)
            if m is not self and hasattr(m, "reset_special_parameters"):
                m.reset_special_parameters()

    def _init_weights(self, m):
        std = self.config.init_std
        if isinstance(m, nn.Linear):
            if getattr(m, "residual_out", False):  # outputs that add into the residual stream
                std = std / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, cu_seqlens=None, cp=None):
        """idx [B, T] -> logits [B, T, vocab]; loss (mean cross-entropy, targets -1 ignored) or None.

        cu_seqlens (packed documents, flash-attention's varlen convention): int32 [n_docs + 1] = 0, the
        end of every document, T, with idx [1, T]; the result equals running every document alone.

        cp (context parallelism, context_parallel.py): idx [2B, L] = cp.split(rows) is this rank's
        pieces of the sequence; the loss is the mean over this rank's tokens.

        Mixers with auxiliary losses (the DSA indexer) leave them in `mixer.aux_loss`; they are added
        to the loss and reported in `self.aux_losses` (name -> detached mean over layers); the
        cross-entropy alone is kept in `self.lm_loss`.
        """
        if cu_seqlens is not None:
            if cp is not None:
                raise ValueError("GPT.forward: packed documents (cu_seqlens) are not supported with context "
                                 "parallelism (cp)")
            cu_seqlens = kernels.check_cu_seqlens(cu_seqlens, *idx.shape, "GPT.forward").to(idx.device)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, cu_seqlens=cu_seqlens, cp=cp)
        logits = self.lm_head(self.norm_f(x))
        if targets is None:
            return logits, None
        flat = logits.float().view(-1, logits.size(-1)), targets.reshape(-1)
        if cp is None:
            loss = F.cross_entropy(*flat, ignore_index=-1)
        else:  # this rank's share of the mean over the context group's tokens (their mean is that mean)
            loss = F.cross_entropy(*flat, ignore_index=-1, reduction="sum") / cp.tokens_per_rank(targets)
        self.lm_loss = loss.detach()  # the LM part alone, for logging
        self.aux_losses = {}
        for block in self.blocks:
            aux = getattr(block.mixer, "aux_loss", None)
            if aux is not None:
                name, value = aux
                loss = loss + value
                self.aux_losses.setdefault(name, []).append(value.detach())
        self.aux_losses = {k: torch.stack(v).mean() for k, v in self.aux_losses.items()}
        return logits, loss

    def new_cache(self, batch_size, max_len):
        p = self.wte.weight
        return Cache([b.mixer.new_cache(batch_size, max_len, p.device, p.dtype) for b in self.blocks], max_len)

    @torch.no_grad()
    def step(self, idx, cache):
        """Run chunk idx [B, t] after the cache's tokens; returns logits [B, t, vocab]."""
        x = self.wte(idx)
        for block, layer_cache in zip(self.blocks, cache.layers):
            x = block(x, layer_cache, cache.pos)
        cache.pos += idx.shape[1]
        return self.lm_head(self.norm_f(x))

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None,
                        max_len=None):
        """Yield new tokens [B] one at a time: one parallel `step` over the prompt, then decode.

        max_len: cache length of global layers (default: prompt + max_new_tokens); a longer context
        raises ValueError."""
        cache = self.new_cache(idx.shape[0], max_len or idx.shape[1] + max_new_tokens)
        logits = self.step(idx, cache)[:, -1]
        for i in range(max_new_tokens):
            token = sample_token(logits, temperature, top_k, top_p, generator)
            yield token
            if i + 1 < max_new_tokens:
                logits = self.step(token[:, None], cache)[:, -1]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None):
        """idx [B, T] -> [B, T + max_new_tokens]."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, generator))
        return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx


def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits [B, vocab] -> token ids [B]. temperature 0 = greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set with mass >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
