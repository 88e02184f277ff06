"""Checkpoints in and out of Hugging Face transformers (SPEC 12): this module owns the mapping between
the project's configs and weights and those of the transformers families.

    python convert.py to-hf --ckpt out/x --out hf/x       # a transformers folder: config.json + model.safetensors
    python convert.py from-hf hf/x --out out/y            # a project checkpoint, out/y/ckpt_0.pt

then `python sample.py --ckpt out/y ...`, or train from it: `python train.py ... --train.init_from=out/y`.

Families (chosen from the config on the way out, from config.json's model_type on the way in):
    llama        softmax attention (MHA/GQA, full RoPE), SwiGLU MLP
    qwen3        the same with RMSNorm on q and k
    qwen3_next   Gated DeltaNet (value heads grouped over key heads) + gated attention (partial RoPE,
                 q/k norms); its RMSNorms are zero-centred, (1 + w) * x_hat: w_hf = w - 1 is a mapping
    kimi_linear  Kimi Delta Attention + MLA without positions (the qk_rope_dim key part kept, unrotated)
    deepseek_v32 MLA (q_lora_rank, interleaved RoPE: a row permutation) + the DSA lightning indexer;
                 an exact tie of index scores at the top-k boundary (all index heads' ReLU 0: rare with
                 DeepSeek's 64 index heads) may pick other keys: ours takes the most recent, torch.topk's
                 order is unspecified, so equal logits hold where no such tie occurs
    gpt_oss      softmax attention with learned sinks and biases, sliding-window and global layers, an MoE in
                 every layer (softmax over the top-k router logits, router and expert biases, the clamped
                 SwiGLU: mlp.bias + mlp.expert_act: swiglu_clamped); YaRN RoPE does not convert
MoE converts for qwen3_next (softmax router, gated shared expert), kimi_linear and deepseek_v32 (sigmoid
router with its balancing bias e_score_correction_bias, shared experts, routed scale, expert groups).
Top-k choices (experts, DSA keys) whose scores tie to fp32 rounding may go the other way in transformers,
a discontinuity of top-k, not a difference of the models. DeepSeek's and Qwen3-Next's multi-token
prediction weights are skipped on the way in. A config no family can express is refused naming the
option in the way; so is an HF folder of another family, a missing weight or a shape that does not fit:
one line, exit 2, nothing written. Quantized folders (quantization_config, e.g. the hub's MXFP4 gpt-oss)
are refused: convert a dequantized copy. Every output is written to a temporary name and renamed into
place. Tokenizers are not converted.
"""
import argparse
import dataclasses
import json
import os
import shutil
import sys

import torch

from model import GPT, ConfigError, ModelConfig

CKPT_VERSION = 2


class ConvertError(ValueError):
    """A conversion that cannot be done; the message is one line naming why."""


def refuse(ok, message):
    if not ok:
        raise ConvertError(message)


# ----------------------------------------------------------------------------------------------
# Weight rules. A rule is (hf names, our names, to_hf, from_hf): to_hf maps the list of our tensors
# to the list of HF tensors, from_hf the other way. One table per family serves both directions.


def same(hf, ours):
    return [hf], [ours], (lambda ts: ts), (lambda ts: ts)


def zero_centred(hf, ours):
    """transformers' zero-centred RMSNorm, (1 + w) * x_hat: our weight is 1 + w."""
    return [hf], [ours], (lambda ts: [ts[0] - 1]), (lambda ts: [ts[0] + 1])


def reshaped(hf, ours, hf_shape, our_shape):
    """The same numbers in another shape (conv filters [C, 1, W] vs [C, W]; A_log [1, 1, H, 1] vs [H])."""
    return [hf], [ours], (lambda ts: [ts[0].reshape(hf_shape)]), (lambda ts: [ts[0].reshape(our_shape)])


def _interleave(ts, groups, rows):
    """For each of `groups` groups: rows[i] rows of ts[i], in order -> one tensor."""
    tail = ts[0].shape[1:]
    return torch.cat([t.reshape(groups, r, *tail) for t, r in zip(ts, rows)], 1).reshape(-1, *tail)


def _deinterleave(t, groups, rows):
    tail = t.shape[1:]
    return [p.reshape(groups * r, *tail) for p, r in zip(t.reshape(groups, sum(rows), *tail).split(rows, 1), rows)]


def interleaved(hf, ours, groups, rows):
    """One HF matrix whose rows go group by group through our matrices (Qwen3-Next's q_proj: per
    head [q_h; gate_h]; in_proj_ba: per key head [beta rows; decay rows])."""
    return [hf], ours, (lambda ts: [_interleave(ts, groups, rows)]), (lambda ts: _deinterleave(ts[0], groups, rows))


def split_rows(hfs, ours, rows):
    """Several HF matrices = row blocks of one of ours (Kimi's q/k/v_proj vs our w_qkv)."""
    return hfs, [ours], (lambda ts: list(ts[0].split(rows))), (lambda ts: [torch.cat(ts)])


def per_expert(hfs, ours):
    """HF keeps one matrix per expert; we keep them stacked [E, ...]."""
    return hfs, [ours], (lambda ts: list(ts[0].unbind(0))), (lambda ts: [torch.stack(ts)])


# How each family names its MoE block: prefix, per-expert (gate, up, down), router, router bias, shared MLP
MOE_NAMES = {
    "qwen3_next": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "gate.weight", None, "shared_expert."),
    "kimi_linear": ("block_sparse_moe.", ("w1", "w3", "w2"), "gate.weight", "gate.e_score_correction_bias",
                    "shared_experts."),
    "deepseek_v32": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "gate.weight", "gate.e_score_correction_bias",
                     "shared_experts."),
}


def moe_rules(h, o, mlp, family):
    """Routed experts (one HF matrix each), router (+ balancing bias), shared MLP (+ Qwen3-Next's gate)."""
    prefix, (gate, up, down), router, bias, shared = MOE_NAMES[family]
    h = h + prefix
    rules = [per_expert([f"{h}experts.{e}.{name}.weight" for e in range(mlp.n_experts)], f"{o}{ours}")
             for name, ours in ((gate, "w1"), (up, "w3"), (down, "w2"))]
    rules.append(same(h + router, o + "router.weight"))
    if mlp.router == "sigmoid":
        rules.append(same(h + bias, o + "router_bias"))
    if mlp.n_shared:
        rules += [same(f"{h}{shared}{a}.weight", f"{o}shared.{b}.weight")
                  for a, b in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))]
    if mlp.shared_gate:
        rules.append(same(h + "shared_expert_gate.weight", o + "shared_gate.weight"))
    return rules


def dense_rules(mc, norm=same, always_head=False, family=None):
    """Embedding, final norm, head, per-layer norms and MLPs (SwiGLU names are shared by all families;
    MoE layers follow MOE_NAMES[family]). always_head: the family cannot tie the head (Kimi Linear),
    so a tied one is written out as a copy."""
    rules = [same("model.embed_tokens.weight", "wte.weight"), norm("model.norm.weight", "norm_f.weight")]
    if not mc.tie_embeddings:
        rules.append(same("lm_head.weight", "lm_head.weight"))
    elif always_head:
        rules.append(same("lm_head.weight", "wte.weight"))
    for i in range(mc.n_layer):
        h, o = f"model.layers.{i}.", f"blocks.{i}."
        rules += [norm(h + "input_layernorm.weight", o + "norm1.weight"),
                  norm(h + "post_attention_layernorm.weight", o + "norm2.weight")]
        if mc.mlp.is_moe(i):
            rules += moe_rules(h, o + "mlp.", mc.mlp, family)
            continue
        rules += [same(h + "mlp.gate_proj.weight", o + "mlp.w1.weight"),
                  same(h + "mlp.up_proj.weight", o + "mlp.w3.weight"),
                  same(h + "mlp.down_proj.weight", o + "mlp.w2.weight")]
    return rules


def attn_rules(h, o, c, norm=same):
    """Softmax attention; with output_gate the gate rows sit after each head's query rows (Qwen3-Next)."""
    rules = []
    for p in ["weight", "bias"] if c.bias else ["weight"]:
        if c.output_gate:
            rules.append(interleaved(f"{h}q_proj.{p}", [f"{o}wq.{p}", f"{o}wg.{p}"], c.n_heads,
                                     [c.head_dim, c.head_dim]))
        else:
            rules.append(same(f"{h}q_proj.{p}", f"{o}wq.{p}"))
        rules += [same(f"{h}{a}_proj.{p}", f"{o}w{a}.{p}") for a in "kvo"]
    if c.qk_norm:
        rules += [norm(h + "q_norm.weight", o + "q_norm.weight"), norm(h + "k_norm.weight", o + "k_norm.weight")]
    if c.sinks:
        rules.append(same(h + "sinks", o + "sinks"))
    return rules


def gdn_rules(h, o, c):
    """Qwen3-Next's GatedDeltaNet: in_proj_qkvz holds, per key head, [q; k; its value heads' v; their z]."""
    Hk, Hv, K, V = c.n_heads, c.n_v_heads, c.head_dim, c.v_head_dim
    r, qkv = Hv // Hk, [Hk * K, Hk * K, Hv * V]

    def qkvz_to_hf(ts):
        return [_interleave([*ts[0].split(qkv), ts[1]], Hk, [K, K, r * V, r * V])]

    def qkvz_from_hf(ts):
        q, k, v, z = _deinterleave(ts[0], Hk, [K, K, r * V, r * V])
        return [torch.cat([q, k, v]), z]
    C = sum(qkv)
    return [([h + "in_proj_qkvz.weight"], [o + "w_qkv.weight", o + "w_g.weight"], qkvz_to_hf, qkvz_from_hf),
            interleaved(h + "in_proj_ba.weight", [o + "w_beta.weight", o + "w_f.weight"], Hk, [r, r]),
            reshaped(h + "conv1d.weight", o + "conv", (C, 1, c.conv_size), (C, c.conv_size)),
            same(h + "dt_bias", o + "dt_bias"), same(h + "A_log", o + "A_log"),
            same(h + "norm.weight", o + "o_norm.weight"), same(h + "out_proj.weight", o + "wo.weight")]


def kda_rules(h, o, c):
    """Kimi Linear's KimiDeltaAttention, in the checkpoint layout on disk (what transformers saves and
    loads: per-projection short convolutions, the forget gate's weights beside the others)."""
    H, K, W = c.n_heads, c.head_dim, c.conv_size

    def conv_to_hf(ts):
        return [t.reshape(H * K, 1, W) for t in ts[0].split(H * K)]
    return [split_rows([h + "q_proj.weight", h + "k_proj.weight", h + "v_proj.weight"], o + "w_qkv.weight",
                       [H * K] * 3),
            ([h + "q_conv1d.weight", h + "k_conv1d.weight", h + "v_conv1d.weight"], [o + "conv"], conv_to_hf,
             lambda ts: [torch.cat(ts).reshape(3 * H * K, W)]),
            same(h + "f_a_proj.weight", o + "w_f.0.weight"), same(h + "f_b_proj.weight", o + "w_f.1.weight"),
            same(h + "dt_bias", o + "dt_bias"), reshaped(h + "A_log", o + "A_log", (1, 1, H, 1), (H,)),
            same(h + "b_proj.weight", o + "w_beta.weight"),
            same(h + "g_a_proj.weight", o + "w_g.0.weight"), same(h + "g_b_proj.weight", o + "w_g.1.weight"),
            same(h + "o_norm.weight", o + "o_norm.weight"), same(h + "o_proj.weight", o + "wo.weight")]


def mla_rules(h, o, c):
    """MLA (DeepSeek-V3 names): q_a/q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj."""
    if c.q_lora_rank is None:
        rules = [same(h + "q_proj.weight", o + "wq.weight")]
    else:
        rules = [same(h + "q_a_proj.weight", o + "wq_a.weight"), same(h + "q_a_layernorm.weight", o + "q_norm.weight"),
                 same(h + "q_b_proj.weight", o + "wq_b.weight")]
    return rules + [same(h + "kv_a_proj_with_mqa.weight", o + "wkv_a.weight"),
                    same(h + "kv_a_layernorm.weight", o + "kv_norm.weight"),
                    same(h + "kv_b_proj.weight", o + "wkv_b.weight"), same(h + "o_proj.weight", o + "wo.weight")]


# ----------------------------------------------------------------------------------------------
# Families: which configs each expresses, its config.json, and its weight table.


def _layer_names(mc):
    """Every layer's (name in `layers`, config), pattern cycled to n_layer."""
    return [(mc.pattern[i % len(mc.pattern)], mc.layers[mc.pattern[i % len(mc.pattern)]]) for i in range(mc.n_layer)]


def _one_config(mc, kind, family):
    """The single config all `kind` layers share (transformers has one per family), or None."""
    named = {n: c for n, c in _layer_names(mc) if c.kind == kind}
    if not named:
        return None, None
    names = list(named)
    for n in names[1:]:
        refuse(named[n] == named[names[0]], f"model.layers.{n}: {family} has one {kind} layer config for all "
               f"layers; it differs from model.layers.{names[0]}")
    return names[0], named[names[0]]


def _no(path, value, family, what):
    raise ConvertError(f"{path}={value!r}: {family} has no {what}")


def _check_dense_mlp(mc, family):
    refuse(mc.mlp.kind == "swiglu", f"model.mlp.kind={mc.mlp.kind!r}: {family} has no MoE (qwen3_next, "
           f"kimi_linear, deepseek_v32 and gpt_oss have)")


def _check_moe(mc, family, router, shared_gate, shared_is_n_times_hidden):
    m, p = mc.mlp, "model.mlp"
    refuse(m.router == router, f"{p}.router={m.router!r}: {family} routes with {router}")
    refuse(not m.bias, f"{p}.bias=true: {family}'s router and experts have no biases (gpt_oss has)")
    refuse(m.expert_act == "swiglu", f"{p}.expert_act={m.expert_act!r}: {family}'s experts are plain SwiGLU")
    if router == "softmax":
        refuse(m.n_group == 1, f"{p}.n_group={m.n_group}: {family} has no group-limited routing")
    refuse(m.shared_gate == shared_gate, f"{p}.shared_gate={m.shared_gate!r}: {family} has "
           + ("a gated shared expert" if shared_gate else "no shared-expert gate"))
    refuse(m.n_shared >= 1, f"{p}.n_shared=0: {family} always has a shared expert")
    if shared_is_n_times_hidden:
        refuse(m.shared_hidden == m.n_shared * m.hidden, f"{p}.shared_hidden={m.shared_hidden}: {family}'s "
               f"shared experts are n_shared * hidden = {m.n_shared * m.hidden} wide")
    else:
        refuse(m.n_shared == 1, f"{p}.n_shared={m.n_shared}: {family} has one shared expert (set shared_hidden)")
    if router == "softmax":
        refuse(m.routed_scale == 1.0, f"{p}.routed_scale={m.routed_scale}: {family} does not scale routed outputs")


def _attn_common(name, c, family, gate, qk_norm, rope_fraction=False):
    p = f"model.layers.{name}"
    if c.window is not None:
        _no(f"{p}.window", c.window, family, "sliding-window layers (gpt-oss has)")
    if c.sinks:
        _no(f"{p}.sinks", True, family, "attention sinks (gpt-oss has)")
    if c.output_gate != gate:
        _no(f"{p}.output_gate", c.output_gate, family, "attention " + ("without" if gate else "with") + " an output gate")
    if c.qk_norm != qk_norm:
        _no(f"{p}.qk_norm", c.qk_norm, family, "attention " + ("without" if qk_norm else "with") + " q/k norms")
    if not c.rope:
        _no(f"{p}.rope", False, family, "NoPE softmax attention")
    if c.rope_fraction != 1.0 and not rope_fraction:
        _no(f"{p}.rope_fraction", c.rope_fraction, family, "partial RoPE (qwen3_next has)")


def _base_hf(mc, model_type, arch):
    return dict(model_type=model_type, architectures=[arch], vocab_size=mc.vocab_size, hidden_size=mc.d_model,
                intermediate_size=mc.mlp.hidden, num_hidden_layers=mc.n_layer, rms_norm_eps=mc.norm_eps,
                tie_word_embeddings=mc.tie_embeddings, hidden_act="silu", pad_token_id=None, bos_token_id=None,
                eos_token_id=None, initializer_range=mc.init_std)


def _base_ours(hf):
    refuse(getattr(hf, "hidden_act", "silu") == "silu", f"config.json hidden_act={hf.hidden_act!r}: only silu "
           f"(SwiGLU) MLPs convert")
    return dict(vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_layer=hf.num_hidden_layers,
                norm_eps=hf.rms_norm_eps, tie_embeddings=bool(hf.tie_word_embeddings),
                init_std=getattr(hf, "initializer_range", 0.02), mlp={"kind": "swiglu", "hidden": hf.intermediate_size})


def _rope(hf, fraction_key=None):
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    refuse(rp.get("rope_type", "default") == "default", f"config.json rope_parameters.rope_type="
           f"{rp.get('rope_type')!r}: only default RoPE converts (no scaling)")
    return rp.get("rope_theta", 10000.0), rp.get("partial_rotary_factor", 1.0)


# llama / qwen3: softmax attention in every layer

def attn_family(mc):
    if any(c.sinks for _, c in _layer_names(mc)) or mc.mlp.kind == "moe" and mc.mlp.expert_act == "swiglu_clamped":
        return "gpt_oss"
    if any(c.output_gate for _, c in _layer_names(mc)):  # gated attention: Qwen3-Next with full attention only
        return "qwen3_next"
    name, c = _one_config(mc, "attn", "llama")
    return "qwen3" if c.qk_norm else "llama"


def attn_hf_config(mc, family):
    _check_dense_mlp(mc, family)
    name, c = _one_config(mc, "attn", family)
    _attn_common(name, c, family, gate=False, qk_norm=family == "qwen3")
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    return dict(_base_hf(mc, family, arch), num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                head_dim=c.head_dim, attention_bias=c.bias, mlp_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})


def attn_our_config(hf, family):
    refuse(not getattr(hf, "mlp_bias", False), "config.json mlp_bias=true: the project's MLPs have no biases")
    refuse(not getattr(hf, "use_sliding_window", False), "config.json use_sliding_window=true: not converted")
    theta, _ = _rope(hf)
    attn = dict(kind="attn", n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                rope_theta=theta, qk_norm=family == "qwen3", bias=bool(getattr(hf, "attention_bias", False)))
    return dict(_base_ours(hf), pattern=["attn"], layers={"attn": attn})


def attn_rules_all(mc, family):
    rules = dense_rules(mc)
    for i, (_, c) in enumerate(_layer_names(mc)):
        rules += attn_rules(f"model.layers.{i}.self_attn.", f"blocks.{i}.mixer.", c)
    return rules


# qwen3_next: Gated DeltaNet + gated attention, zero-centred norms

def qwen3_next_hf_config(mc, family="qwen3_next"):
    gname, g = _one_config(mc, "gdn", family)
    aname, a = _one_config(mc, "attn", family)
    if a is not None:
        _attn_common(aname, a, family, gate=True, qk_norm=True, rope_fraction=True)
    if g is not None:
        p = f"model.layers.{gname}"
        refuse(g.conv_size > 0, f"{p}.conv_size=0: qwen3_next's GatedDeltaNet has a short convolution")
        refuse(g.qk_norm, f"{p}.qk_norm=false: qwen3_next L2-normalises q and k")
        refuse(g.output_gate, f"{p}.output_gate=false: qwen3_next gates the GatedDeltaNet output")
    cfg = _base_hf(mc, family, "Qwen3NextForCausalLM")
    cfg.update(layer_types=["linear_attention" if c.kind == "gdn" else "full_attention" for _, c in _layer_names(mc)],
               num_experts=0, mlp_only_layers=[])
    m = mc.mlp
    if m.kind == "moe":
        _check_moe(mc, family, "softmax", shared_gate=True, shared_is_n_times_hidden=False)
        cfg.update(num_experts=m.n_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.hidden,
                   shared_expert_intermediate_size=m.shared_hidden, norm_topk_prob=m.norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=list(range(m.first_k_dense)),
                   intermediate_size=m.dense_hidden)
    if a is not None:
        cfg.update(num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
                   attention_bias=a.bias, rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta,
                                                           "partial_rotary_factor": a.rope_fraction})
    if g is not None:
        cfg.update(linear_conv_kernel_dim=g.conv_size, linear_key_head_dim=g.head_dim,
                   linear_value_head_dim=g.v_head_dim, linear_num_key_heads=g.n_heads, linear_num_value_heads=g.n_v_heads)
    return cfg


def qwen3_next_moe(hf):
    """Our mlp section for Qwen3-Next's MoE (dense when num_experts == 0)."""
    if not hf.num_experts:
        return {"kind": "swiglu", "hidden": hf.intermediate_size}
    n = hf.num_hidden_layers
    sparse = [i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0 for i in range(n)]
    k = sparse.index(True) if any(sparse) else n
    refuse(all(sparse[k:]), f"config.json mlp_only_layers={hf.mlp_only_layers}, decoder_sparse_step="
           f"{hf.decoder_sparse_step}: only leading dense layers convert (first_k_dense)")
    return {"kind": "moe", "n_experts": hf.num_experts, "top_k": hf.num_experts_per_tok,
            "hidden": hf.moe_intermediate_size, "n_shared": 1, "shared_hidden": hf.shared_expert_intermediate_size,
            "shared_gate": True, "router": "softmax", "norm_topk": bool(hf.norm_topk_prob), "first_k_dense": k,
            "dense_hidden": hf.intermediate_size}


def qwen3_next_our_config(hf, family="qwen3_next"):
    theta, fraction = _rope(hf)
    layers = {"gdn": dict(kind="gdn", n_heads=hf.linear_num_key_heads, n_v_heads=hf.linear_num_value_heads,
                          head_dim=hf.linear_key_head_dim, v_head_dim=hf.linear_value_head_dim,
                          conv_size=hf.linear_conv_kernel_dim, qk_norm=True, output_gate=True),
              "attn": dict(kind="attn", n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads,
                           head_dim=hf.head_dim, rope_theta=theta, rope_fraction=fraction, qk_norm=True,
                           output_gate=True, bias=bool(hf.attention_bias))}
    types = {"linear_attention": "gdn", "full_attention": "attn"}
    for t in hf.layer_types:
        refuse(t in types, f"config.json layer_types: {t!r} is not a qwen3_next layer this converter knows")
    pattern = [types[t] for t in hf.layer_types]
    return dict(_base_ours(hf), pattern=pattern, layers={k: v for k, v in layers.items() if k in pattern},
                mlp=qwen3_next_moe(hf))


def qwen3_next_rules(mc, family="qwen3_next"):
    rules = dense_rules(mc, norm=zero_centred, family=family)
    for i, (_, c) in enumerate(_layer_names(mc)):
        o = f"blocks.{i}.mixer."
        if c.kind == "gdn":
            rules += gdn_rules(f"model.layers.{i}.linear_attn.", o, c)
        else:
            rules += attn_rules(f"model.layers.{i}.self_attn.", o, c, norm=zero_centred)
    return rules


# kimi_linear: KDA + MLA NoPE

KIMI_LATENT_EPS = 1e-6  # transformers' Kimi Linear latent norms (q_a_layernorm, kv_a_layernorm)


def kimi_hf_config(mc, family="kimi_linear"):
    kname, k = _one_config(mc, "kda", family)
    mname, m = _one_config(mc, "mla", family)
    if k is not None:
        p = f"model.layers.{kname}"
        refuse(k.n_v_heads == k.n_heads, f"{p}.n_v_heads={k.n_v_heads}: kimi_linear's KDA has no grouped value heads")
        refuse(k.v_head_dim == k.head_dim, f"{p}.v_head_dim={k.v_head_dim}: kimi_linear's KDA has v_head_dim == head_dim")
        refuse(k.conv_size > 0, f"{p}.conv_size=0: kimi_linear's KDA has a short convolution")
        refuse(k.qk_norm, f"{p}.qk_norm=false: kimi_linear L2-normalises q and k")
        refuse(k.output_gate, f"{p}.output_gate=false: kimi_linear gates the KDA output")
    if m is not None:
        p = f"model.layers.{mname}"
        refuse(not m.rope, f"{p}.rope=true: kimi_linear's MLA has no positions (rope: false)")
        refuse(m.dsa is None, f"{p}.dsa: kimi_linear's MLA is dense (DSA converts as deepseek_v32)")
        eps = m.norm_eps or mc.norm_eps
        refuse(eps == KIMI_LATENT_EPS, f"{p}.norm_eps={eps!r}: kimi_linear's latent norms use {KIMI_LATENT_EPS}")
    cfg = _base_hf(mc, family, "KimiLinearForCausalLM")
    cfg.update(tie_word_embeddings=False,  # transformers' Kimi Linear never ties its head
               layer_types=["linear_attention" if c.kind == "kda" else "full_attention" for _, c in _layer_names(mc)],
               mlp_layer_types=["sparse" if mc.mlp.is_moe(i) else "dense" for i in range(mc.n_layer)])
    if mc.mlp.kind == "moe":
        cfg.update(sigmoid_moe_hf(mc, family))
    if k is not None:
        cfg.update(linear_head_dim=k.head_dim, linear_num_heads=k.n_heads, linear_conv_kernel_dim=k.conv_size)
    if m is not None:
        cfg.update(num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads, q_lora_rank=m.q_lora_rank,
                   kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_dim, qk_rope_head_dim=m.qk_rope_dim,
                   v_head_dim=m.v_head_dim)
    return cfg


def sigmoid_moe(hf, sparse):
    """Our mlp section for a DeepSeek-V3-style sigmoid-routed MoE (Kimi Linear, DeepSeek-V3.2)."""
    if not any(sparse):
        return {"kind": "swiglu", "hidden": hf.intermediate_size}
    k = sparse.index(True)
    refuse(all(sparse[k:]), f"config.json: MoE layers after a dense one ({sparse}); only leading dense layers "
           f"convert (first_k_dense)")
    return {"kind": "moe", "n_experts": hf.num_local_experts, "top_k": hf.num_experts_per_tok,
            "hidden": hf.moe_intermediate_size, "n_shared": hf.n_shared_experts, "router": "sigmoid",
            "norm_topk": bool(hf.norm_topk_prob), "routed_scale": float(hf.routed_scaling_factor),
            "first_k_dense": k, "dense_hidden": hf.intermediate_size, "n_group": hf.n_group or 1,
            "topk_group": hf.topk_group or 1}


def sigmoid_moe_hf(mc, family):
    """config.json MoE fields of a DeepSeek-V3-style sigmoid-routed MoE (Kimi Linear, DeepSeek-V3.2)."""
    _check_moe(mc, family, "sigmoid", shared_gate=False, shared_is_n_times_hidden=True)
    m = mc.mlp
    return dict(num_local_experts=m.n_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.hidden,
                n_shared_experts=m.n_shared, norm_topk_prob=m.norm_topk, routed_scaling_factor=m.routed_scale,
                n_group=m.n_group, topk_group=m.topk_group, intermediate_size=m.dense_hidden)


def kimi_our_config(hf, family="kimi_linear"):
    refuse(not getattr(hf, "attention_bias", False), "config.json attention_bias=true: kimi_linear's attention "
           "biases are not converted")
    layers = {"kda": dict(kind="kda", n_heads=hf.linear_num_heads, head_dim=hf.linear_head_dim,
                          conv_size=hf.linear_conv_kernel_dim),
              "mla": dict(kind="mla", n_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank,
                          kv_lora_rank=hf.kv_lora_rank, qk_nope_dim=hf.qk_nope_head_dim,
                          qk_rope_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, rope=False,
                          norm_eps=KIMI_LATENT_EPS)}
    types = {"linear_attention": "kda", "full_attention": "mla"}
    for t in hf.layer_types:
        refuse(t in types, f"config.json layer_types: {t!r} is not a kimi_linear layer this converter knows")
    pattern = [types[t] for t in hf.layer_types]
    return dict(_base_ours(hf), pattern=pattern, layers={k: v for k, v in layers.items() if k in pattern},
                tie_embeddings=False, mlp=sigmoid_moe(hf, [t == "sparse" for t in hf.mlp_layer_types]))


def kimi_rules(mc, family="kimi_linear"):
    rules = dense_rules(mc, always_head=True, family=family)
    for i, (_, c) in enumerate(_layer_names(mc)):
        h, o = f"model.layers.{i}.self_attn.", f"blocks.{i}.mixer."
        rules += kda_rules(h, o, c) if c.kind == "kda" else mla_rules(h, o, c)
    return rules


def kimi_alias(name):
    """Kimi Linear names as transformers' own save may spell them -> the names on the hub's checkpoints."""
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")
    for part in ("gate_proj", "up_proj", "down_proj"):  # a dense MLP saved under the MoE block's name
        name = name.replace(f".block_sparse_moe.{part}.", f".mlp.{part}.")
    return name


DISK_ALIASES = {"kimi_linear": kimi_alias}

# deepseek_v32: MLA + DSA indexer in every layer, sigmoid MoE

DEEPSEEK_EPS = 1e-6  # transformers' DeepSeek latent norms and the indexer's LayerNorm


def rope_deinterleave(n):
    """DeepSeek's main MLA rotates interleaved pairs (x0, x1), (x2, x3)..; ours half-split pairs
    (x_i, x_{i+n/2}). Rows [0, 2, 4, .., 1, 3, ..] of theirs are ours (q.k is unchanged)."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def permuted_rows(hf, ours, perm):
    """Our rows = HF rows[perm]."""
    inv = torch.argsort(perm)
    return [hf], [ours], (lambda ts: [ts[0][inv]]), (lambda ts: [ts[0][perm]])


def deepseek_mla_rules(h, o, c, interleave=True):
    """MLA with q_lora_rank and the DSA indexer, the rope rows of q_b_proj and kv_a_proj_with_mqa
    de-interleaved (rope_interleave: true, as DeepSeek's checkpoints are)."""
    H, dn, dr, dc = c.n_heads, c.qk_nope_dim, c.qk_rope_dim, c.kv_lora_rank
    rope = rope_deinterleave(dr) if interleave else torch.arange(dr)
    q_perm = torch.cat([hd * (dn + dr) + torch.cat([torch.arange(dn), dn + rope]) for hd in range(H)])
    kv_perm = torch.cat([torch.arange(dc), dc + rope])
    rules = [same(h + "q_a_proj.weight", o + "wq_a.weight"), same(h + "q_a_layernorm.weight", o + "q_norm.weight"),
             permuted_rows(h + "q_b_proj.weight", o + "wq_b.weight", q_perm),
             permuted_rows(h + "kv_a_proj_with_mqa.weight", o + "wkv_a.weight", kv_perm),
             same(h + "kv_a_layernorm.weight", o + "kv_norm.weight"),
             same(h + "kv_b_proj.weight", o + "wkv_b.weight"), same(h + "o_proj.weight", o + "wo.weight")]
    return rules + [same(h + "indexer.wq_b.weight", o + "indexer.wq.weight"),
                    same(h + "indexer.wk.weight", o + "indexer.wk.weight"),
                    same(h + "indexer.k_norm.weight", o + "indexer.k_norm.weight"),
                    same(h + "indexer.k_norm.bias", o + "indexer.k_norm.bias"),
                    same(h + "indexer.weights_proj.weight", o + "indexer.ww.weight")]


def deepseek_hf_config(mc, family="deepseek_v32"):
    name, m = _one_config(mc, "mla", family)
    p = f"model.layers.{name}"
    refuse(m.dsa is not None, f"{p}.dsa: null; {family} has the DSA indexer in every layer")
    refuse(m.q_lora_rank is not None, f"{p}.q_lora_rank: null; {family}'s MLA projects queries through q_lora_rank")
    refuse(m.rope, f"{p}.rope=false: {family}'s MLA has RoPE")
    refuse(m.dsa.stage == "sparse", f"{p}.dsa.stage={m.dsa.stage!r}: {family} attends to the indexer's top-k "
           f"keys; convert a checkpoint of the sparse stage")
    refuse(m.dsa.rope_dim == m.qk_rope_dim, f"{p}.dsa.rope_dim={m.dsa.rope_dim}: {family}'s indexer rotates "
           f"qk_rope_dim={m.qk_rope_dim} dims")
    refuse(mc.norm_eps == DEEPSEEK_EPS and m.norm_eps in (None, DEEPSEEK_EPS), f"model.norm_eps={mc.norm_eps!r}: "
           f"{family} uses {DEEPSEEK_EPS} (also in its latent norms and indexer)")
    cfg = _base_hf(mc, family, "DeepseekV32ForCausalLM")
    cfg.update(num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads, q_lora_rank=m.q_lora_rank,
               kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_dim, qk_rope_head_dim=m.qk_rope_dim,
               v_head_dim=m.v_head_dim, attention_bias=False,
               rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
               index_n_heads=m.dsa.n_heads, index_head_dim=m.dsa.head_dim, index_topk=m.dsa.top_k,
               mlp_layer_types=["sparse" if mc.mlp.is_moe(i) else "dense" for i in range(mc.n_layer)],
               first_k_dense_replace=mc.mlp.first_k_dense if mc.mlp.kind == "moe" else mc.n_layer,
               num_mtp_layers=0)
    if mc.mlp.kind == "moe":
        cfg.update(sigmoid_moe_hf(mc, family))
        cfg["n_routed_experts"] = cfg.pop("num_local_experts")
    return cfg


def deepseek_our_config(hf, family="deepseek_v32"):
    theta, _ = _rope(hf)
    refuse(not getattr(hf, "attention_bias", False), "config.json attention_bias=true: not converted")
    refuse(getattr(hf, "rope_interleave", True), "config.json rope_interleave=false: only DeepSeek's interleaved "
           "MLA RoPE converts")
    mla = dict(kind="mla", n_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
               qk_nope_dim=hf.qk_nope_head_dim, qk_rope_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
               rope=True, rope_theta=theta, norm_eps=DEEPSEEK_EPS,
               dsa=dict(n_heads=hf.index_n_heads, head_dim=hf.index_head_dim, rope_dim=hf.qk_rope_head_dim,
                        top_k=hf.index_topk, stage="sparse"))
    return dict(_base_ours(hf), pattern=["mla"], layers={"mla": mla}, norm_eps=hf.rms_norm_eps,
                mlp=sigmoid_moe(hf, [t == "sparse" for t in hf.mlp_layer_types]))


def deepseek_rules(mc, family="deepseek_v32"):
    rules = dense_rules(mc, family=family)
    for i, (_, c) in enumerate(_layer_names(mc)):
        rules += deepseek_mla_rules(f"model.layers.{i}.self_attn.", f"blocks.{i}.mixer.", c)
    return rules


# gpt_oss: softmax attention with sinks and biases, sliding-window and global layers, an MoE everywhere

def gpt_oss_hf_config(mc, family="gpt_oss"):
    layers = _layer_names(mc)
    (n0, c0), p = layers[0], "model.layers."
    for name, c in layers:
        refuse(c.sinks, f"{p}{name}.sinks=false: {family} has attention sinks in every layer")
        _attn_common(name, dataclasses.replace(c, window=None, sinks=False), family, gate=False, qk_norm=False)
        refuse(dataclasses.replace(c, window=None) == dataclasses.replace(c0, window=None), f"{p}{name}: {family}'s "
               f"layers differ only in their window; it differs from {p}{n0} in more")
    windows = sorted({c.window for _, c in layers if c.window is not None})
    refuse(len(windows) <= 1, f"{p}*.window={windows}: {family} has one sliding_window for all its sliding layers")
    m, q = mc.mlp, "model.mlp"
    refuse(m.kind == "moe", f"{q}.kind={m.kind!r}: {family} has an MoE in every layer (no dense MLP)")
    for key, want in (("router", "softmax"), ("norm_topk", True), ("n_shared", 0), ("routed_scale", 1.0),
                      ("n_group", 1), ("first_k_dense", 0), ("bias", True), ("expert_act", "swiglu_clamped")):
        refuse(getattr(m, key) == want, f"{q}.{key}={getattr(m, key)!r}: {family}'s MoE has {key}={want!r}")
    cfg = _base_hf(mc, family, "GptOssForCausalLM")
    cfg.update(intermediate_size=m.hidden, num_local_experts=m.n_experts, num_experts_per_tok=m.top_k,
               swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit,
               layer_types=["full_attention" if c.window is None else "sliding_attention" for _, c in layers],
               sliding_window=windows[0] if windows else None, num_attention_heads=c0.n_heads,
               num_key_value_heads=c0.n_kv_heads, head_dim=c0.head_dim, attention_bias=c0.bias,
               rope_parameters={"rope_type": "default", "rope_theta": c0.rope_theta})
    return cfg


def gpt_oss_our_config(hf, family="gpt_oss"):
    theta, _ = _rope(hf)
    full = dict(kind="attn", n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
                rope_theta=theta, sinks=True, bias=bool(hf.attention_bias))
    layers = {"full": full, "sliding": dict(full, window=hf.sliding_window)}
    types = {"full_attention": "full", "sliding_attention": "sliding"}
    for t in hf.layer_types:
        refuse(t in types, f"config.json layer_types: {t!r} is not a gpt_oss layer this converter knows")
    pattern = [types[t] for t in hf.layer_types]
    mlp = dict(kind="moe", n_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok, hidden=hf.intermediate_size,
               router="softmax", norm_topk=True, bias=True, expert_act="swiglu_clamped",
               swiglu_alpha=float(hf.swiglu_alpha), swiglu_limit=float(hf.swiglu_limit))
    return dict(_base_ours(hf), pattern=pattern, layers={k: v for k, v in layers.items() if k in pattern}, mlp=mlp)


def gpt_oss_moe_rules(h, o):
    """gpt-oss's experts: gate_up_proj [E, d, 2h] with gate and up columns alternating, down_proj [E, h, d]
    (ours: w1, w3 [E, h, d], w2 [E, d, h]); the same for their biases."""
    def gate_up_to_hf(ts):
        return [torch.stack([t.transpose(-1, -2) if t.dim() == 3 else t for t in ts], -1).flatten(-2)]

    def gate_up_from_hf(ts):
        g, u = ts[0][..., ::2], ts[0][..., 1::2]
        return [g.transpose(-1, -2), u.transpose(-1, -2)] if g.dim() == 3 else [g, u]
    x = f"{h}mlp.experts."
    return [same(f"{h}mlp.router.weight", f"{o}router.weight"), same(f"{h}mlp.router.bias", f"{o}router.bias"),
            ([x + "gate_up_proj"], [o + "w1", o + "w3"], gate_up_to_hf, gate_up_from_hf),
            ([x + "gate_up_proj_bias"], [o + "b1", o + "b3"], gate_up_to_hf, gate_up_from_hf),
            ([x + "down_proj"], [o + "w2"], lambda ts: [ts[0].transpose(1, 2)], lambda ts: [ts[0].transpose(1, 2)]),
            same(x + "down_proj_bias", o + "b2")]


def gpt_oss_rules(mc, family="gpt_oss"):
    rules = [same("model.embed_tokens.weight", "wte.weight"), same("model.norm.weight", "norm_f.weight")]
    if not mc.tie_embeddings:
        rules.append(same("lm_head.weight", "lm_head.weight"))
    for i, (_, c) in enumerate(_layer_names(mc)):
        h, o = f"model.layers.{i}.", f"blocks.{i}."
        rules += [same(h + "input_layernorm.weight", o + "norm1.weight"),
                  same(h + "post_attention_layernorm.weight", o + "norm2.weight")]
        rules += attn_rules(h + "self_attn.", o + "mixer.", c) + gpt_oss_moe_rules(h, o + "mlp.")
    return rules


# family name -> (config.json from our model config, our model config from an HF config, weight table)
FAMILIES = {
    "llama": (lambda mc: attn_hf_config(mc, "llama"), lambda hf: attn_our_config(hf, "llama"),
              lambda mc: attn_rules_all(mc, "llama")),
    "qwen3": (lambda mc: attn_hf_config(mc, "qwen3"), lambda hf: attn_our_config(hf, "qwen3"),
              lambda mc: attn_rules_all(mc, "qwen3")),
    "qwen3_next": (qwen3_next_hf_config, qwen3_next_our_config, qwen3_next_rules),
    "kimi_linear": (kimi_hf_config, kimi_our_config, kimi_rules),
    "deepseek_v32": (deepseek_hf_config, deepseek_our_config, deepseek_rules),
    "gpt_oss": (gpt_oss_hf_config, gpt_oss_our_config, gpt_oss_rules),
}


def family_of(mc):
    """The transformers family that can hold model config `mc` (ConvertError naming the option if none)."""
    kinds = {c.kind for _, c in _layer_names(mc)}
    if kinds <= {"attn"}:
        return attn_family(mc)
    if kinds <= {"gdn", "attn"}:
        return "qwen3_next"
    if kinds == {"mla"} and any(c.dsa is not None or c.rope for _, c in _layer_names(mc)):
        return "deepseek_v32"
    if kinds <= {"kda", "mla"}:
        return "kimi_linear"
    names = {c.kind: n for n, c in _layer_names(mc)}
    other = sorted(kinds - {"attn", "gdn"} if "gdn" in kinds else kinds - {"kda", "mla"})
    raise ConvertError(f"model.layers.{names[other[0]]}.kind={other[0]!r}: no transformers family mixes "
                       f"{' + '.join(sorted(kinds))} layers (qwen3_next: gdn + attn; kimi_linear: kda + mla; "
                       f"llama/qwen3: attn)")


# ----------------------------------------------------------------------------------------------
# The two directions, in memory


def to_hf(mc, state_dict):
    """(family, config.json dict, HF tensors) for our model config and state dict."""
    family = family_of(mc)
    hf_config_of, _, rules_of = FAMILIES[family]
    hf_cfg = hf_config_of(mc)
    tensors = {}
    for hf_names, our_names, fwd, _ in rules_of(mc):
        for name, t in zip(hf_names, fwd([state_dict[n] for n in our_names])):
            tensors[name] = t.detach().clone().contiguous()
    return family, hf_cfg, tensors


def _mtp(name, n_layer):
    """Multi-token-prediction weights, which the project's models have no use for (nor transformers'):
    Qwen3-Next's mtp.*, DeepSeek's extra layers model.layers.{n_layer..}."""
    parts = name.split(".")
    return parts[0] == "mtp" or parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= n_layer


def from_hf(hf_cfg, tensors):
    """(raw model config dict, our state dict) from a transformers config object and its tensors."""
    family = hf_cfg.model_type
    refuse(family in FAMILIES, f"config.json model_type={family!r}: not a family this converter knows "
           f"({', '.join(FAMILIES)})")
    _, our_config_of, rules_of = FAMILIES[family]
    raw = our_config_of(hf_cfg)
    try:
        mc = ModelConfig.from_dict(raw)
    except ConfigError as e:
        raise ConvertError(f"config.json does not make a valid project model ({e})") from None
    with torch.device("meta"):
        expected = GPT(mc).state_dict()
    rules = rules_of(mc)
    tensors = {DISK_ALIASES.get(family, lambda n: n)(n): t for n, t in tensors.items()}
    sd, used = {}, set()
    for hf_names, our_names, fwd, bwd in rules:
        want = fwd([expected[n] for n in our_names])           # the HF shapes this config implies
        for name, w in zip(hf_names, want):
            refuse(name in tensors, f"missing weight {name} (a {family} model with this config.json has it)")
            refuse(tuple(tensors[name].shape) == tuple(w.shape), f"weight {name} has shape "
                   f"{tuple(tensors[name].shape)}; config.json implies {tuple(w.shape)}")
        for name, t in zip(our_names, bwd([tensors[n].float() for n in hf_names])):
            sd[name] = t.contiguous()
        used.update(hf_names)
    extra = sorted(n for n in tensors if n not in used and not _mtp(n, mc.n_layer))
    refuse(not extra, f"weight {extra[0] if extra else ''} has no place in the project's {family} model")
    if mc.tie_embeddings:
        sd["lm_head.weight"] = sd["wte.weight"]
    return family, raw, sd


# ----------------------------------------------------------------------------------------------
# Files


def _fresh_dir(path):
    """--out: a new (or empty) folder that can be written; checked before any work."""
    from data.tokens import check_writable
    refuse(not os.path.isfile(path), f"--out: {path} is a file; --out names a new folder")
    refuse(not os.path.exists(path) or not os.listdir(path),
           f"{path}: already exists and is not empty; choose another --out")
    check_writable(path, "--out", kind="folder")


def _write_failed(path, e):
    return ConvertError(f"--out {path}: could not be written ({e.strerror or e}); nothing was left behind")


def write_hf(folder, hf_cfg, tensors):
    """config.json + model.safetensors into `folder`, via a temporary folder renamed into place."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    _fresh_dir(folder)
    cfg = dict(hf_cfg)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    tmp = f"{folder.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        config.save_pretrained(tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.isdir(folder):
            os.rmdir(folder)
        os.replace(tmp, folder)
    except OSError as e:  # disk full, a folder that went away
        raise _write_failed(folder, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_hf(folder):
    """(transformers config, {name: tensor}) of an HF model folder (one or several safetensors files)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    path = os.path.join(folder, "config.json")
    refuse(os.path.exists(folder), f"{folder}: no such folder; from-hf reads a local transformers model folder "
                                   f"(a hub model: download it first, e.g. huggingface-cli download {folder} "
                                   f"--local-dir hf/model, then pass hf/model)")
    refuse(os.path.isfile(path), f"{folder}: no config.json (not a transformers model folder)")
    try:
        with open(path) as f:
            raw = json.load(f)
        model_type, quant = raw.get("model_type"), raw.get("quantization_config")
    except (OSError, ValueError, AttributeError):
        raise ConvertError(f"{path}: not a readable JSON config") from None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    refuse(not quant, f"{path}: quantization_config (quant_method={method!r}): quantized weights (e.g. gpt-oss's "
           f"MXFP4 experts) do not convert; save a dequantized copy first")
    refuse(model_type in FAMILIES, f"{path}: model_type={model_type!r} is not a family this converter knows "
           f"({', '.join(FAMILIES)})")
    try:
        hf_cfg = AutoConfig.from_pretrained(folder)
    except Exception as e:  # transformers' own validation of the config
        raise ConvertError(f"{path}: transformers refuses it ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    refuse(files, f"{folder}: no *.safetensors weights (only safetensors folders convert)")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(os.path.join(folder, f)))
        except Exception as e:
            raise ConvertError(f"{os.path.join(folder, f)}: not a readable safetensors file ({type(e).__name__})") from None
    return hf_cfg, tensors


def ckpt_to_hf(ckpt_path, out):
    from config import from_raw
    from train import latest_checkpoint, load_checkpoint
    _fresh_dir(out)
    if os.path.isdir(ckpt_path):
        folder, ckpt_path = ckpt_path, latest_checkpoint(ckpt_path)
        refuse(ckpt_path is not None, f"{folder}: no checkpoint (ckpt_*.pt) in this folder")
    ckpt = load_checkpoint(ckpt_path)
    mc = from_raw(ckpt["config"]).model
    family, hf_cfg, tensors = to_hf(mc, ckpt["model"])
    write_hf(out, hf_cfg, tensors)
    return family


def hf_to_ckpt(folder, out):
    from data.tokens import DataError, atomic_write
    _fresh_dir(out)
    hf_cfg, tensors = read_hf(folder)
    family, raw, sd = from_hf(hf_cfg, tensors)
    _fresh_dir(out)
    ckpt = {"version": CKPT_VERSION, "model": sd, "step": 0, "tokens": 0,
            "config": {"model": raw, "train": {"out_dir": out}}, "converted_from": f"{family}:{folder}"}
    made = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
        atomic_write(os.path.join(out, "ckpt_0.pt"), lambda f: torch.save(ckpt, f))
    except (OSError, DataError) as e:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise e if isinstance(e, DataError) else _write_failed(out, e) from None
    return family


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-hf", help="a project checkpoint -> a transformers model folder")
    a.add_argument("--ckpt", required=True, help="checkpoint file or run folder (latest ckpt_*.pt)")
    a.add_argument("--out", required=True, help="new folder for config.json + model.safetensors")
    b = sub.add_parser("from-hf", help="a transformers model folder -> a project checkpoint")
    b.add_argument("folder", help="folder with config.json and *.safetensors")
    b.add_argument("--out", required=True, help="new run folder; the checkpoint is OUT/ckpt_0.pt")
    args = p.parse_args(argv)
    from data.tokens import DataError
    try:
        if args.cmd == "to-hf":
            family = ckpt_to_hf(args.ckpt, args.out)
        else:
            family = hf_to_ckpt(args.folder, args.out)
    except (ConvertError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the output is written to a temporary name and renamed into place at the end
        print(f"interrupted: nothing was written to {args.out}", file=sys.stderr)
        return 130
    print(f"wrote {args.out} ({family})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
