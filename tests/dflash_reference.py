"""A plain numpy DFlash / DFlash2 block forward over published-layout tensors, and a tiny checkpoint writer.

Written from the published description (z-lab/dflash `model.py`), independent of tfjax's modules: the test
compares our drafter's block with this one on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def published_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash(2) drafter checkpoint with its shape, from its config.json dict."""
    dc = cfg["dflash_config"]
    d, hd, h, g, i = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"]
    shapes = {"fc.weight": (d, len(dc["target_layer_ids"]) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (g * hd, d),
                       p + "self_attn.v_proj.weight": (g * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (i, d), p + "mlp.up_proj.weight": (i, d),
                       p + "mlp.down_proj.weight": (d, i), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
        if "conv_kernel_size" in dc:
            k, groups = dc["conv_kernel_size"], d // dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + conv + ".base_kernel"] = (2, k, d)
                shapes[p + conv + ".kernel_projection.weight"] = (2 * k * groups, d)
    if "selector_rank" in dc:
        r = dc["selector_rank"]
        shapes.update({"candidate_selector.hidden_projection.weight": (r, d),
                       "candidate_selector.predecessor_codebook": (cfg["vocab_size"], r),
                       "candidate_selector.successor_codebook": (cfg["vocab_size"], r)})
    return shapes


def write_checkpoint(cfg: dict, out: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors in the published layout, saved with config.json; returns the tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for key, shape in published_shapes(cfg).items():
        if len(shape) == 1:
            tensors[key] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[key] = (rng.standard_normal(shape) * (0.3 if "base_kernel" in key else shape[-1] ** -0.5)
                            ).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return tensors


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    e = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, e, 2) / e)
    ang = pos[:, None] * inv[None, :]  # [T, E/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : e // 2], x[..., e // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _conv(h, dyn, base, group):
    t, d = h.shape
    out = np.zeros_like(h)
    for o in range(base.shape[0]):
        shifted = np.concatenate([np.zeros((o, d)), h[: t - o]], axis=0)
        per_channel = base[o][None, :] + np.repeat(dyn[:, o, :], group, axis=1)  # [T, D]
        out += per_channel * shifted
    return out


def block(w: dict, cfg: dict, taps: np.ndarray, pending: int, embed: np.ndarray, head: np.ndarray):
    """Logits [B-1, V] and drafts [B-1] of one block after context taps [T, nD] (positions 0..T-1)."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    dc = cfg["dflash_config"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    hd, nh, ng = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    bsz, t = dc["block_size"], taps.shape[0]
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    pos_c, pos_b = np.arange(t, dtype=np.float64), t + np.arange(bsz, dtype=np.float64)
    x = embed[[pending] + [dc["mask_token_id"]] * (bsz - 1)].astype(np.float64)
    conv = "conv_kernel_size" in dc
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."

        def lin(name, v, p=p):
            return v @ w[p + name + ".weight"].T

        def conv_in(v, name, p=p):
            k, groups = dc["conv_kernel_size"], cfg["hidden_size"] // dc["conv_group_size"]
            dyn = lin(name + ".kernel_projection", v).reshape(-1, 2, k, groups)
            base = w[p + name + ".base_kernel"]
            return _conv(v, dyn[:, 0], base[0], dc["conv_group_size"]), (dyn[:, 1], base[1])

        def heads(v, m):
            return v.reshape(v.shape[0], m, hd)

        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        if conv:
            h, fin = conv_in(h, "attention_conv")
        q = _rope(_rms(heads(lin("self_attn.q_proj", h), nh), w[p + "self_attn.q_norm.weight"], eps), pos_b, theta)
        keys = np.concatenate([_rope(_rms(heads(lin("self_attn.k_proj", v), ng), w[p + "self_attn.k_norm.weight"],
                                          eps), pos, theta) for v, pos in ((ctx, pos_c), (h, pos_b))])
        vals = np.concatenate([heads(lin("self_attn.v_proj", v), ng) for v in (ctx, h)])
        kpos = np.concatenate([pos_c, pos_b])
        sliding = cfg["layer_types"][n] == "sliding_attention"
        visible = np.ones((bsz, t + bsz), bool)
        if sliding:
            visible &= (pos_b[:, None] - kpos[None, :] < cfg["sliding_window"]) | (kpos[None, :] >= t)
        if cfg.get("is_causal", sliding):
            visible &= kpos[None, :] <= pos_b[:, None]
        out = np.zeros((bsz, nh, hd))
        for head_i in range(nh):
            kv = head_i // (nh // ng)
            s = q[:, head_i] @ keys[:, kv].T / np.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            out[:, head_i] = (e / e.sum(-1, keepdims=True)) @ vals[:, kv]
        a = lin("self_attn.o_proj", out.reshape(bsz, -1))
        if conv:
            a = _conv(a, fin[0], fin[1], dc["conv_group_size"])
        x = x + a
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if conv:
            h, fin = conv_in(h, "mlp_conv")
        g = lin("mlp.gate_proj", h)
        m = lin("mlp.down_proj", g / (1 + np.exp(-g)) * lin("mlp.up_proj", h))
        if conv:
            m = _conv(m, fin[0], fin[1], dc["conv_group_size"])
        x = x + m
    hid = _rms(x, w["norm.weight"], eps)[1:]
    logits = hid @ head.T * dc.get("output_multiplier", 1.0)
    cap = dc.get("final_logit_softcapping")
    if cap:
        logits = np.tanh(logits / cap) * cap
    if "selector_rank" not in dc:
        return logits, logits.argmax(-1)
    proj = hid @ w["candidate_selector.hidden_projection.weight"].T
    prev, path = pending, []
    for i in range(bsz - 1):
        cand = np.argsort(-logits[i], kind="stable")[: dc["selector_top_k"]]
        edge = (w["candidate_selector.predecessor_codebook"][prev] * proj[i]) @ \
            w["candidate_selector.successor_codebook"][cand].T
        prev = int(cand[np.argmax(logits[i, cand] + edge)])
        path.append(prev)
    return logits, np.array(path)
