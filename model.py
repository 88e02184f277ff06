"""hybrid: a language model whose layers mix different attention mechanisms.

A config `pattern` names the mixer of every layer (cycled to n_layer); each mixer has a parallel
path (training, `forward`) and a cached path (`step`: prefill and decode) that give the same logits.

    GPT
      wte                       token embedding, tied with the output head unless tie_embeddings: false
      blocks[i]: Block          x = x + mixer(norm(x));  x = x + mlp(norm(x))
        mixer                   Attention (attn), MLA (mla, + DSA Indexer), ... one class per mixer kind
        mlp                     SwiGLU, or MoE (mlp.kind: moe; the first_k_dense layers stay SwiGLU)
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
from kernels.torch_sparse import index_scores, topk_select  # noqa: F401  (the DSA indexer's torch reference)

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
        if not math.isfinite(value):  # an infinite lr, init_std or rope_theta trains on NaNs
            raise ConfigError(f"{path}: must be a finite number (got {value!r})")
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
    rope_fraction: float = 1.0          # partial RoPE: rotate the first int(head_dim * fraction) dims (Qwen3-Next 0.25)
    qk_norm: bool = False               # RMSNorm on q and k per head
    output_gate: bool = False           # o * sigmoid(x W_g), per channel of every head, before wo (Qwen3-Next)
    bias: bool = False                  # biases on wq, wk, wv, wo (and W_g) (gpt-oss)

    def check(self, path, model):
        require(0 < self.rope_fraction <= 1, f"{path}.rope_fraction", "in (0, 1]", self.rope_fraction)
        check_heads(self, path, model)
        if self.rope:
            require(self.rope_dim >= 2 and self.rope_dim % 2 == 0, f"{path}.rope_fraction",
                    f"a share of head_dim={self.head_dim} giving an even number >= 2 of rotated dims "
                    f"(int(head_dim * rope_fraction))", self.rope_fraction)
        require(self.window is None or self.window >= 1, f"{path}.window", "an integer >= 1 or null", self.window)

    @property
    def rope_dim(self):
        """Rotated dims per head: the first int(head_dim * rope_fraction) (half-split among them)."""
        return int(self.head_dim * self.rope_fraction)


def check_heads(cfg, path, model):
    """n_heads, n_kv_heads (None = n_heads), head_dim (None = d_model // n_heads), rope, rope_theta."""
    positive(f"{path}.n_heads", cfg.n_heads)
    if getattr(cfg, "n_kv_heads", 1) is None:
        cfg.n_kv_heads = cfg.n_heads
    if hasattr(cfg, "n_kv_heads"):
        positive(f"{path}.n_kv_heads", cfg.n_kv_heads)
        require(cfg.n_heads % cfg.n_kv_heads == 0, f"{path}.n_kv_heads",
                f"a divisor of n_heads={cfg.n_heads}", cfg.n_kv_heads)
    if cfg.head_dim is None:
        require(model.d_model % cfg.n_heads == 0, f"{path}.n_heads",
                f"a divisor of d_model={model.d_model} (or set head_dim)", cfg.n_heads)
        cfg.head_dim = model.d_model // cfg.n_heads
    positive(f"{path}.head_dim", cfg.head_dim)
    if cfg.rope and getattr(cfg, "rope_fraction", 1.0) == 1.0:  # partial RoPE: its own check
        require(cfg.head_dim % 2 == 0, f"{path}.head_dim", "even when rope is true", cfg.head_dim)
    require(cfg.rope_theta > 0, f"{path}.rope_theta", "> 0", cfg.rope_theta)


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
    rope: bool = True                   # false = NoPE (Kimi Linear): the qk_rope_dim part stays, unrotated
    rope_theta: float = 10000.0
    norm_eps: Optional[float] = None    # eps of the latent norms (q_norm, kv_norm); None = model.norm_eps
                                        # (transformers' Kimi Linear and DeepSeek use 1e-6 there)
    dsa: Optional[dict] = None          # a DSAConfig mapping; None = dense MLA

    def check(self, path, model):
        for key in ("n_heads", "kv_lora_rank", "qk_nope_dim", "v_head_dim"):
            positive(f"{path}.{key}", getattr(self, key))
        if self.q_lora_rank is not None:
            positive(f"{path}.q_lora_rank", self.q_lora_rank)
        require(self.qk_rope_dim >= 0, f"{path}.qk_rope_dim", "an integer >= 0", self.qk_rope_dim)
        require(self.qk_rope_dim % 2 == 0, f"{path}.qk_rope_dim", "even (half-split RoPE)", self.qk_rope_dim)
        require(self.rope_theta > 0, f"{path}.rope_theta", "> 0", self.rope_theta)
        require(self.norm_eps is None or self.norm_eps > 0, f"{path}.norm_eps", "> 0 or null", self.norm_eps)
        if isinstance(self.dsa, dict):
            self.dsa = build(DSAConfig, self.dsa, f"{path}.dsa")
        if self.dsa is not None:
            self.dsa.check(f"{path}.dsa")

    @property
    def rope_dim(self):
        """The shared key part (and its query part): rotated with rope, kept unrotated under NoPE
        (Kimi Linear); always counted in the softmax scale (d_nope + d_rope) ** -0.5."""
        return self.qk_rope_dim


_USED_ONLY_WITH = {"bias_update_rate": ("router", "sigmoid"),  # MoE settings read under one choice only
                   "swiglu_alpha": ("expert_act", "swiglu_clamped"), "swiglu_limit": ("expert_act", "swiglu_clamped")}


@dataclass
class MLPConfig:
    """swiglu: one SwiGLU MLP per layer. moe: token-choice top-k mixture of SwiGLU experts (SPEC 10)."""
    kind: str = "swiglu"                # swiglu | moe
    hidden: Optional[int] = None        # swiglu: the MLP's hidden; moe: each expert's. None = 8/3 d_model
                                        # rounded up to a multiple of 64
    n_experts: int = 8                  # moe: routed experts
    top_k: int = 2                      # moe: experts per token
    n_shared: int = 0                   # moe: always-on shared experts (one SwiGLU of shared_hidden)
    shared_hidden: Optional[int] = None  # moe: None = n_shared * hidden
    shared_gate: bool = False           # moe: sigmoid(x w) scales the shared output (Qwen3-Next)
    router: str = "softmax"             # moe: softmax (Qwen3-Next) | sigmoid (DeepSeek-V3: + balancing bias)
    norm_topk: bool = True              # moe: renormalise the top-k weights to sum to 1
    routed_scale: float = 1.0           # moe: multiplies the routed output (DeepSeek-V3 2.5, Kimi 2.446)
    n_group: int = 1                    # moe: group-limited routing (DeepSeek-V3: 8 groups, the best
    topk_group: int = 1                 #      topk_group by their top-2 score sum hold the chosen experts)
    first_k_dense: int = 0              # moe: the first k layers keep a dense SwiGLU of dense_hidden
    dense_hidden: Optional[int] = None  # moe: None = 8/3 d_model rounded up to a multiple of 64
    bias_update_rate: float = 0.001     # moe, sigmoid: the balancing bias step per optimizer step
    bias: bool = False                  # moe: biases on the router and the routed experts' matmuls (gpt-oss)
    expert_act: str = "swiglu"          # moe, routed experts: swiglu, silu(g) * u | swiglu_clamped (gpt-oss):
    swiglu_alpha: float = 1.702         #   g = min(g, limit), u = clamp(u, -limit, limit),
    swiglu_limit: float = 7.0           #   g * sigmoid(alpha * g) * (u + 1)

    def check(self, path, model):
        _one_of(f"{path}.kind", self.kind, MLP_KINDS)
        default = 64 * math.ceil(8 * model.d_model / 3 / 64)
        if self.hidden is None:
            self.hidden = default
        positive(f"{path}.hidden", self.hidden)
        if self.kind != "moe":
            return
        positive(f"{path}.n_experts", self.n_experts)
        require(1 <= self.top_k <= self.n_experts, f"{path}.top_k", f"in [1, n_experts={self.n_experts}]", self.top_k)
        require(self.n_shared >= 0, f"{path}.n_shared", "an integer >= 0", self.n_shared)
        if self.shared_hidden is None:
            self.shared_hidden = self.n_shared * self.hidden
        require(self.shared_hidden >= 0 and (self.shared_hidden > 0) == (self.n_shared > 0), f"{path}.shared_hidden",
                "> 0 exactly when n_shared > 0", self.shared_hidden)
        require(not self.shared_gate or self.n_shared > 0, f"{path}.shared_gate", "false without shared experts",
                self.shared_gate)
        _one_of(f"{path}.router", self.router, ROUTERS)
        require(self.routed_scale > 0, f"{path}.routed_scale", "> 0", self.routed_scale)
        require(self.n_group >= 1 and self.n_experts % self.n_group == 0 and
                (self.n_group == 1 or self.n_experts // self.n_group >= 2), f"{path}.n_group",
                f"a divisor of n_experts={self.n_experts} leaving >= 2 experts per group", self.n_group)
        require(1 <= self.topk_group <= self.n_group and self.top_k <= self.topk_group * self.n_experts // self.n_group,
                f"{path}.topk_group", f"in [1, n_group={self.n_group}], holding >= top_k experts", self.topk_group)
        require(0 <= self.first_k_dense <= model.n_layer, f"{path}.first_k_dense",
                f"in [0, n_layer={model.n_layer}]", self.first_k_dense)
        if self.dense_hidden is None:
            self.dense_hidden = default
        positive(f"{path}.dense_hidden", self.dense_hidden)
        require(self.bias_update_rate >= 0, f"{path}.bias_update_rate", ">= 0", self.bias_update_rate)
        _one_of(f"{path}.expert_act", self.expert_act, EXPERT_ACTS)
        require(self.swiglu_limit > 0, f"{path}.swiglu_limit", "> 0", self.swiglu_limit)

    def refuse_unused(self, path):
        """Refuse a setting this MLP would ignore: a MoE key on a dense MLP (n_experts without kind: moe),
        bias_update_rate without the sigmoid router, swiglu_alpha / swiglu_limit without swiglu_clamped.
        For configs about to train (config.refuse_unused), not for those saved in checkpoints."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("kind", "hidden") or value == f.default:
                continue
            require(self.kind == "moe", f"{path}.{f.name}", f"left out: it is a MoE setting and {path}.kind is "
                    f"{self.kind} (set {path}.kind: moe)", value)
            key, needed = _USED_ONLY_WITH.get(f.name, (None, None))
            require(key is None or getattr(self, key) == needed, f"{path}.{f.name}", f"left at its default without "
                    f"{key}: {needed} (it is used only there)", value)

    def is_moe(self, layer):
        return self.kind == "moe" and layer >= self.first_k_dense

    def dense_size(self):
        """Hidden of the dense MLPs (every layer for swiglu, the first_k_dense layers for moe)."""
        return self.dense_hidden if self.kind == "moe" else self.hidden


MLP_KINDS = ("swiglu", "moe")
ROUTERS = ("softmax", "sigmoid")
EXPERT_ACTS = ("swiglu", "swiglu_clamped")


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
    tie_embeddings: bool = True         # false = an output head of its own (Kimi Linear, Qwen3-Next, gpt-oss)
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


class ScaleNorm(torch.autograd.Function):
    """y = (x r) w with r = rsqrt(|x|^2 / n + eps) over the last dim, in fp32: RMSNorm (n = dim) and,
    without w, the L2 norm (n = 1). Autograd through the elementwise chain keeps x^ besides x and runs
    about ten passes over x-sized tensors; the backward by hand keeps x and r [..., 1]. With x^ = x r,
    g^ = g w and dot = sum(g^ x) per row (so sum(g^ x^) = r dot):
        dx = r (g^ - x^ sum(g^ x^) / n) = (g^ + x c) r,   c = -r^2 dot / n   [..., 1]
        dw = sum over rows of g x^ = r^T (g x)   (a matrix-vector product over the rows)
    Three passes write x-sized tensors (g x, g w, then x c and r applied to g w in place), and no sum runs
    down the rows as a strided reduction: forward + backward at [8, 256, 256] on the CPU 2.6-3.1 -> 2.0 ms."""

    @staticmethod
    def forward(ctx, x, weight, eps, n):
        xf = x.float()
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(n).add_(eps).rsqrt_()  # [..., 1]
        ctx.save_for_backward(x, r, weight)
        ctx.n = n
        y = (xf * r).to(x.dtype)
        if weight is None:
            return y
        return y.mul_(weight) if torch.promote_types(y.dtype, weight.dtype) == y.dtype else y * weight  # y is new

    @staticmethod
    def backward(ctx, g):
        x, r, weight = ctx.saved_tensors
        xf, g = x.float(), g.float()
        dw = None
        if weight is None:
            dot = torch.linalg.vecdot(g, xf).unsqueeze(-1)                    # [..., 1]
        else:
            gx = g * xf
            dot = (gx @ weight.float()).unsqueeze(-1)                         # sum(g w x): [..., 1]
            if ctx.needs_input_grad[1]:
                if x.dtype in (torch.float32, torch.float64):
                    dw = (r.flatten() @ gx.flatten(0, -2)).to(weight.dtype)
                else:  # the forward rounded x^ to x's dtype before the weight
                    dw = (g * (xf * r).to(x.dtype)).flatten(0, -2).sum(0).to(weight.dtype)
            del gx
        dx = None
        if ctx.needs_input_grad[0]:
            c = dot.mul_(r.square()).div_(-ctx.n)                             # [..., 1]
            g_hat_plus = torch.addcmul(g, xf, c) if weight is None else torch.mul(g, weight.float()).addcmul_(xf, c)
            dx = g_hat_plus.mul_(r).to(x.dtype)
        return dx, dw, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return scale_norm(x, self.weight, self.eps, x.shape[-1])


# Under torch.compile the Functions above and below give way to their formulas, which Inductor fuses. Torch 2.11
# (the GPU machines' torch here) computes wrong gradients for ScaleNorm, SiluMul and Rope under compile (0 or
# off by O(1); the smallest case: a Function whose forward returns `(a * 2).mul_(b)`); torch 2.13 gets them
# right. tests/test_layer_options.py shows the formulas equal the Functions.
def scale_norm(x, weight, eps, n):
    """ScaleNorm, or under torch.compile its formula."""
    if not torch.compiler.is_compiling():
        return ScaleNorm.apply(x, weight, eps, n)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) / n + eps)).to(x.dtype)
    return y if weight is None else y * weight


def rope_angles(positions, dim, theta):
    """cos, sin [..., T, dim/2] for absolute `positions` [..., T] (half-split RoPE)."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv_freq  # [..., T, dim/2]
    return angles.cos(), angles.sin()


def doc_spans(cu_seqlens):
    """[(start, end)] of every non-empty packed document."""
    return [(a, b) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()) if b > a]


def token_positions(x, pos, cache, cu_seqlens, cp=None):
    """Positions of the tokens of x [B, T, ...]: pos .. pos+T-1 [T] for an int pos, [B, T] for a tensor
    of per-row starts [B] (the serving engine decodes requests at different positions together); with
    packed documents (cu_seqlens, parallel path only) every token's position inside its own document;
    under context parallelism (cp) [B, T]: every row is a piece of the sequence with its own positions."""
    T = x.shape[1]
    if cp is not None:
        return cp.positions(x)
    if cu_seqlens is not None:
        if cache is not None:
            raise ValueError("cu_seqlens (packed documents) is for the parallel path only: call with cache=None")
        return kernels.doc_positions(cu_seqlens, T)
    if torch.is_tensor(pos):
        return pos.to(x.device)[:, None] + torch.arange(T, device=x.device)
    return torch.arange(pos, pos + T, device=x.device)


def apply_rope(x, cos, sin):
    """Rotate x [B, T, H, D] by angles cos, sin [T, R/2] (or per row [B, T, R/2]): pairs are
    (x[i], x[i + R/2]) among the first R dims; dims R.. pass unrotated (partial RoPE). R == D is full RoPE.
    Under torch.compile the formula (see scale_norm)."""
    return rotate(x, cos, sin) if torch.compiler.is_compiling() else Rope.apply(x, cos, sin)


def rotate(x, cos, sin):
    """[x1 cos - x2 sin, x2 cos + x1 sin, rest] (x1, x2: the halves of the first R dims), computed in
    fp32, returned in x's dtype. Eager: x [c, c] over whole rows into one output, then a fused
    multiply-add per half (no swapped copy of x: about 2x faster on the CPU than x c + swap(x) s; and
    1.3x faster than a multiply per half, whose inner loops are only R/2 long).
    Under torch.compile (which refuses out= views) the formula, which Inductor fuses."""
    r = cos.shape[-1]
    xf = x.float()
    c, s = cos[..., None, :], sin[..., None, :]                       # [(B,) T, 1, R/2]: every head
    x1, x2, rest = xf[..., :r], xf[..., r:2 * r], xf[..., 2 * r:]     # dims past R pass unrotated
    if torch.compiler.is_compiling():
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], -1).to(x.dtype)
    out = torch.empty(xf.shape, dtype=xf.dtype, device=xf.device)
    torch.mul(xf[..., :2 * r], torch.cat([c, c], -1), out=out[..., :2 * r])   # whole rows: long inner loops
    out[..., :r].addcmul_(x2, s, value=-1)
    out[..., r:2 * r].addcmul_(x1, s)
    out[..., 2 * r:] = rest
    return out.to(x.dtype)


class Rope(torch.autograd.Function):
    """RoPE with its backward by hand: a rotation's transpose is the rotation by the opposite angle,
    so the gradient is rotated by (cos, -sin); nothing the size of x is kept."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return rotate(g, cos, -sin), None, None


class SiluMul(torch.autograd.Function):
    """silu(gate) * up with the backward by hand: it keeps gate and up only (autograd also kept
    silu(gate)) and recomputes silu(gate) in place into d_up.
        d_up = g silu(gate),   d_gate = silu'(gate) g up"""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(g * up, gate), F.silu(gate).mul_(g)


def silu_mul(gate, up):
    """SiluMul, or under torch.compile its formula (see scale_norm)."""
    return F.silu(gate) * up if torch.compiler.is_compiling() else SiluMul.apply(gate, up)


def conv_tap(w, s, keep_from, rows=None):
    """Tap s's weights (s tokens back) of w [W, C]: [C], or with packed documents (keep_from: every
    token's position in its document, [T]) [T, C], zero where the tap reaches before the document."""
    ws = w[w.shape[0] - 1 - s]
    if keep_from is None:
        return ws
    ws = ws * (keep_from >= s)[:, None].to(ws.dtype)
    return ws if rows is None else ws[rows]


class ShortConv(torch.autograd.Function):
    """Causal depthwise convolution over time, then SiLU (the short conv of KDA, GDN and linear attention):
        pre[t] = sum_s w[W-1-s] x[t-s],  y = silu(pre),  x = [past | u]
    with past [B, W-1, C] the inputs before u [B, T, C] (zeros, the cache, or another rank's rows) and
    w [W, C]. Tap by tap in [B, T, C] (on the CPU 1.6x faster than F.conv1d's [B, C, T] layout), each a
    fused multiply-add into one buffer, reading u and past in place (no [past | u] copy). The backward
    by hand keeps u, past and pre, and reduces each tap's weight gradient over a contiguous product
    (a sum over a strided slice is ~6x slower). Autograd through the formula ran about 2.5x the passes.
    doc_pos [T] (packed documents): tap s is dropped where doc_pos < s. Eager only: see short_conv."""

    @staticmethod
    def forward(ctx, past, u, w, doc_pos):
        W, T = w.shape[0], u.shape[1]
        pre = u * conv_tap(w, 0, doc_pos)
        for s in range(1, W):
            n = min(s, T)                                               # rows that read the past
            if T > s:
                pre[:, s:].addcmul_(u[:, :T - s], conv_tap(w, s, doc_pos, slice(s, T)))
            if doc_pos is None:                                         # (a document starts at row 0)
                pre[:, :n].addcmul_(past[:, W - 1 - s:W - 1 - s + n], conv_tap(w, s, None))
        ctx.save_for_backward(past, u, w, pre, doc_pos)
        return F.silu(pre)

    @staticmethod
    def backward(ctx, g):
        past, u, w, pre, doc_pos = ctx.saved_tensors
        W, (B, T, C) = w.shape[0], u.shape
        gp = torch.ops.aten.silu_backward(g, pre)                       # d pre [B, T, C]
        du = gp * conv_tap(w, 0, doc_pos) if ctx.needs_input_grad[1] else None
        dpast = torch.zeros_like(past) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w) if ctx.needs_input_grad[2] else None
        buf = torch.empty_like(gp).view(-1) if dw is not None else None
        for s in range(W):
            m, n = max(T - s, 0), min(s, T)                             # rows of u / of past the tap reads
            if s and du is not None and m:
                du[:, :m].addcmul_(gp[:, s:], conv_tap(w, s, doc_pos, slice(s, T)))
            if s and dpast is not None and doc_pos is None:
                dpast[:, W - 1 - s:W - 1 - s + n].addcmul_(gp[:, :n], conv_tap(w, s, None))
            if dw is not None:
                prod = torch.mul(gp[:, s:], u[:, :m], out=buf[:B * m * C].view(B, m, C))
                if s and doc_pos is not None:
                    prod.mul_((doc_pos[s:] >= s)[:, None].to(prod.dtype))
                dws = prod.view(-1, C).sum(0)
                if s and doc_pos is None:
                    dws += (gp[:, :n] * past[:, W - 1 - s:W - 1 - s + n]).flatten(0, 1).sum(0)
                dw[W - 1 - s] = dws
        return dpast, du, dw, None


def short_conv(past, u, w, doc_pos=None):
    """ShortConv, or under torch.compile (which refuses its out= views) the formula, which Inductor fuses."""
    if not torch.compiler.is_compiling():
        return ShortConv.apply(past, u, w, doc_pos)
    W, T = w.shape[0], u.shape[1]
    full = torch.cat([past, u], dim=1)
    return F.silu(sum(full[:, W - 1 - s:W - 1 - s + T] * conv_tap(w, s, doc_pos) for s in range(W)))


def _pad16(n):
    """n rounded up to a multiple of 16."""
    return -(-n // 16) * 16


class PaddedLinear(torch.autograd.Function):
    """x @ w^T, w [n, k], with the products whose result is n or k wide computed at a multiple of 16 and cut
    back: the forward pads w's rows with zeros (x @ w_pad^T [..., :n]), the backward's dx = g @ w pads w's
    columns. On the CPU MKL's sgemm runs a training-sized product whose result is not a multiple of 8 wide far
    below its speed at the next multiple of 16: 2,048 rows x 256 -> 683 (Qwen3-Next's SwiGLU) at 52 GFLOP/s
    against 89 at 688 (AMD EPYC, one thread; bench/bench_linear_width.py). dw = g^T x keeps its size (n as rows
    costs nothing)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        n, k = w.shape
        if n % 16 == 0:
            return F.linear(x, w)
        return F.linear(x, F.pad(w, (0, 0, 0, _pad16(n) - n)))[..., :n]

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        n, k = w.shape
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g @ w if k % 16 == 0 else (g @ F.pad(w, (0, _pad16(k) - k)))[..., :k]
        if ctx.needs_input_grad[1]:
            dw = g.reshape(-1, n).t() @ x.reshape(-1, k)
        return dx, dw


def linear(x, w):
    """F.linear(x, w) (no bias), through PaddedLinear where that is faster: float32 on the CPU, eager, a width
    (n or k of w [n, k]) >= 256 that is not a multiple of 16 (at most 6% more multiply-adds) and at least
    1,024 rows (fewer gain little: for n = 683, 1.06x and 1.08x at 512 and 1,024 rows, 1.45x at 2,048)."""
    n, k = w.shape
    odd = lambda width: width % 16 and width >= 256
    if ((odd(n) or odd(k)) and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32
            and x.numel() >= 1024 * k and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
        return PaddedLinear.apply(x, w)
    return F.linear(x, w)


class SwiGLU(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)   # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)   # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)   # down
        self.w2.residual_out = True

    def forward(self, x):
        # gate and up as two matmuls: on the CPU 1.07x faster forward + backward than one into [gate | up],
        # whose halves are strided views; `linear` pads a hidden that is not a multiple of 16 (e.g. 683)
        return linear(silu_mul(linear(x, self.w1.weight), linear(x, self.w3.weight)), self.w2.weight)


class MoE(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts plus optional shared experts (SPEC 10).

    Router: softmax (top-k of the softmax) or sigmoid (top-k of sigmoid + a balancing bias that only
    selects; the weights are the selected sigmoids), optionally renormalised, times routed_scale.
    Assignments are sorted by expert; on CUDA all experts run as batched matmuls over the sorted
    assignments laid out [E, C, d] (C = the busiest expert's count, zero rows as padding), on the CPU
    one matmul per expert over its own tokens (no padding); `padded` forces either. No loop over tokens,
    no capacity: no token is dropped. The sigmoid router's bias is a
    buffer nudged by update_router_bias() outside the gradient (DeepSeek-V3's auxiliary-loss-free
    balancing); `load` counts the assignments per expert since the last update. `bias` adds learned
    biases to the router and the experts, `expert_act: swiglu_clamped` gpt-oss's expert activation."""

    def __init__(self, cfg: MLPConfig, d_model, init_std):
        super().__init__()
        self.cfg, self.init_std = cfg, init_std
        E, h = cfg.n_experts, cfg.hidden
        self.router = nn.Linear(d_model, E, bias=cfg.bias)
        self.w1 = nn.Parameter(torch.empty(E, h, d_model))                 # gate   [E, hidden, d]
        self.w3 = nn.Parameter(torch.empty(E, h, d_model))                 # up     [E, hidden, d]
        self.w2 = nn.Parameter(torch.empty(E, d_model, h))                 # down   [E, d, hidden]
        if cfg.bias:                                                       # their biases (gpt-oss)
            self.b1, self.b3, self.b2 = (nn.Parameter(torch.zeros(E, n)) for n in (h, h, d_model))
            for b in (self.b1, self.b3, self.b2):
                b.no_weight_decay = True
        self.register_buffer("router_bias", torch.zeros(E), persistent=cfg.router == "sigmoid")
        self.register_buffer("load", torch.zeros(E), persistent=False)
        self.shared = SwiGLU(d_model, cfg.shared_hidden) if cfg.n_shared else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if cfg.shared_gate else None
        self.padded = None                                                 # None: padded on CUDA only

    def reset_special_parameters(self, n_layer=1):
        for w in (self.w1, self.w3):
            nn.init.normal_(w, 0.0, self.init_std)
        nn.init.normal_(self.w2, 0.0, self.init_std / math.sqrt(2 * n_layer))
        if self.cfg.bias:
            for b in (self.b1, self.b3, self.b2):
                nn.init.zeros_(b)

    def activation(self, g, u):
        """The experts' gated activation of gate g and up u."""
        c = self.cfg
        if c.expert_act == "swiglu":
            return silu_mul(g, u)
        g, u = g.clamp(max=c.swiglu_limit), u.clamp(-c.swiglu_limit, c.swiglu_limit)  # gpt-oss: clamped,
        return g * torch.sigmoid(c.swiglu_alpha * g) * (u + 1)                  # sigmoid gain, up + 1

    def expert(self, e, xe):
        """Routed expert e on its tokens xe [n, d] -> [n, d]."""
        g, u = xe @ self.w1[e].T, xe @ self.w3[e].T
        if self.cfg.bias:
            g, u = g + self.b1[e], u + self.b3[e]
        y = self.activation(g, u) @ self.w2[e].T
        return y + self.b2[e] if self.cfg.bias else y

    def experts_padded(self, xs, counts):
        """Every expert at once: the sorted assignments xs [N*k, d] laid out [E, C, d] (C = the largest
        count; unused rows zero, never read back), three batched matmuls, the rows gathered back."""
        E, C = self.cfg.n_experts, int(counts.max())
        expert_of = torch.repeat_interleave(torch.arange(E, device=xs.device), counts)   # [N*k]
        slot = torch.arange(len(xs), device=xs.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
        rows = xs.new_zeros(E, C, xs.shape[1]).index_put((expert_of, slot), xs)          # [E, C, d]
        g, u = torch.bmm(rows, self.w1.transpose(1, 2)), torch.bmm(rows, self.w3.transpose(1, 2))  # [E, C, h]
        if self.cfg.bias:
            g, u = g + self.b1[:, None], u + self.b3[:, None]
        y = torch.bmm(self.activation(g, u), self.w2.transpose(1, 2))                    # [E, C, d]
        if self.cfg.bias:
            y = y + self.b2[:, None]
        return y[expert_of, slot]

    def route(self, x):
        """x [N, d] -> expert ids [N, k], weights [N, k] (fp32)."""
        c = self.cfg
        logits = self.router(x).float()                                     # [N, E]
        scores = logits.softmax(-1) if c.router == "softmax" else logits.sigmoid()
        choice = scores if c.router == "softmax" else scores + self.router_bias
        if c.n_group > 1:  # only experts of the topk_group groups with the best top-2 sums compete
            groups = choice.view(-1, c.n_group, c.n_experts // c.n_group)      # [N, G, E/G]
            best = groups.topk(2, dim=-1).values.sum(-1).topk(c.topk_group, dim=-1).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(1, best, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(c.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if c.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scale

    def forward(self, x):
        B, T, d = x.shape
        xf = x.reshape(B * T, d)
        ids, w = self.route(xf)
        flat = ids.reshape(-1)                                              # [N*k] assignment -> expert
        order = flat.argsort(stable=True)                                   # assignments sorted by expert
        token = order // self.cfg.top_k                                    # their tokens
        counts = torch.bincount(flat, minlength=self.cfg.n_experts)
        if self.training:
            self.load += counts.to(self.load.dtype)
        xs = xf[token]                                                      # [N*k, d] grouped by expert
        if self.padded if self.padded is not None else x.is_cuda:
            ys = self.experts_padded(xs, counts)
        else:  # every expert, even an empty one: each weight gets a gradient
            ys = torch.cat([self.expert(e, xe) for e, xe in enumerate(xs.split(counts.tolist()))])
        ys = ys * w.reshape(-1)[order, None].to(x.dtype)
        out = torch.zeros_like(xf).index_add_(0, token, ys)                 # [N, d]
        if self.shared is not None:
            s = self.shared(xf)
            out = out + (torch.sigmoid(self.shared_gate(xf)) * s if self.shared_gate is not None else s)
        return out.view(B, T, d)

    @torch.no_grad()
    def update_router_bias(self, update=True):
        """After an optimizer step: the load since the last call (summed over ranks), and for the
        sigmoid router bias += rate * sign(mean load - load). Returns the load as fractions."""
        load = self.load.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)
        self.load.zero_()
        if update and self.cfg.router == "sigmoid":
            self.router_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        return load / load.sum().clamp_min(1)


class LayerCache:
    """The tensors one layer keeps between `step` calls."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in vars(self).values() if torch.is_tensor(t))


def ring_append(ring, x, pos, keep):
    """Ring buffer ring [B, slots, ...] holds position p in slot p % slots. Write x [B, T, ...] (positions
    pos .. pos+T-1, cast to the ring's dtype) and return the min(pos, keep, slots) rows before pos
    followed by x: every row a query of the chunk may need when it looks back `keep` positions."""
    T, slots = x.shape[1], ring.shape[1]
    x = x.to(ring.dtype)                                    # bf16 under autocast, the cache is not
    n_old = min(pos, keep, slots)
    old = torch.arange(pos - n_old, pos, device=x.device) % max(slots, 1)
    out = torch.cat([ring[:, old], x], dim=1)
    n_new = min(T, slots)
    new = torch.arange(pos + T - n_new, pos + T, device=x.device) % max(slots, 1)
    ring[:, new] = x[:, T - n_new:]
    return out


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
        self.wq = nn.Linear(model.d_model, Hq * D, bias=cfg.bias)
        self.wk = nn.Linear(model.d_model, Hkv * D, bias=cfg.bias)
        self.wv = nn.Linear(model.d_model, Hkv * D, bias=cfg.bias)
        self.wo = nn.Linear(Hq * D, model.d_model, bias=cfg.bias)
        self.wo.residual_out = True
        self.wg = nn.Linear(model.d_model, Hq * D, bias=cfg.bias) if cfg.output_gate else None
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
        # one matmul for q | k | v (fewer, larger matmuls: faster on CPU than three)
        w_qkv = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])
        b_qkv = None if self.wq.bias is None else torch.cat([self.wq.bias, self.wk.bias, self.wv.bias])
        q, k, v = F.linear(x, w_qkv, b_qkv).split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                                            c.n_kv_heads * c.head_dim], dim=-1)
        q = q.view(B, T, c.n_heads, c.head_dim)
        k, v = k.view(B, T, c.n_kv_heads, c.head_dim), v.view(B, T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.rope:
            cos, sin = rope_angles(positions, c.rope_dim, c.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None and hasattr(cache, "attend"):  # a paged cache (engine.py) reads its blocks
            o = cache.attend(self, q, k, v)                                   # [B, T, Hq, D]
        else:
            if cache is not None:
                k, v = self.update_cache(cache, k, v, pos)
            if cp is not None:
                o = cp.attention(q, k, v, window=c.window, sinks=self.sinks, backend=self.backend)
            else:
                o = kernels.attention(q, k, v, window=c.window, sinks=self.sinks, backend=self.backend,
                                      cu_seqlens=cu_seqlens)
        if self.wg is not None:  # gated attention: one sigmoid gate per output channel  [B, T, Hq, D]
            o = o * torch.sigmoid(self.wg(x)).view_as(o)
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
        if pos + T > slots and slots < self.cfg.window:  # the context outgrew max_len: keep the window
            self.grow_ring(cache, pos)
        # ring buffer: position p lives in slot p % slots; the first new query still sees the
        # window-1 tokens before it, which are all still in the ring.
        return (ring_append(cache.k.transpose(1, 2), k, pos, self.cfg.window - 1),
                ring_append(cache.v.transpose(1, 2), v, pos, self.cfg.window - 1))


    def grow_ring(self, cache, pos):
        """A ring made for max_len < window slots, grown to `window` slots (positions 0..pos-1 kept),
        so a windowed layer sees its whole window whatever max_len the cache was made for."""
        slots, window = cache.k.shape[2], self.cfg.window
        k = cache.k.new_zeros(*cache.k.shape[:2], window, cache.k.shape[3])
        v = torch.zeros_like(k)
        held = torch.arange(max(0, pos - slots), pos, device=k.device)
        k[:, :, held % window], v[:, :, held % window] = cache.k[:, :, held % slots], cache.v[:, :, held % slots]
        cache.k, cache.v = k, v


MIXERS["attn"] = (AttnConfig, Attention)


# ----------------------------------------------------------------------------------------------
# Delta-rule family (SPEC 4): Kimi Delta Attention, Gated DeltaNet, plain linear attention


DELTA_KINDS = ("kda", "gdn", "linear")


@dataclass
class DeltaConfig:
    """kda: per-channel gate (Kimi Linear); gdn: per-head gate (Gated DeltaNet); linear: no gate,
    no delta rule (S_t = S_{t-1} + k_t v_t^T)."""
    kind: str = "kda"
    n_heads: int = 4                    # query/key heads
    n_v_heads: Optional[int] = None     # value heads; None = n_heads. A multiple of n_heads: each q/k head
                                        # serves n_v_heads / n_heads consecutive value heads (Qwen3-Next 16 : 32)
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
        if self.n_v_heads is None:
            self.n_v_heads = self.n_heads
        require(self.n_v_heads >= 1 and self.n_v_heads % self.n_heads == 0, f"{path}.n_v_heads",
                f"a multiple of n_heads={self.n_heads} (or null)", self.n_v_heads)
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        positive(f"{path}.v_head_dim", self.v_head_dim)
        require(self.conv_size >= 0, f"{path}.conv_size", "an integer >= 0 (0 = no conv)", self.conv_size)


def l2norm(x, eps=1e-6):
    """x / sqrt(|x|^2 + eps) over the last dim, as FLA and transformers' GDN/KDA compute it (fp32)."""
    return scale_norm(x, None, eps, 1)


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
        d, H, K, V = model.d_model, cfg.n_v_heads, cfg.head_dim, cfg.v_head_dim  # H: value heads
        self.qkv_dims = (cfg.n_heads * K, cfg.n_heads * K, H * V)
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
            past = cache.conv.to(u.dtype, copy=True)                        # (updated below)
        # w [width, C], the last tap is now; contiguous rows (a strided column of [C, width] made each
        # tap's multiply ~3x slower)
        w = self.conv.to(u.dtype).t().contiguous()
        y = short_conv(past, u, w, doc_pos)                                 # [B, T, C]
        if cache is not None:
            cache.conv.copy_(torch.cat([past, u[:, -(width - 1):]], dim=1)[:, -(width - 1):])  # last inputs
        return y

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):
        B, T, _ = x.shape
        c = self.cfg
        H, K, V = c.n_v_heads, c.head_dim, c.v_head_dim                     # H: value heads (= state heads)
        doc_pos = None if cu_seqlens is None else token_positions(x, pos, cache, cu_seqlens)
        q, k, v = self.short_conv(self.w_qkv(x), cache, doc_pos, cp).split(self.qkv_dims, dim=-1)
        q, k, v = q.view(B, T, c.n_heads, K), k.view(B, T, c.n_heads, K), v.view(B, T, H, V)
        if c.qk_norm:
            q, k = l2norm(q), l2norm(k)
        if H != c.n_heads:  # grouped value heads: q/k head i serves value heads i*r .. i*r + r-1
            q, k = q.repeat_interleave(H // c.n_heads, dim=2), k.repeat_interleave(H // c.n_heads, dim=2)
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
        return LayerCache(state=torch.zeros(batch_size, c.n_v_heads, c.head_dim, c.v_head_dim, device=device),
                          conv=torch.zeros(batch_size, conv_width, sum(self.qkv_dims), device=device, dtype=dtype))


for _kind in DELTA_KINDS:
    MIXERS[_kind] = (DeltaConfig, DeltaNet)


# ----------------------------------------------------------------------------------------------
# Multi-head latent attention (SPEC 2) and DeepSeek sparse attention (SPEC 3)
#
# Dimensions: H heads, d_c = kv_lora_rank (the latent), d_nope = qk_nope_dim, d_rope = qk_rope_dim
# (0 under NoPE), d_v = v_head_dim, r_q = q_lora_rank; indexer: H_I heads of d_I dims, k = top_k.

MLA_BLOCK_Q = 256  # queries per block of the indexer losses (dense: memory O(block * S); sparse: O(block * k))


def index_scores_selected(iq, iw, ik_sel):
    """The same score against per-query key sets: ik_sel [B, T, k, d_I] -> [B, T, k] fp32."""
    dots = torch.einsum("bthd,btkd->bthk", iq.float(), ik_sel.float()).relu()  # [B, T, H_I, k]
    return torch.einsum("bthk,bth->btk", dots, iw.float()) * iq.shape[-1] ** -0.5


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
            self.q_norm = RMSNorm(r_q, cfg.norm_eps or model.norm_eps)
            self.wq_b = nn.Linear(r_q, H * (d_nope + d_rope), bias=False)         # W_uq
        self.wkv_a = nn.Linear(d, d_c + d_rope, bias=False)                       # W_dkv
        self.kv_norm = RMSNorm(d_c, cfg.norm_eps or model.norm_eps)
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
        if d_rope and c.rope:
            cos, sin = rope_angles(positions, d_rope, c.rope_theta)
            q_rope = apply_rope(q_rope, cos, sin)
            k_rope = apply_rope(k_rope[:, :, None], cos, sin)[:, :, 0]
        latent = torch.cat([c_kv, k_rope], dim=-1)                          # [B, T, d_c + d_rope]
        if self.indexer is not None:  # detached input: the indexer learns from its KL loss only
            iq, iw, ik = self.indexer(x.detach(), (x if c_q is None else c_q).detach(), positions)
        paged = cache is not None and hasattr(cache, "attend_latent")  # engine.py: rows in a block pool
        if cache is not None and not paged:
            latent, ik = self.update_cache(cache, latent, ik if self.indexer is not None else None, pos)
        if cp is not None:  # [B/2, T_total, d_c + d_rope]: the small latent rows cross over, not K/V
            latent = cp.gather(latent)
            ik = cp.gather(ik) if self.indexer is not None else None
        sparse = self.indexer is not None and c.dsa.stage == "sparse"
        absorb = (T == 1) if self.absorb is None else self.absorb
        if paged or sparse or (cache is not None and absorb):
            o, kl = self._attend_absorbed(q_nope, q_rope, latent, cache if paged else None,
                                          (iq, iw, ik) if sparse else None, want_loss, cu_seqlens, cp)
        else:
            o, kl = self._attend_expanded(q_nope, q_rope, latent, (iq, iw, ik) if want_loss else None,
                                          doc_start, cu_seqlens, cp)
        if want_loss:  # L_I: KL summed over heads' distribution, mean over the B*T query tokens
            self.aux_loss = ("indexer_kl", c.dsa.loss_weight * kl / (B * T))
        return self.wo(o.reshape(B, T, H * d_v))

    def _attend_absorbed(self, q_nope, q_rope, latent, paged_cache, index, want_loss, cu_seqlens, cp):
        """Attention in the latent space (decode, the paged engine, DSA's sparse stage): the query is
        absorbed, q~_h = q_nope_h W_UK_h^T, scores the latent rows [c_kv, k_rope] of all S visible keys
        directly, and o_h = (its attention over c_kv) W_UV_h^T. index: the indexer's (q, weights, keys)
        in the sparse stage, else None. Returns o [B, T, H, d_v] and the indexer's KL (or None)."""
        B, T, H, _ = q_nope.shape
        S, d_c = latent.shape[1], self.cfg.kv_lora_rank
        w_uk, w_uv = self._w_uk_uv()
        q_abs = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)                   # [B, T, H, d_c]
        q_lat = torch.cat([q_abs, q_rope], dim=-1)                             # [B, T, H, d_c + d_rope]
        kl = None
        if paged_cache is not None:
            o_lat = paged_cache.attend_latent(self, q_lat, latent, *(index or (None,) * 3))
        elif index is not None and cp is None:
            o_lat, kl = self._sparse_attention(q_lat, latent, *index, S - T, want_loss, cu_seqlens)
        elif index is not None:  # piece by piece: the piece's queries from its start, the keys up to its end
            iq, iw, ik = index
            parts = [self._sparse_attention(q_lat[rows], latent[:, :end], iq[rows], iw[rows], ik[:, :end],
                                            start, want_loss) for rows, start, end in cp.piece_ranges(q_lat)]
            o_lat = torch.cat([o for o, _ in parts])
            kl = sum(part_kl for _, part_kl in parts) if want_loss else None
        else:  # MQA with one kv head: keys [c_kv, k_rope], values c_kv. The head is broadcast to
            # all H heads as a stride-0 view (no copy): with Hq == Hkv PyTorch's SDPA takes its
            # fused path, while Hq != Hkv (enable_gqa) falls back to the ~30x slower math path on CPU.
            rows = latent[:, :, None].expand(B, S, H, latent.shape[-1])
            o_lat = kernels.attention(q_lat, rows, rows[..., :d_c], scale=self.scale,
                                      backend=self.backend)                   # [B, T, H, d_c]
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv), kl                 # [B, T, H, d_v]

    def _attend_expanded(self, q_nope, q_rope, latent, index, doc_start, cu_seqlens, cp):
        """Attention with every visible key expanded (training, prefill): [k_nope_h, v_h] = c_kv W_ukv,
        k_h = [k_nope_h, k_rope]. index: the indexer's (q, weights, keys) when its KL to this attention
        is wanted (the dense warm-up), else None. Returns o [B, T, H, d_v] and the KL (or None)."""
        c = self.cfg
        H, d_c, d_nope, d_rope, d_v = c.n_heads, c.kv_lora_rank, c.qk_nope_dim, c.rope_dim, c.v_head_dim
        Bk, S, _ = latent.shape
        kv = self.wkv_b(latent[..., :d_c]).view(Bk, S, H, d_nope + d_v)
        k_nope, v = kv.split([d_nope, d_v], dim=-1)                            # [B, S, H, d_nope], [B, S, H, d_v]
        k = torch.cat([k_nope, latent[:, :, None, d_c:].expand(Bk, S, H, d_rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)                                # [B, T, H, d_nope + d_rope]
        if cp is not None:
            o = cp.attention(q, k, v, scale=self.scale, backend=self.backend, gathered=True)
        else:
            o = kernels.attention(q, k, v, scale=self.scale, backend=self.backend,
                                  cu_seqlens=cu_seqlens)                       # [B, T, H, d_v]
        kl = None
        if index is not None and cp is None:
            kl = self._dense_indexer_kl(q.detach(), k.detach(), *index, doc_start)
        elif index is not None:
            iq, iw, ik = index
            kl = sum(self._dense_indexer_kl(q[rows].detach(), k[:, :end].detach(), iq[rows], iw[rows],
                                            ik[:, :end], offset=start) for rows, start, end in cp.piece_ranges(q))
        return o, kl

    def _sparse_attention(self, q_lat, latent, iq, iw, ik, offset, want_loss, cu_seqlens=None):
        """Absorbed attention over each query's top-k latent rows (kernels.index_topk, then
        kernels.sparse_mla_attention: Triton on CUDA, torch elsewhere).

        q_lat [B,T,H,d_c+d_rope]  latent [B,S,d_c+d_rope]  iq [B,T,H_I,d_I]  iw [B,T,H_I]  ik [B,S,d_I]
        Query t sits at position offset + t = S - T + t. Returns o_lat [B,T,H,d_c] and the KL sum (or
        None). What autograd keeps is O(T * k), never T x S. cu_seqlens (packed documents, B == 1,
        offset 0): each document runs alone, so the indexer picks only within its document."""
        if cu_seqlens is not None:
            parts = [self._sparse_attention(q_lat[:, a:b], latent[:, a:b], iq[:, a:b], iw[:, a:b], ik[:, a:b], 0,
                                            want_loss) for a, b in doc_spans(cu_seqlens)]
            return torch.cat([o for o, _ in parts], dim=1), (sum(kl for _, kl in parts) if want_loss else None)
        S = latent.shape[1]
        with torch.no_grad():
            sel = kernels.index_topk(iq, iw, ik, min(self.cfg.dsa.top_k, S), backend=self.backend)  # [B, T, k]
        o_lat, lse = kernels.sparse_mla_attention(q_lat, latent, sel, d_v=self.cfg.kv_lora_rank,
                                                  scale=self.scale, backend=self.backend)
        if not want_loss:
            return o_lat, None
        return o_lat, self._sparse_indexer_kl(q_lat.detach(), latent.detach(), sel, lse, iq, iw, ik, offset)

    def _sparse_indexer_kl(self, q_lat, latent, sel, lse, iq, iw, ik, offset):
        """L_I on the selected set (summed over tokens): the target is the main attention's
        probabilities exp(logit - lse) summed over heads, L1-normalised, detached."""
        B, T = sel.shape[:2]
        b = torch.arange(B, device=sel.device)[:, None, None]
        kl = q_lat.new_zeros((), dtype=torch.float32)
        for t0 in range(0, T, MLA_BLOCK_Q):
            t1 = min(T, t0 + MLA_BLOCK_Q)
            qpos = torch.arange(offset + t0, offset + t1, device=sel.device)
            s = sel[:, t0:t1]
            valid = (s >= 0) & (s <= qpos[None, :, None])                     # [B, Tb, k]
            s = s.clamp(0, latent.shape[1] - 1)
            with torch.no_grad():
                att = torch.einsum("bthd,btkd->bthk", q_lat[:, t0:t1].float(), latent[b, s].float()) * self.scale
                p = torch.exp(att - lse[:, t0:t1, :, None]).masked_fill(~valid[:, :, None], 0.0)
                target = p.sum(2)
                target = target / target.sum(-1, keepdim=True)                 # [B, Tb, k]
            logits = index_scores_selected(iq[:, t0:t1], iw[:, t0:t1], ik[b, s])
            kl = kl + kl_to_logits(target, logits, valid)
        return kl

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
# Multi-matrix factorization attention (SPEC 5; Hu et al. 2025, Step-3)


@dataclass
class MFAConfig:
    """MFA: a shared low-rank query (x -> share_q_dim -> RMSNorm -> n_heads x head_dim), ONE key head and
    ONE value head of head_dim for all heads; key_reuse (MFA-KR) derives the value from the key."""
    kind: str = "mfa"
    n_heads: int = 4
    head_dim: Optional[int] = None      # None = d_model // n_heads; MFA wants many large heads
    share_q_dim: Optional[int] = None   # the query latent (S_Q); None = head_dim (as Step-3's code)
    key_reuse: bool = False             # MFA-KR: cache the key only (head_dim numbers per token)
    rope: bool = True
    rope_theta: float = 10000.0

    def check(self, path, model):
        check_heads(self, path, model)
        if self.share_q_dim is None:
            self.share_q_dim = self.head_dim
        positive(f"{path}.share_q_dim", self.share_q_dim)


class MFA(nn.Module):
    """q_h = RMSNorm(x S_Q) Q_h (H heads of C = head_dim); k = x S_K, v = x S_V shared by every head;
    RoPE on q and k; out = W_o [o_1 .. o_H]. MFA-KR: no S_V, v = k + alpha * (N k) (the paper's
    S_V = (I + diag(alpha) N) S_K read in the key's C-space, so v is a function of the cached key;
    alpha starts at 0: v = k at init). v is linear in k, so the map is applied once per head after the
    attention: o_h = u_h + alpha * N u_h with u_h = sum_j p_hj k_j (un-roped keys as values).
    Cache: the un-roped key (and v) per token, whatever the head count; RoPE is applied on read."""

    def __init__(self, cfg: MFAConfig, model: ModelConfig):
        super().__init__()
        self.cfg, self.backend = cfg, model.backend
        d, H, C, r = model.d_model, cfg.n_heads, cfg.head_dim, cfg.share_q_dim
        self.wq_a = nn.Linear(d, r, bias=False)                   # S_Q
        self.q_norm = RMSNorm(r, model.norm_eps)
        self.wq_b = nn.Linear(r, H * C, bias=False)               # Q_h, one C x r block per head
        self.wk = nn.Linear(d, C, bias=False)                     # S_K
        if cfg.key_reuse:
            self.kr_n = nn.Linear(C, C, bias=False)               # N
            self.kr_alpha = nn.Parameter(torch.zeros(C))          # alpha
        else:
            self.wv = nn.Linear(d, C, bias=False)                 # S_V
        self.wo = nn.Linear(H * C, d, bias=False)                 # O_h
        self.wo.residual_out = True

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):  # cp: refused at config time
        """x [B, T, d_model] at absolute positions pos .. pos+T-1; cache None = parallel path.
        cu_seqlens: packed documents (B == 1): positions restart, a query sees only its document."""
        B, T, _ = x.shape
        c = self.cfg
        H, C = c.n_heads, c.head_dim
        doc_pos = None if cu_seqlens is None else token_positions(x, pos, cache, cu_seqlens)  # refuses a cache
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, H, C)
        k = self.wk(x)                                            # [B, T, C]
        v = k if c.key_reuse else self.wv(x)                      # [B, T, C]
        if cache is not None and hasattr(cache, "attend"):  # a paged cache (engine.py): roped keys in blocks
            k_rot = k[:, :, None]
            if c.rope:
                cos, sin = rope_angles(token_positions(x, pos, cache, None), C, c.rope_theta)
                q, k_rot = apply_rope(q, cos, sin), apply_rope(k_rot, cos, sin)
            o = cache.attend(self, q, k_rot, v[:, :, None])                    # [B, T, H, C]
        else:
            if cache is not None:
                k, v = self.update_cache(cache, k, v, pos)            # every key the new queries see
            S = k.shape[1]
            k_rot = k[:, :, None]                                     # [B, S, 1, C]
            if c.rope:
                k_pos = torch.arange(S, device=x.device) if doc_pos is None else doc_pos   # packed: S == T
                cos, sin = rope_angles(k_pos, C, c.rope_theta)
                q = apply_rope(q, cos[S - T:], sin[S - T:])
                k_rot = apply_rope(k_rot, cos, sin)
            # one kv head broadcast to all H heads as a stride-0 view (SDPA's fused path, see MLA)
            o = kernels.attention(q, k_rot.expand(B, S, H, C), v[:, :, None].expand(B, S, H, C),
                                  backend=self.backend, cu_seqlens=cu_seqlens)   # [B, T, H, C]
        if c.key_reuse:
            o = o + self.kr_alpha * self.kr_n(o)
        return self.wo(o.reshape(B, T, H * C))

    def new_cache(self, batch_size, max_len, device, dtype):
        """k [B, max_len, C] (un-roped) and, without key reuse, v [B, max_len, C]."""
        shape = (batch_size, max_len, self.cfg.head_dim)
        if self.cfg.key_reuse:
            return LayerCache(k=torch.zeros(shape, device=device, dtype=dtype))
        return LayerCache(k=torch.zeros(shape, device=device, dtype=dtype),
                          v=torch.zeros(shape, device=device, dtype=dtype))

    def update_cache(self, cache, k, v, pos):
        T, slots = k.shape[1], cache.k.shape[1]
        if pos + T > slots:
            raise ValueError(f"context of {pos + T} tokens exceeds the cache of an MFA layer "
                             f"(max_len={slots}); make the cache larger")
        cache.k[:, pos:pos + T] = k
        if self.cfg.key_reuse:
            return cache.k[:, :pos + T], cache.k[:, :pos + T]
        cache.v[:, pos:pos + T] = v
        return cache.k[:, :pos + T], cache.v[:, :pos + T]


MIXERS["mfa"] = (MFAConfig, MFA)


# ----------------------------------------------------------------------------------------------
# Native sparse attention (SPEC 5; Yuan et al. 2025)
#
# Sizes: l = cmp_block, d = cmp_stride, l' = sel_block, n = n_sel, w = window. Compressed block i
# covers keys [i d, i d + l) and is visible to a query at position p once complete: i d + l - 1 <= p,
# so p sees n_cmp(p + 1) blocks, n_cmp(S) = max(0, floor((S - l) / d) + 1). Selection block j covers
# keys [j l', (j + 1) l').

NSA_BLOCK_Q = 256  # queries per block of the (no-grad) block scoring: memory O(block * S / d)
NSA_LOCAL_BLOCKS = 2  # the selection always takes block 0 and the query's own block and the one before


@dataclass
class NSAConfig:
    """NSA: GQA heads; compression, selection and sliding-window branches, each with its own K/V,
    mixed by per-head sigmoid gates from x."""
    kind: str = "nsa"
    n_heads: int = 4
    n_kv_heads: Optional[int] = None    # None = n_heads; a GQA group shares its selected blocks
    head_dim: Optional[int] = None      # None = d_model // n_heads
    cmp_block: int = 32                 # l: keys per compressed block
    cmp_stride: int = 16                # d: one compressed key every d keys
    sel_block: int = 64                 # l': keys per selection block
    n_sel: int = 16                     # n: blocks each query's group selects (first + 2 local included)
    window: int = 512                   # w: keys of the sliding-window branch
    rope: bool = True                   # RoPE on the selection and window branches (token level)
    rope_theta: float = 10000.0

    def check(self, path, model):
        check_heads(self, path, model)
        positive(f"{path}.cmp_stride", self.cmp_stride)
        d = self.cmp_stride
        require(self.cmp_block >= d and self.cmp_block % d == 0, f"{path}.cmp_block",
                f"a multiple of cmp_stride={d}", self.cmp_block)
        require(self.sel_block >= d and self.sel_block % d == 0, f"{path}.sel_block",
                f"a multiple of cmp_stride={d}", self.sel_block)
        require(self.n_sel >= 1 + NSA_LOCAL_BLOCKS, f"{path}.n_sel",
                f"an integer >= {1 + NSA_LOCAL_BLOCKS} (the first block and the {NSA_LOCAL_BLOCKS} most "
                f"recent are always selected)", self.n_sel)
        positive(f"{path}.window", self.window)


def n_compressed(S, l, d):
    """Compressed blocks complete within S keys: max(0, floor((S - l) / d) + 1)."""
    return max(0, (S - l) // d + 1)


class NSA(nn.Module):
    """o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win per head, g = sigmoid(x W_g).

    cmp: attention over compressed keys/values phi(block of l raw keys + intra-block position
         embedding), phi an MLP (l*D -> D -> D); no RoPE (the block's position is in the embedding).
    slc: the query's GQA group picks n blocks of l' raw keys by the importance of the compression
         branch's probabilities, summed over the group's heads (the paper's l' != l mapping), and
         attends them token by token (kernels.block_sparse_attention).
    win: sliding window of w keys (kernels.attention).
    Decode cache: the selection's raw K/V (all tokens), the compressed K/V (one per completed stride),
    the compression's last l-1 raw K/V (the next blocks' inputs) and the window branch's ring of w."""

    def __init__(self, cfg: NSAConfig, model: ModelConfig):
        super().__init__()
        self.cfg, self.backend = cfg, model.backend
        d, Hq, Hkv, D, l = model.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.cmp_block
        self.wq = nn.Linear(d, Hq * D, bias=False)
        self.wkv = nn.Linear(d, 6 * Hkv * D, bias=False)          # [k, v] of cmp, slc, win
        self.cmp_pos = nn.Parameter(torch.zeros(2, l, D))         # intra-block position of keys, values
        self.cmp_k = nn.Sequential(nn.Linear(l * D, D, bias=False), nn.SiLU(), nn.Linear(D, D, bias=False))
        self.cmp_v = nn.Sequential(nn.Linear(l * D, D, bias=False), nn.SiLU(), nn.Linear(D, D, bias=False))
        self.gate = nn.Linear(d, 3 * Hq, bias=False)
        self.wo = nn.Linear(Hq * D, d, bias=False)
        self.wo.residual_out = True
        self.scale = D ** -0.5

    def reset_special_parameters(self):
        nn.init.normal_(self.cmp_pos, 0.0, 0.02)

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):  # cp: refused at config time
        """x [B, T, d_model] at absolute positions pos .. pos+T-1; cache None = parallel path.
        cu_seqlens: packed documents (B == 1): every branch stays inside the query's document."""
        B, T, _ = x.shape
        o_cmp, o_slc, o_win = self.branches(x, cache, pos, cu_seqlens)   # [B, T, Hq, D] each
        g = torch.sigmoid(self.gate(x)).view(B, T, self.cfg.n_heads, 3, 1)
        o = g[:, :, :, 0] * o_cmp + g[:, :, :, 1] * o_slc + g[:, :, :, 2] * o_win
        return self.wo(o.reshape(B, T, -1))

    def branches(self, x, cache=None, pos=0, cu_seqlens=None):
        """The three branch outputs o_cmp, o_slc, o_win [B, T, Hq, D] before the gates."""
        B, T, _ = x.shape
        c = self.cfg
        positions = token_positions(x, pos, cache, cu_seqlens)      # restart per document; refuses a cache
        q = self.wq(x).view(B, T, c.n_heads, c.head_dim)
        kc, vc, ks, vs, kw, vw = self.wkv(x).view(B, T, 6, c.n_kv_heads, c.head_dim).unbind(2)
        q_rot = q
        if c.rope:
            cos, sin = rope_angles(positions, c.head_dim, c.rope_theta)
            q_rot, ks, kw = apply_rope(q, cos, sin), apply_rope(ks, cos, sin), apply_rope(kw, cos, sin)
        if cu_seqlens is not None:
            o_cmp, o_slc = self.packed_cmp_slc(q, q_rot, kc, vc, ks, vs, cu_seqlens)
        else:
            if cache is None:
                ck, cv = self.compress(kc, vc)
            else:
                ck, cv, ks, vs, kw, vw = self.update_cache(cache, kc, vc, ks, vs, kw, vw, pos)
            o_cmp, o_slc = self.cmp_slc(q, q_rot, ck, cv, ks, vs, pos)
        o_win = kernels.attention(q_rot, kw, vw, window=c.window, scale=self.scale, backend=self.backend,
                                  cu_seqlens=cu_seqlens)
        return o_cmp, o_slc, o_win

    def cmp_slc(self, q, q_rot, ck, cv, ks, vs, pos):
        """The compression and selection branches of queries at pos .. pos+T-1 over compressed K/V
        ck, cv and the raw selection K/V ks, vs of positions 0 .. pos+T-1."""
        T = q.shape[1]
        o_cmp = self.compressed_attention(q, ck, cv, pos)
        blocks = self.select_blocks(q, ck, pos, pos + T)                 # [B, T, Hkv, n]
        o_slc = kernels.block_sparse_attention(q_rot, ks, vs, blocks, self.cfg.sel_block, scale=self.scale,
                                               backend=self.backend)
        return o_cmp, o_slc

    def packed_cmp_slc(self, q, q_rot, kc, vc, ks, vs, cu_seqlens):
        """Packed documents (B == 1): the compression and selection branches run document by document,
        a plain loop (simple and exact; one set of kernel launches per document): compressed blocks
        start at the document's first token and never span two documents, selection blocks are counted
        from the document's start and hold only its keys. The window branch is packed (cu_seqlens)."""
        outs = []
        for a, b in doc_spans(cu_seqlens):
            ck, cv = self.compress(kc[:, a:b], vc[:, a:b])
            outs.append(self.cmp_slc(q[:, a:b], q_rot[:, a:b], ck, cv, ks[:, a:b], vs[:, a:b], 0))
        return (torch.cat(o, dim=1) for o in zip(*outs))

    def compress(self, k, v):
        """Raw rows k, v [B, R, Hkv, D] -> one key and value per complete block of l at stride d,
        the first block starting at row 0: [B, n_compressed(R), Hkv, D]."""
        l, d = self.cfg.cmp_block, self.cfg.cmp_stride
        n = n_compressed(k.shape[1], l, d)
        if n == 0:
            return k[:, :0], v[:, :0]
        out = []
        for i, (rows, mlp) in enumerate(((k, self.cmp_k), (v, self.cmp_v))):
            blocks = rows[:, :(n - 1) * d + l].unfold(1, l, d)                  # [B, n, Hkv, D, l]
            blocks = blocks.transpose(-1, -2) + self.cmp_pos[i].to(rows.dtype)   # [B, n, Hkv, l, D]
            out.append(mlp(blocks.flatten(-2)))                                  # [B, n, Hkv, D]
        return out

    def compressed_attention(self, q, ck, cv, pos):
        """Query p (= pos + t) attends compressed blocks i with i d + l - 1 <= p; none visible -> 0.

        Queries sharing a stride see the same prefix of blocks: they are folded into extra heads
        ([B*Hkv, groups, d*G, D], group g seeing blocks 0..g), which makes it plain causal attention
        for kernels.attention (fused, nothing T x T kept), the group's block shared by stride-0 views."""
        B, T, Hq, D = q.shape
        l, d = self.cfg.cmp_block, self.cfg.cmp_stride
        N, Hkv = ck.shape[1], ck.shape[2]
        lo = max(pos, l - 1)                                        # first query that sees a block
        if N == 0 or lo >= pos + T:
            return q.new_zeros(B, T, Hq, cv.shape[-1])
        g0 = (lo - l + 1) // d                                      # its stride group
        start, n_g = l - 1 + g0 * d, N - g0                         # groups g0 .. N-1 (the last holds pos+T-1)
        qq = F.pad(q[:, lo - pos:], (0, 0, 0, 0, lo - start, start + n_g * d - pos - T))
        qq = qq.view(B, n_g, d, Hkv, Hq // Hkv, D).permute(0, 3, 1, 2, 4, 5).reshape(B * Hkv, n_g, -1, D)
        kk = ck.transpose(1, 2).reshape(B * Hkv, N, 1, D).expand(-1, -1, qq.shape[2], -1)
        vv = cv.transpose(1, 2).reshape(B * Hkv, N, 1, -1).expand(-1, -1, qq.shape[2], -1)
        o = kernels.attention(qq, kk, vv, scale=self.scale, backend=self.backend)   # [B*Hkv, n_g, d*G, Dv]
        o = o.reshape(B, Hkv, n_g * d, Hq // Hkv, -1).transpose(1, 2).reshape(B, n_g * d, Hq, -1)
        o = o[:, lo - start:lo - start + pos + T - lo]
        return torch.cat([o.new_zeros(B, lo - pos, Hq, o.shape[-1]), o], dim=1)

    @torch.no_grad()
    def select_blocks(self, q, ck, pos, S):
        """Block ids [B, T, Hkv, min(n, ceil(S / l'))] per query (-1 = unused): the top n by importance
        (ties to the most recent block), block 0 and the NSA_LOCAL_BLOCKS most recent always in, blocks
        after the query never."""
        c = self.cfg
        B, T, Hq, D = q.shape
        Hkv, N = c.n_kv_heads, ck.shape[1]
        n_blocks = -(-S // c.sel_block)
        j = torch.arange(n_blocks, device=q.device)
        out = []
        with torch.autocast(q.device.type, enabled=False):          # fp32 scores, also under autocast
            for t0 in range(0, T, NSA_BLOCK_Q):
                t1 = min(T, t0 + NSA_BLOCK_Q)
                qpos = torch.arange(pos + t0, pos + t1, device=q.device)
                qg = q[:, t0:t1].float().view(B, t1 - t0, Hkv, Hq // Hkv, D)
                att = torch.einsum("bthgd,bnhd->bthgn", qg, ck.float()) * self.scale
                seen = torch.arange(N, device=q.device) <= ((qpos - c.cmp_block + 1) // c.cmp_stride)[:, None]
                att = att.masked_fill(~seen[None, :, None, None], float("-inf"))
                p = att.softmax(-1).nan_to_num(0.0).sum(3)                           # [B, Tb, Hkv, N]
                score = self.block_importance(p, n_blocks)                         # [B, Tb, Hkv, n_blocks]
                cur = (qpos // c.sel_block)[:, None]
                forced = (j == 0) | ((j <= cur) & (j > cur - NSA_LOCAL_BLOCKS))
                score = score.masked_fill(forced[None, :, None], float("inf"))
                score = score.masked_fill((j > cur)[None, :, None], float("-inf"))
                # top n by (score, block id): a stable sort of the reversed blocks sends exact ties
                # (e.g. probabilities that underflowed to 0) to the most recent block, in any chunking
                best, idx = score.flip(-1).sort(dim=-1, descending=True, stable=True)
                best, idx = best[..., :c.n_sel], n_blocks - 1 - idx[..., :c.n_sel]
                out.append(idx.masked_fill(best == float("-inf"), -1))
        return torch.cat(out, dim=1)

    def block_importance(self, p, n_blocks):
        """Compression probabilities p [..., N] -> selection block importance [..., n_blocks]:
        p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p[j l'/d + m - n], the compressed blocks overlapping
        selection block j, each weighted by how many (m, n) reach it (terms outside 0..N-1 are 0)."""
        r, c = self.cfg.sel_block // self.cfg.cmp_stride, self.cfg.cmp_block // self.cfg.cmp_stride
        w = torch.zeros(r + c - 1, device=p.device, dtype=p.dtype)
        for m in range(r):                                          # offset m - n, shifted by c - 1
            w[m:m + c] += 1
        padded = F.pad(p, (c - 1, n_blocks * r - p.shape[-1]))      # [..., (c-1) + n_blocks * r]
        return padded.unfold(-1, r + c - 1, r) @ w

    def new_cache(self, batch_size, max_len, device, dtype):
        """[B, rows, Hkv, D] each: ks/vs the selection's raw K/V, ck/cv the compressed K/V, kc/vc the
        compression's pending raw rows (l - 1), kw/vw the window branch's ring."""
        c = self.cfg
        n_cmp = n_compressed(max_len, c.cmp_block, c.cmp_stride)
        pending, ring = min(c.cmp_block - 1, max_len), min(c.window, max_len)
        rows = dict(ks=max_len, vs=max_len, ck=n_cmp, cv=n_cmp, kc=pending, vc=pending, kw=ring, vw=ring)
        return LayerCache(**{name: torch.zeros(batch_size, n, c.n_kv_heads, c.head_dim, device=device, dtype=dtype)
                             for name, n in rows.items()})

    def update_cache(self, cache, kc, vc, ks, vs, kw, vw, pos):
        """Store the chunk's rows, compress the blocks it completes; return what its queries see:
        compressed K/V, the selection's raw K/V of positions 0 .. pos+T-1 and the window's K/V."""
        c = self.cfg
        T, slots = ks.shape[1], cache.ks.shape[1]
        if pos + T > slots:
            raise ValueError(f"context of {pos + T} tokens exceeds the cache of an NSA layer "
                             f"(max_len={slots}); make the cache larger")
        cache.ks[:, pos:pos + T], cache.vs[:, pos:pos + T] = ks, vs
        kw = ring_append(cache.kw, kw, pos, c.window - 1)
        vw = ring_append(cache.vw, vw, pos, c.window - 1)
        kc = ring_append(cache.kc, kc, pos, c.cmp_block - 1)         # rows from pos - n_old on
        vc = ring_append(cache.vc, vc, pos, c.cmp_block - 1)
        done, now = (n_compressed(s, c.cmp_block, c.cmp_stride) for s in (pos, pos + T))
        if now > done:
            first = done * c.cmp_stride - (pos + T - kc.shape[1])   # row of block `done`'s first key
            new_k, new_v = self.compress(kc[:, first:], vc[:, first:])
            cache.ck[:, done:now], cache.cv[:, done:now] = new_k, new_v
        return (cache.ck[:, :now], cache.cv[:, :now], cache.ks[:, :pos + T], cache.vs[:, :pos + T], kw, vw)


MIXERS["nsa"] = (NSAConfig, NSA)


# ----------------------------------------------------------------------------------------------
# The model


class Block(nn.Module):
    def __init__(self, mixer_cfg, model: ModelConfig, layer=0):
        super().__init__()
        self.norm1 = RMSNorm(model.d_model, model.norm_eps)
        self.mixer = MIXERS[mixer_cfg.kind][1](mixer_cfg, model)
        self.norm2 = RMSNorm(model.d_model, model.norm_eps)
        if model.mlp.is_moe(layer):
            self.mlp = MoE(model.mlp, model.d_model, model.init_std)
        else:
            self.mlp = SwiGLU(model.d_model, model.mlp.dense_size())

    def forward(self, x, cache=None, pos=0, cu_seqlens=None, cp=None):
        x = x + self.mixer(self.norm1(x), cache, pos, cu_seqlens=cu_seqlens, cp=cp)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(c, config, i) for i, c in enumerate(config.layer_configs()))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for m in self.modules():  # mixers with parameters of their own init (gates, decays, experts)
            if isinstance(m, MoE):
                m.reset_special_parameters(config.n_layer)
            elif m is not self and hasattr(m, "reset_special_parameters"):
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

    def update_router_biases(self, update=True):
        """Call after each optimizer step (every rank): MoE load balancing outside the gradient.
        Returns metrics: per MoE layer the share of assignments per expert, and the dropped tokens
        (always 0: no capacity factor); {} without MoE layers."""
        loads = [b.mlp.update_router_bias(update).tolist() for b in self.blocks if isinstance(b.mlp, MoE)]
        return {"expert_load": loads, "dropped_tokens": 0} if loads else {}

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
