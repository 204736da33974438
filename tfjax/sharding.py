"""Tensor parallelism over a `jax.sharding.Mesh` (`model` axis) with lanes over a `data` axis, exact across degree.

Placement: parameters by module name (`param_spec`: the logical axis each splits, `vocab`/`heads`/`kv_heads`/`mlp`
/`experts` -> `model`, `embed` whole), KV pages by KV head, DeltaNet state by value head, its conv tail by channel
and `lanes` -> `data` (`cache_specs`), lane state by `lanes` (`shard_lane_state`); there is no separate table of logical names.
Column-parallel projections (q/k/v, gate/up, DeltaNet's in-projections, the vocab of the embedding and lm_head)
split their output in fixed blocks, each device computing its own inside `shard_map` (`ops.column_parallel`). Row-parallel ones (o_proj, down_proj, out_proj) are `Linear.parts` fixed K chunks
(`ops.row_parallel`): each device computes its chunks, one all-gather brings them back, and the residual add sums
them in chunk order; the count is fixed by the weight's shape (`parts_for`), so TP=1, 2, 4 and 8 compute the same
partials in the same order and agree bit for bit. Logits are gathered whole before sampling (`CausalLM._logits`).
KV heads fewer than (or not divisible by) the degree are replicated; routed experts are split over the `model`
axis by expert.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax import ops
from tfjax.config import ModelConfig

MODEL, DATA = ops.MODEL_AXIS, "data"
MAX_TP = ops.MAX_TP  # the largest degree served: a row-parallel product's partial count (fixed: never the degree)

COLUMN = ("q_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z", "lm_head")
WHOLE = ("in_proj_b", "in_proj_a")  # one column per DeltaNet head: every device computes them (see `plan`)
KV = ("k_proj", "v_proj")
ROW = ("o_proj", "down_proj", "out_proj")


class MeshError(ValueError):
    """A mesh the model or the machine cannot take (the message says which number and what to pick instead)."""


def make_mesh(tp: int = 1, dp: int = 1, devices: list | None = None) -> Mesh:
    """A (data=dp, model=tp) mesh over the first tp * dp devices."""
    devices = jax.devices() if devices is None else list(devices)
    for name, n in (("tp", tp), ("dp", dp)):
        if not isinstance(n, int) or n < 1:
            raise MeshError(f"{name} must be a positive integer, got {n!r}")
    if MAX_TP % tp:
        raise MeshError(f"tp={tp} is not a divisor of {MAX_TP} (the partial count of row-parallel products): "
                        f"use tp in 1, 2, 4, 8")
    if tp * dp > len(devices):
        raise MeshError(f"tp={tp} x dp={dp} asks for {tp * dp} devices but {len(devices)} "
                        f"{jax.default_backend()} device(s) are present: lower --tp/--dp")
    chosen = devices[: tp * dp]
    processes = jax.process_count()
    if processes > 1 and len({d.process_index for d in chosen}) < processes:  # a process without a device idles
        raise MeshError(f"tp={tp} x dp={dp} uses devices of {len({d.process_index for d in chosen})} of the run's "
                        f"{processes} processes; every process runs the same rounds, so the mesh must reach all of "
                        f"them: ask for tp x dp = {len(devices)} ({len(devices) // processes} devices a process)")
    return Mesh(np.array(chosen).reshape(dp, tp), (DATA, MODEL))


def serving_mesh(tp: int | None, dp: int, lanes: int) -> Mesh | None:
    """`tfjax.load`'s mesh: None without tp or dp (one device, the single-product path), else `make_mesh` with `dp`
    dividing the lanes."""
    if tp is None and dp == 1:
        return None
    mesh = make_mesh(1 if tp is None else tp, dp)
    if lanes % dp:
        raise MeshError(f"dp={dp} does not divide the {lanes} lanes: pick lanes (--parallel) a multiple of dp")
    return mesh


def parts_for(k: int, group: int = 1) -> int:
    """The fixed partial count of a row-parallel product over K: `MAX_TP`, halved until the chunks are whole groups."""
    p = MAX_TP
    while p > 1 and k % (p * group):
        p //= 2
    return p


def check(config: ModelConfig, tp: int) -> None:
    """Raise `MeshError` naming the dimension that `tp` does not divide."""
    c = config
    dims = [("num_attention_heads", c.num_attention_heads)]
    if c.is_moe:
        dims += [("moe_intermediate_size", c.moe_intermediate_size), ("num_experts", c.num_experts)]
        if c.shared_expert_intermediate_size:
            dims.append(("shared_expert_intermediate_size", c.shared_expert_intermediate_size))
    else:
        dims.append(("intermediate_size", c.intermediate_size))
    if "linear_attention" in c.layer_types:
        dims += [("linear_num_value_heads", c.linear_num_value_heads), ("linear_conv_dim", c.linear_conv_dim)]
    for name, n in dims:
        if n % tp:
            raise MeshError(f"tp={tp} does not divide the model's {name}={n}: pick a tp that divides it")


def _names(path) -> tuple[str, ...]:
    """A state leaf's module path and parameter name (the Variable's own `.value` step dropped)."""
    names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return tuple(n for n in names if n not in (".value", "value"))


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], config: ModelConfig, tp: int) -> P:
    """The PartitionSpec of one parameter (its module path and leaf name) at degree tp."""
    leaf, owner = path[-1], path[-2] if len(path) > 1 else ""
    if tp == 1:
        return P()
    if "experts" in path and len(shape) == 3:  # routed experts [E, out, in]: split by expert
        return P(MODEL) if shape[0] % tp == 0 else P()
    if "embed_tokens" in path:  # the table [vocab, ...] (a tied lm_head too)
        return P(MODEL, None) if shape[0] % tp == 0 else P()
    kv_split = config.num_key_value_heads % tp == 0
    if owner in COLUMN or (owner in KV and kv_split):
        return P(MODEL) if leaf == "bias" else P(MODEL, None)
    if owner in ROW:
        return P() if leaf == "bias" else P(None, MODEL)
    if path[-2:] == ("conv1d", "weight"):  # [C, K] per channel, like in_proj_qkv's columns
        return P(MODEL, None)
    return P()


def plan(model: nnx.Module, mesh: Mesh) -> None:
    """Set each row-parallel Linear's fixed `parts` and the model's `mesh` (both static: in the graphdef)."""
    from tfjax.models.layers import Linear

    tp = mesh.shape[MODEL]
    c = model.config
    check(c, tp)
    for path, m in nnx.iter_modules(model):
        names = tuple(map(str, path))
        if not isinstance(m, Linear) or not names or m.weight.ndim != 2:
            continue
        owner = names[-2] if names[-1] == "table" else names[-1]
        where = ".".join(names)
        if owner in ROW:
            group = m.quant[1] if m.quant else 1
            k = m.weight.shape[1] * (32 // m.quant[0] if m.quant else 1)
            m.split, m.parts = "row", parts_for(k, group)
            if m.parts % tp:
                raise MeshError(f"{where}: K={k} splits into only {m.parts} chunks of whole groups ({group}), "
                                f"which tp={tp} does not divide: pick a smaller tp")
        elif owner in COLUMN or owner in KV or owner in WHOLE or owner == "embed_tokens":
            # DeltaNet's gates (b, a) stay whole: their exp/softplus on a device's few columns took XLA's other
            # (scalar) code path and rounded differently at TP=4
            out = m.weight.shape[0]
            whole = (owner in WHOLE or (owner in KV and c.num_key_value_heads % tp)
                     or (owner == "embed_tokens" and out % tp))
            m.split, m.parts = ("blocks" if whole else "column"), parts_for(out)
            if not whole and m.parts % tp:
                raise MeshError(f"{where}: {out} output columns split into only {m.parts} fixed blocks, which "
                                f"tp={tp} does not divide: pick a smaller tp")
        else:  # the rest (an MoE router, the shared expert's one-column gate): one block, whole on every device, still
            # inside `shard_map` (left to XLA's partitioner, a one-column product split its K over the idle `data`
            # devices and rounded differently)
            m.split, m.parts = "blocks", 1
    model.mesh = mesh


def shardings(model: nnx.Module, mesh: Mesh):
    """The NamedSharding of every parameter, as an nnx.State shaped like `nnx.state(model)`."""
    tp = mesh.shape[MODEL]
    state = nnx.state(model)
    return jax.tree.map_with_path(
        lambda path, v: NamedSharding(mesh, param_spec(_names(path), tuple(v.shape), model.config, tp)), state)


def placer(model: nnx.Module, mesh: Mesh):
    """place(flat state key, array) -> the array in its shards (`checkpoint.load` with a mesh)."""
    tp = mesh.shape[MODEL]

    def place(key: tuple, value: jax.Array) -> jax.Array:
        spec = param_spec(tuple(str(k) for k in key), tuple(value.shape), model.config, tp)
        return jax.device_put(value, NamedSharding(mesh, spec))

    return place


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Plan the model for `mesh` and move every parameter into its shards, in place (returns the model)."""
    plan(model, mesh)
    state = nnx.state(model)
    placed = jax.tree.map(lambda v, s: jax.device_put(v, s), state, shardings(model, mesh))
    nnx.update(model, placed)
    return model


def _lanes_spec(n: int, mesh: Mesh) -> P:
    return P(DATA) if n % mesh.shape[DATA] == 0 else P()


def cache_specs(cache, mesh: Mesh, heads: bool = True):
    """PartitionSpecs of a decoder `Cache`: KV pages by kv head (replicated where the degree does not divide them),
    DeltaNet state by value head and lanes, conv tails by channel and lanes, page tables by lanes; `heads=False` (a
    replicated drafter's cache): lanes only."""
    from tfjax.models.decoder import Cache, DeltaState
    from tfjax.models.layers import KVPages

    tp = mesh.shape[MODEL]
    split = lambda n: MODEL if heads and n % tp == 0 else None  # noqa: E731
    layers = []
    for layer in cache.layers:
        if isinstance(layer, DeltaState):
            lanes = DATA if layer.state.shape[0] % mesh.shape[DATA] == 0 else None  # (None: heads stay on axis 1)
            # the conv tail by channel, as in_proj_qkv's columns and the conv runs (`ops.conv_silu`)
            layers.append(DeltaState(P(lanes, None, split(layer.conv.shape[2])), P(lanes, split(layer.state.shape[1]))))
        else:
            spec = P(None, None, split(layer.k.shape[2]))
            layers.append(KVPages(spec, spec))
    return Cache(layers, _lanes_spec(cache.page_table.shape[0], mesh))


def shard_cache(cache, mesh: Mesh, heads: bool = True):
    """`cache` placed by `cache_specs`."""
    specs = cache_specs(cache, mesh, heads)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), cache, specs)


def shard_lane_state(state, mesh: Mesh, draft_heads: bool = True):
    """A `LaneState` with its caches placed (`shard_cache`; the drafter's by head only if it is sharded itself,
    `draft_heads`), the grammar table whole on every device, and every per-lane array split over `data`."""
    fields = {}
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if f.name in ("cache", "draft_cache") and v is not None and hasattr(v, "page_table"):
            fields[f.name] = shard_cache(v, mesh, heads=f.name == "cache" or draft_heads)
        elif f.name == "grammar":  # a table of grammar states, not per lane
            fields[f.name] = None if v is None else jax.device_put(v, NamedSharding(mesh, P()))
        else:
            fields[f.name] = jax.tree.map(
                lambda a: jax.device_put(a, NamedSharding(mesh, _lanes_spec(a.shape[0], mesh) if a.ndim else P())), v)
    return dataclasses.replace(state, **fields)


def replicate(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Every parameter of `model` whole on every device of `mesh`, in place (a drafter beside a sharded target: its
    proposals never change the tokens, only how many are accepted)."""
    nnx.update(model, jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, P())), nnx.state(model)))
    return model


def shard_pool(pool, mesh: Mesh):
    """A prefix-cache snapshot pool (`lanes.snapshots`, None or a list aligned with a cache's layers) placed like its
    cache: DeltaNet state by value head, conv tails by channel, slots whole on every device."""
    from tfjax.models.decoder import DeltaState

    if pool is None:
        return None
    tp = mesh.shape[MODEL]
    out = []
    for p in pool:
        if p is None:
            out.append(None)
            continue
        heads = MODEL if p.state.shape[1] % tp == 0 else None
        channels = MODEL if p.conv.shape[2] % tp == 0 else None
        out.append(DeltaState(jax.device_put(p.conv, NamedSharding(mesh, P(None, None, channels))),
                              jax.device_put(p.state, NamedSharding(mesh, P(None, heads)))))
    return out


def bytes_per_device(model: nnx.Module) -> dict:
    """Parameter bytes held by each device (the shards' sizes summed)."""
    out: dict = {}
    for leaf in jax.tree.leaves(nnx.state(model)):
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """Join a multi-host run (`jax.distributed.initialize`) before any device is touched; with no arguments JAX
    reads its own environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) or the cluster's
    (SLURM, ...). Then `make_mesh` sees every host's devices (docs/tensor_parallel.md)."""
    if (num_processes is None) != (process_id is None):
        raise MeshError("give both num_processes and process_id, or neither (JAX reads them from the environment)")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise MeshError(f"process_id={process_id} is not in 0..{num_processes - 1} (num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def fetch(tree):
    """`jax.device_get`, except that an array split over other processes' devices (lanes over a `data` axis that
    spans hosts) is first gathered from every process: every process makes the same calls in the same order. The
    local arrays' copies all start before the first is waited for (one wait, not one a leaf)."""
    def gather(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable and not a.is_fully_replicated:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return a

    return jax.device_get(jax.tree.map(gather, tree))
