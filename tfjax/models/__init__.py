"""Model families: `qwen3_5` (dense and MoE) and `llama` (llama, qwen2)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import ModelConfig


def build(config: ModelConfig, *, seed: int = 0, kernels=None) -> nnx.Module:
    """A randomly initialised causal LM for `config` (load a checkpoint into it to serve); `kernels` (an
    `ops.Kernels`, default `Kernels.default()`) is static, in its graphdef."""
    rngs = nnx.Rngs(seed)
    if config.model_type in ("qwen3_5", "qwen3_5_moe"):
        from tfjax.models.qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(config, rngs=rngs, kernels=kernels)
    from tfjax.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(config, rngs=rngs, kernels=kernels)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_leaf(key: jax.Array, shape: tuple[int, ...], dtype: str) -> jax.Array:
    """One random leaf: packed words for uint32, small normals otherwise (never zeros)."""
    if jnp.dtype(dtype) == jnp.uint32:
        return jax.random.bits(key, shape, jnp.uint32)
    return (jax.random.normal(key, shape) * 0.02).astype(dtype)


def random_params(config: ModelConfig, *, seed: int = 0):
    """(graphdef, params) with random weights made on the device leaf by leaf, one compile per leaf shape.

    For timing full-size geometries: nothing is built on the host, unlike `build`.
    """
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(config)))
    leaves, treedef = jax.tree.flatten(state)
    key = jax.random.key(seed)
    out = [_random_leaf(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype).name)
           for i, leaf in enumerate(leaves)]
    return graphdef, jax.tree.unflatten(treedef, out)


class StaticDef:
    """A GraphDef (and its params' treedef) as a jit static argument: hashed once, equal by identity first (dense27's
    GraphDef costs 5 ms to hash and 5 ms to compare, which a jitted call with it static paid at every dispatch)."""

    __slots__ = ("graphdef", "treedef", "_hash")

    def __init__(self, graphdef, treedef=None):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticDef) and self._hash == other._hash
                                 and self.treedef == other.treedef and self.graphdef == other.graphdef)


def split(model: nnx.Module):
    """(graphdef, params) once, so jitted calls never walk Python objects: the graphdef a `StaticDef` holding the
    params' treedef, the params a flat tuple of arrays, which a jitted call takes without walking nested dicts
    (SmolLM2's 272 leaves: 112 us a call to flatten as dicts on the CPU)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(state))
    return StaticDef(graphdef, treedef), tuple(leaves)


def merge(graphdef, params) -> nnx.Module:
    """`nnx.merge` for a `split` pair (or a plain GraphDef and State)."""
    if isinstance(graphdef, StaticDef):
        if graphdef.treedef is not None and isinstance(params, tuple):
            params = jax.tree.unflatten(graphdef.treedef, params)
        graphdef = graphdef.graphdef
    return nnx.merge(graphdef, params)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def forward(graphdef, params, tokens: jax.Array, start: jax.Array, valid: jax.Array, cache, mode):
    """Jitted forward over rows `tokens` [B, T] at `start` [B]: (logits, cache, DeltaNet traces)."""
    return merge(graphdef, params)(tokens, start, valid, cache, mode)
