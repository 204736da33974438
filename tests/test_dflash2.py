"""The DFlash2 block drafter: published checkpoint layouts, a numpy reference of its block, fit errors, Facts."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import dflash_reference as ref
from tfjax import geometry, models
from tfjax.config import ModelConfig
from tfjax.drafters import dflash2, dflash2_checkpoint
from tfjax.lanes.copies import propose_copies
from tfjax.lanes.drafter import Drafted, ModelFacts

TARGET = ModelConfig.from_dict(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                    rms_norm_eps=1e-5, tie_word_embeddings=True, dtype="float32"))


def drafter_config(dflash2_parts: bool = True, **over) -> dict:
    """A tiny drafter config.json for TARGET in the published layout (sliding + full layers, window 6)."""
    dc = {"block_size": 4, "mask_token_id": 5, "target_layer_ids": [1, 2]}
    if dflash2_parts:
        dc.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                  final_logit_softcapping=20.0, output_multiplier=0.5)
    cfg = {"architectures": ["DFlash2DraftModel" if dflash2_parts else "DFlashDraftModel"], "model_type": "qwen3",
           "dflash_config": dc, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
           "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6, "is_causal": False,
           "num_target_layers": 4, "dtype": "float32"}
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def target():
    return models.build(TARGET, seed=3)


def _our_block(drafter, target, taps: np.ndarray, pending: int):
    """Absorb context taps [T, nD] at positions 0.. of lane 0, then draft the block at position T."""
    t = taps.shape[0]
    cache = drafter.init_cache(1, 32, page_size=8)
    cache = drafter.absorb(jnp.asarray(taps[None], jnp.float32), jnp.array([0]), jnp.array([t]), cache)
    h = drafter.block_hidden(target, jnp.array([pending]), jnp.array([t]), cache)[:, 1:]
    drafts = drafter.propose(target, jnp.array([pending]), jnp.array([t]), cache)
    return np.asarray(drafter.logits(target, h)[0]), np.asarray(drafts[0])


@pytest.mark.parametrize("v2", [True, False], ids=["dflash2", "dflash"])
def test_block_equals_numpy_reference_on_a_published_layout_checkpoint(tmp_path, target, v2):
    cfg = drafter_config(v2)
    weights = ref.write_checkpoint(cfg, tmp_path / "d", seed=1)
    drafter = dflash2_checkpoint.load(tmp_path / "d", target=TARGET)
    assert drafter.config.dflash2 == v2
    rng = np.random.default_rng(2)
    taps = rng.standard_normal((9, 2 * 64)).astype(np.float32)
    embed = np.asarray(target.model["embed_tokens"].table.weight[...], np.float64)
    ours_logits, ours_drafts = _our_block(drafter, target, taps, pending=17)
    ref_logits, ref_drafts = ref.block(weights, cfg, taps.astype(np.float64), 17, embed, embed)
    np.testing.assert_allclose(ours_logits, ref_logits, rtol=2e-4, atol=2e-4)
    assert ours_drafts.tolist() == ref_drafts.tolist()


def test_rejected_rows_never_reach_the_block(target):
    """Context rows past the committed count are not written: the block is the same as without them."""
    drafter = dflash2.build(dflash2.DFlashConfig.from_dict(drafter_config()), seed=4).bind(TARGET)
    rng = np.random.default_rng(5)
    taps = jnp.asarray(rng.standard_normal((1, 6, 128)), jnp.float32)
    junk = jnp.asarray(rng.standard_normal((1, 6, 128)), jnp.float32)
    a = drafter.absorb(taps, jnp.array([0]), jnp.array([6]), drafter.init_cache(1, 32, 8))
    b = drafter.absorb(taps, jnp.array([0]), jnp.array([6]), drafter.init_cache(1, 32, 8))
    b = drafter.absorb(junk, jnp.array([6]), jnp.array([0]), b)  # a round that committed nothing
    pa = drafter.propose(target, jnp.array([9]), jnp.array([6]), a)
    pb = drafter.propose(target, jnp.array([9]), jnp.array([6]), b)
    assert np.array_equal(pa, pb)


def _mlx_reference_weights(path) -> dict[str, np.ndarray]:
    """An MLX drafter folder's tensors with quantized ones dequantized (published names)."""
    from tfjax import quant
    from tfjax.checkpoint import iter_tensors

    raw = {k: np.asarray(v, np.float32) if v.dtype != jnp.uint32 else v for k, v in iter_tensors(path)}
    out = {}
    for key, value in raw.items():
        if key.endswith((".scales", ".biases")):
            continue
        stem = key[: -len(".weight")]
        if stem + ".scales" in raw:
            value = np.asarray(quant.dequantize(jnp.asarray(value), jnp.asarray(raw[stem + ".scales"]),
                                                jnp.asarray(raw[stem + ".biases"]), bits=4, group_size=32,
                                                dtype=jnp.float32))
            key = stem if stem in dflash2_checkpoint.CODEBOOKS else key
        out[key] = value
    return out


def test_mlx_4bit_checkpoint_loads_and_equals_the_reference_on_dequantized_weights(tmp_path, target):
    cfg = drafter_config()
    cfg["dflash_config"]["selector_rank"] = 32  # rank 32: the codebooks quantize too
    ref.write_checkpoint(cfg, tmp_path / "bf16", seed=6)
    dflash2_checkpoint.write_mlx(tmp_path / "bf16", tmp_path / "mlx", bits=4, group_size=32)
    drafter = dflash2_checkpoint.load(tmp_path / "mlx", target=TARGET)
    quantized = drafter.config.quantization
    assert quantized.for_layer("layers.0.self_attn.q_proj") == (4, 32)
    assert quantized.for_layer("candidate_selector.successor_codebook") == (4, 32)
    taps = np.random.default_rng(7).standard_normal((7, 128)).astype(np.float32)
    embed = np.asarray(target.model["embed_tokens"].table.weight[...], np.float64)
    ours_logits, ours_drafts = _our_block(drafter, target, taps, pending=3)
    ref_logits, ref_drafts = ref.block(_mlx_reference_weights(tmp_path / "mlx"), cfg, taps.astype(np.float64), 3,
                                       embed, embed)
    np.testing.assert_allclose(ours_logits, ref_logits, rtol=2e-3, atol=2e-3)
    assert ours_drafts.tolist() == ref_drafts.tolist()


def test_our_export_is_read_back_by_our_loader(tmp_path, target):
    drafter = dflash2.build(dflash2.DFlashConfig.from_dict(drafter_config()), seed=8).bind(TARGET)
    dflash2_checkpoint.save(drafter, tmp_path / "out", dtype="float32")
    back = dflash2_checkpoint.load(tmp_path / "out", target=TARGET)
    assert set(ref.published_shapes(drafter_config())) == set(dflash2_checkpoint.published_tensors(drafter))
    taps = np.random.default_rng(9).standard_normal((5, 128)).astype(np.float32)
    assert np.array_equal(_our_block(drafter, target, taps, 4)[0], _our_block(back, target, taps, 4)[0])


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 32, "hidden_size=32"),
    ("vocab_size", 300, "vocab_size=300"),
    ("num_target_layers", 30, "30-layer target"),
])
def test_a_drafter_that_does_not_fit_the_target_is_a_clear_error(field, value, match):
    cfg = dflash2.DFlashConfig.from_dict(drafter_config(**{field: value}))
    with pytest.raises(dflash2.DrafterMismatch, match=match):
        dflash2.check_fits(cfg, TARGET)


def test_tapping_a_layer_the_target_lacks_is_a_clear_error(tmp_path):
    cfg = drafter_config()
    cfg["dflash_config"]["target_layer_ids"] = [1, 7]
    ref.write_checkpoint(cfg, tmp_path / "d")
    with pytest.raises(dflash2.DrafterMismatch, match=r"taps target layers \[7\]"):
        dflash2_checkpoint.load(tmp_path / "d", target=TARGET)


def test_published_dflash2_config_parses():
    """The shape of z-lab's DFlash2 config.json: drafter keys nested in dflash_config."""
    cfg = dflash2.DFlashConfig.from_dict(drafter_config())
    assert cfg.dflash2 and cfg.block_size == 4 and cfg.target_layer_ids == (1, 2) and cfg.selector_top_k == 4
    assert cfg.window(0) == 6 and cfg.window(1) is None and not cfg.causal(0)
    assert dflash2.DFlashConfig.from_dict(cfg.to_dict()) == cfg
    assert dflash2.target_layer_ids(52, 5) == (1, 13, 25, 37, 49)


def _abstract_drafter_for(target_cfg: ModelConfig):
    """A DFlash2 drafter sized for `target_cfg`, built abstractly (no weights allocated)."""
    raw = drafter_config(hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
                         num_target_layers=target_cfg.num_hidden_layers, head_dim=128, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=17408)
    raw["dflash_config"].update(target_layer_ids=list(dflash2.target_layer_ids(target_cfg.num_hidden_layers, 5)),
                                block_size=16, conv_group_size=16)
    cfg = dflash2.DFlashConfig.from_dict(raw)
    return nnx.eval_shape(lambda: dflash2.DFlashDrafter(cfg, rngs=nnx.Rngs(0))).bind(target_cfg)


@dataclasses.dataclass
class _Backend:
    facts: ModelFacts


def _copies_after(match: int, copy_match: int) -> bool:
    """Whether copies enter on a history whose suffix matched exactly `match` tokens earlier."""
    rng = np.random.default_rng(match)
    tokens = rng.permutation(np.arange(100, 1000))[:64].astype(np.int32)
    tokens[64 - match :] = tokens[5 : 5 + match]
    tokens[64 - match - 1] = 7
    _, count = propose_copies(jnp.asarray(tokens[None]), jnp.array([64]), copy_match, 4)
    return int(count[0]) > 0


def test_dense27_copies_after_twenty_beside_dflash2_and_after_five_alone():
    dense = _Backend(ModelFacts(root_copies=True, enter_match=5))
    beside = Drafted(dense, _abstract_drafter_for(geometry.dense27)).facts
    alone = Drafted(dense, None).facts
    assert beside.copy_match == 20 and beside.draft_block == 15
    assert alone.copy_match == 5
    assert _copies_after(20, beside.copy_match) and not _copies_after(19, beside.copy_match)
    assert _copies_after(5, alone.copy_match) and not _copies_after(4, alone.copy_match)


def test_dflash2_facts_keep_the_targets_match_on_an_moe_shape():
    drafter = _abstract_drafter_for(geometry.moe35a3)
    assert drafter.facts.copy_match == 0
    assert Drafted(_Backend(ModelFacts()), drafter).facts.copy_match == 5


def test_the_candidate_selector_takes_its_top_k_without_sorting_the_vocabulary(target):
    """XLA CPU rewrote the selector's top_k into a full sort of the vocabulary (143 ms of a drafted SmolLM2 round's
    ~270): the compiled proposal holds no sort."""
    import jax

    drafter = dflash2.build(dflash2.DFlashConfig.from_dict(drafter_config()), seed=4).bind(TARGET)
    cache = drafter.init_cache(1, 32, 8)
    gd, ps = nnx.split(drafter)
    tgd, tps = nnx.split(target)

    def propose(ps, tps, cache):
        return nnx.merge(gd, ps).propose(nnx.merge(tgd, tps), jnp.array([9]), jnp.array([6]), cache)

    hlo = jax.jit(propose).lower(ps, tps, cache).compile().as_text()
    assert " sort(" not in hlo and "topk" in hlo.lower()
