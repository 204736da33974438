"""Tensor parallelism is exact across degree: TP=1, 2, 4 (and TP=2 x DP=2) give the same logits bit for bit and the
same token_sha256; each device holds 1/N of every sharded parameter; bad meshes are clear errors.

The cases run in a subprocess with 8 simulated CPU devices (`XLA_FLAGS` must be set before jax is imported):
`python tests/test_tensor_parallel.py CASE` prints one JSON line that the tests read.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
             dtype="float32")


def _env(devices: int = 8) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    if os.environ.get("TFJAX_TP_TEST_DEVICES") != "real":  # scripts/device/gpu_tp.sh runs them on the GPUs
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return env


def _worker(case: str, *args: str) -> dict:
    run = subprocess.run([sys.executable, __file__, case, *args], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=3600)
    assert run.returncode == 0, run.stderr[-4000:]
    return _last_json(run.stdout)


def _last_json(stdout: str) -> dict:
    """The worker's JSON line (gloo, JAX's CPU collectives, prints to stdout too, as late as its shutdown)."""
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def _cluster(processes: int, devices: int, case: str, *args: str, timeout: float = 3600) -> list[dict]:
    """Each process's JSON line from `processes` workers on this host, `devices` CPU devices each, joined by
    jax.distributed at a free local port (over gloo, JAX's CPU collectives); past `timeout` seconds every worker is
    killed and the test fails with their stderr (processes whose collectives disagree may wait forever)."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, __file__, case, port, str(processes), str(i), *args], env=_env(devices),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(processes)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        errs = [p.communicate()[1][-2000:] for p in procs]
        pytest.fail(f"{case} workers still running after {timeout} s: {errs}")
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    return [_last_json(o) for o, _ in outs]


# --- the worker side (8 simulated devices) ---


def _config(name: str):
    from tfjax import geometry
    from tfjax.config import ModelConfig

    if name == "llama":
        return ModelConfig.from_dict(LLAMA)
    layers = ("linear_attention", "full_attention")
    return getattr(geometry, name).replace(num_hidden_layers=2, layer_types=layers)


def _model(name: str, tp: int | None, dp: int = 1):
    from tfjax import models, sharding

    m = models.build(_config(name), seed=5)
    if tp is not None:
        sharding.shard_model(m, sharding.make_mesh(tp, dp))
    return m


def case_logits(name: str) -> dict:
    """sha256 of prompt-then-step logits at each degree, and the shard checks at TP=2 and 4."""
    import jax
    import numpy as np
    from helpers import prefill_then_steps

    from tfjax import sharding

    tokens = np.random.default_rng(1).integers(0, 250, 10)
    out, shards = {}, {}
    for tp in (1, 2, 4):
        m = _model(name, tp)
        out[tp] = hashlib.sha256(prefill_then_steps(m, tokens, 7).tobytes()).hexdigest()
        if tp > 1:
            bad, sharded, full = [], 0, 0
            from flax import nnx

            placed = jax.tree.leaves_with_path(nnx.state(m))
            for (path, leaf), s in zip(placed, jax.tree.leaves(sharding.shardings(m, m.mesh)), strict=True):
                full += leaf.nbytes
                spec = s.spec
                if all(a is None for a in spec):
                    continue
                sharded += leaf.nbytes
                want = tuple(d // tp if i < len(spec) and spec[i] == sharding.MODEL else d
                             for i, d in enumerate(leaf.shape))
                if {sh.data.shape for sh in leaf.addressable_shards} != {want}:
                    bad.append(jax.tree_util.keystr(path))
            per_device = sharding.bytes_per_device(m)
            shards[tp] = dict(bad=bad, sharded=sharded, full=full,
                              per_device=sorted(set(per_device.values())), devices=len(per_device))
    return dict(hashes=out, shards=shards)


def case_lane_rows(name: str, meshes: str = "1x1,1x2,2x2,4x2") -> dict:
    """sha256 of one lane round's forward over 2 lanes (random DeltaNet state and KV pages): the logits, the new
    DeltaNet state and the gates, per mesh (lanes split over `data` where dp > 1); and the lane counts of the
    compiled program's [lanes, rows, hidden] activations (a device's own lanes only where dp > 1)."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax import models, sharding
    from tfjax.models.layers import ROWS

    rng = np.random.default_rng(6)
    lanes, rows = 2, 4
    tokens = jnp.asarray(rng.integers(0, 250, (lanes, rows)), jnp.int32)
    start, valid = jnp.asarray([5, 9], jnp.int32), jnp.full((lanes,), rows, jnp.int32)
    out = {}
    for mesh in meshes.split(","):
        tp, dp = map(int, mesh.split("x"))
        m = _model(name, tp, dp)
        cache = m.init_cache(lanes, 64)
        fill = np.random.default_rng(7)
        cache = jax.tree.map(lambda a: jnp.asarray(fill.standard_normal(a.shape).astype(a.dtype) * 0.1)  # noqa: B023
                             if jnp.issubdtype(a.dtype, jnp.floating) else a, cache)
        cache = sharding.shard_cache(cache, m.mesh)
        by_lane = lambda a: jax.device_put(a, NamedSharding(m.mesh, P(sharding.DATA)))  # noqa: B023, E731
        graphdef, params = models.split(m)
        args = (graphdef, params, by_lane(tokens), by_lane(start), by_lane(valid), cache, ROWS)
        logits, new, traces = models.forward(*args)
        delta = [(lc.state, tr.g, tr.beta) for lc, tr in zip(new.layers, traces, strict=True) if tr is not None]
        out[mesh] = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in jax.tree.leaves((logits, delta))))\
            .hexdigest()
        hlo = models.forward.lower(*args).compile().as_text()
        out[f"{mesh}/lanes"] = sorted({int(n) for n in re.findall(rf"f32\[(\d+),{rows},{m.config.hidden_size}\]", hlo)})
    return out


def _alternating_grammar(vocab: int):
    """A hand-built token grammar: even ids, then odd ids, and so on (a mask that changes every token)."""
    import numpy as np

    from tfjax.grammar import TokenGrammar

    table = np.full((2, vocab), -1, np.int32)
    table[0, 0::2], table[1, 1::2] = 1, 0
    return TokenGrammar("even-odd", table, 0)


def case_tokens(name: str, meshes: str = "1x1,2x1,4x1,2x2") -> dict:
    """token_sha256 per (mesh, mode, drafted/plain) through the engine's lane rounds: greedy, sampled, penalties with
    logit_bias and logprobs, a grammar mask, and a second turn resumed from the prefix cache."""
    import numpy as np

    from tfjax.engine import Engine, Request
    from tfjax.lanes.config import LaneConfig

    lanes = LaneConfig(capacity=2, width=4, context=96, page_size=16)
    rng = np.random.default_rng(3)
    span = rng.integers(0, 250, 8).tolist()
    prompts = [rng.integers(0, 250, 12).tolist() + span + span, rng.integers(0, 250, 20).tolist()]
    new_words = rng.integers(0, 250, 9).tolist()
    sampled = dict(temperature=1.0, top_k=20, top_p=0.95, seed=7)
    modes = {"greedy": [{}, {}], "sampled": [sampled, sampled],
             "processors": [dict(sampled, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                                 logit_bias={5: 3.0, 7: -100.0}, logprobs=True, top_logprobs=2),
                            dict(grammar=_alternating_grammar(_config(name).vocab_size))]}
    out = {}
    for mesh in meshes.split(","):
        tp, dp = map(int, mesh.split("x"))
        engine = Engine(_model(name, tp, dp), lanes, eos_ids=(), prefix_cache_gb=0.001, prefill_chunk=16)
        for mode, params in modes.items():
            for draft in (True, False):
                rs = engine.run([Request(p, max_tokens=10, draft=draft, **kw) for p, kw in zip(prompts, params,
                                                                                               strict=True)])
                how = "drafted" if draft else "plain"
                out[f"{mesh}/{mode}/{how}"] = [r.token_sha256 for r in rs]
                if mode == "processors":  # logprobs and top logprobs of the penalized lane
                    out[f"{mesh}/logprobs/{how}"] = hashlib.sha256(np.asarray(rs[0].logprobs, np.float32).tobytes()
                                                                   + repr(rs[0].top_logprobs).encode()).hexdigest()
                if mode == "greedy" and draft:
                    turn2 = [p + r.token_ids + new_words for p, r in zip(prompts, rs, strict=True)]
        rs = engine.run([Request(p, max_tokens=10) for p in turn2])  # resumed from the prefix cache
        out[f"{mesh}/resumed/drafted"] = [r.token_sha256 for r in rs]
        out[f"{mesh}/cached"] = [r.cached_tokens for r in rs]
    return out


def _drafter(kind: str, name: str, mesh):
    """A random drafter, whole on every device of `mesh` (as `tfjax.load` places one): a draft model (the target's
    shape, other weights) or a DFlash2 block drafter tapping both target layers."""
    from tests.test_dflash2 import drafter_config
    from tfjax import models, sharding
    from tfjax.drafters import dflash2

    config = _config(name)
    if kind == "model":
        d = models.build(config, seed=9)
    else:
        raw = drafter_config(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                             num_target_layers=config.num_hidden_layers)
        raw["dflash_config"].update(block_size=4, target_layer_ids=[0, 1])
        d = dflash2.build(dflash2.DFlashConfig.from_dict(raw), seed=12).bind(config)
    return sharding.replicate(d, mesh)


def case_drafters(name: str, meshes: str = "1x1,2x1,4x1,2x2") -> dict:
    """token_sha256 per (mesh, drafter, mode): a draft model and a DFlash2 block drafter beside the sharded target,
    greedy and sampled (and the same requests plain at 1 x 1); how many tokens the drafters proposed."""
    import numpy as np

    from tfjax.engine import Engine, Request
    from tfjax.lanes.config import LaneConfig

    lanes = LaneConfig(capacity=2, width=4, context=96, page_size=16)
    rng = np.random.default_rng(8)
    span = rng.integers(0, 250, 6).tolist()
    prompts = [rng.integers(0, 250, 10).tolist() + span + span, rng.integers(0, 250, 14).tolist()]
    modes = {"greedy": {}, "sampled": dict(temperature=1.0, top_k=20, top_p=0.95, seed=7)}
    out = {}
    for mesh in meshes.split(","):
        tp, dp = map(int, mesh.split("x"))
        target = _model(name, tp, dp)
        for kind in ("model", "dflash2"):
            engine = Engine(target, lanes, drafter=_drafter(kind, name, target.mesh), eos_ids=())
            for mode, kw in modes.items():
                for draft in (True, False) if mesh == "1x1" else (True,):  # plain at every mesh: case_tokens
                    rs = engine.run([Request(p, max_tokens=10, draft=draft, **kw) for p in prompts])
                    out[f"{mesh}/{kind}/{mode}/{'drafted' if draft else 'plain'}"] = [r.token_sha256 for r in rs]
                    if draft:
                        out[f"{mesh}/{kind}/{mode}/proposed"] = sum(r.proposed for r in rs)
    return out


def case_join(port: str, processes: str, process_id: str) -> dict:
    """Join a run at the CLI's entry point, then fetch a lanes array split over a `data` axis spanning every process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax import sharding

    sharding.initialize_distributed(f"localhost:{port}", int(processes), int(process_id))
    mesh = sharding.make_mesh(2, len(jax.devices()) // 2)
    lanes = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    split = jax.jit(lambda a: a + 1, out_shardings=NamedSharding(mesh, P(sharding.DATA)))(jnp.asarray(lanes))
    return dict(processes=jax.process_count(), devices=len(jax.devices()), same=bool(np.array_equal(
        sharding.fetch(split), lanes + 1)), whole=split.is_fully_addressable)


def case_cluster(port: str, processes: str, process_id: str, mesh: str) -> dict:
    """token_sha256 of greedy, sampled and processed (logprobs) requests, drafted and plain, from one process of a
    `processes`-process run on this host (0: no jax.distributed at all); the mesh spans every process's devices."""
    import jax
    import numpy as np

    from tfjax import sharding
    from tfjax.engine import Engine, Request
    from tfjax.lanes.config import LaneConfig

    if int(processes):
        sharding.initialize_distributed(f"localhost:{port}", int(processes), int(process_id))
    tp, dp = map(int, mesh.split("x"))
    lanes = LaneConfig(capacity=2, width=4, context=96, page_size=16)
    rng = np.random.default_rng(3)
    span = rng.integers(0, 250, 6).tolist()
    prompts = [rng.integers(0, 250, 10).tolist() + span + span, rng.integers(0, 250, 14).tolist()]
    sampled = dict(temperature=1.0, top_k=20, top_p=0.95, seed=7)
    modes = {"greedy": {}, "sampled": sampled, "processors": dict(sampled, presence_penalty=0.5, logprobs=True,
                                                                  top_logprobs=2)}
    engine = Engine(_model("tiny_dense", tp, dp), lanes, eos_ids=())
    out = dict(processes=jax.process_count(), devices=len(jax.devices()), local=len(jax.local_devices()))
    for mode, kw in modes.items():
        for draft in (True, False):
            rs = engine.run([Request(p, max_tokens=8, draft=draft, **kw) for p in prompts])
            out[f"{mode}/{'drafted' if draft else 'plain'}"] = [r.token_sha256 for r in rs]
            if mode == "processors":
                out[f"logprobs/{'drafted' if draft else 'plain'}"] = hashlib.sha256(
                    np.asarray([r.logprobs for r in rs], np.float32).tobytes()).hexdigest()
    return out


SERVE_BODIES = [{"messages": [{"role": "user", "content": f"Count to {n}"}], "max_tokens": m, "temperature": t,
                 "seed": 3, "ignore_eos": True, **({"stop": stop} if stop else {})}
                for n, m, t, stop in ((5, 12, 0.0, None), (9, 7, 0.8, None), (7, 12, 0.0, ["e"]), (3, 5, 0.0, None),
                                      (4, 10, 0.7, ["a", "o"]), (6, 9, 0.0, None))]  # 6 requests, 4 lanes


def case_serve(port: str, processes: str, process_id: str, folder: str, mesh: str) -> dict:
    """(token_sha256, finish_reason) of concurrent chats over HTTP (uvicorn) to `tfjax serve`'s app on process 0 of
    a `processes`-process run (0: no jax.distributed; mesh "none": one device), the other processes following its
    engine steps without HTTP (`lockstep.follow`)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import jax
    from server_helpers import connect, request, serving

    from tfjax import api, sharding
    from tfjax.engine import lockstep
    from tfjax.server import create_app

    if int(processes):
        sharding.initialize_distributed(f"localhost:{port}", int(processes), int(process_id))
    tp, dp = (None, 1) if mesh == "none" else map(int, mesh.split("x"))
    llm = api.load(folder, lanes=4, width=4, context=256, tp=tp, dp=dp)
    if jax.process_index() > 0:
        return dict(steps=lockstep.follow(llm, lockstep.Channel()), rounds=llm.engine.rounds)
    leader = lockstep.Leader(llm.engine, lockstep.Channel()) if jax.process_count() > 1 else None

    def ask(url, body):
        status, out, _ = request(connect(url), "POST", "/v1/chat/completions", body)
        assert status == 200, out
        return out["token_sha256"], out["choices"][0]["finish_reason"]

    app = create_app(llm, name="tiny", max_tokens=16, lockstep=leader)
    with serving(app) as url:
        conn = connect(url)  # a long stream that goes away after its first text: the engine cancels it
        conn.request("POST", "/v1/chat/completions", json.dumps({**SERVE_BODIES[0], "max_tokens": 200,
                                                                   "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:  # until its first text
            event = json.loads(line[6:]) if line.startswith(b"data: {") else {}
            if any(c["delta"].get("content") for c in event.get("choices", ())):
                break
        resp.close()
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        with ThreadPoolExecutor(len(SERVE_BODIES)) as pool:
            replies = list(pool.map(lambda b: ask(url, b), SERVE_BODIES))  # noqa: B023
    return dict(replies=replies, rounds=llm.engine.rounds, cancels=len(app.state.server.worker.cancel_log))


def case_checkpoint(folder: str) -> dict:
    """A Hugging Face folder and its 4-bit MLX conversion loaded straight into TP=2 shards: every shard the spec's
    slice of the one-device load, every device the same share; the same logits as a one-device load sharded after
    the fact, and as a TP=1 load."""
    import tempfile
    from pathlib import Path

    import jax
    import numpy as np
    from flax import nnx
    from helpers import make_hf_checkpoint, prefill_then_steps

    from tfjax import checkpoint, sharding

    root = Path(tempfile.mkdtemp(dir=folder))
    make_hf_checkpoint(_config("tiny_dense"), root / "hf", seed=2)
    checkpoint.write_mlx(root / "hf", root / "q4", bits=4, group_size=32, progress=False)
    out = {}
    tokens = np.random.default_rng(4).integers(0, 250, 8)
    for name in ("hf", "q4"):
        mesh = sharding.make_mesh(2)
        whole, _ = checkpoint.load(root / name, progress=False)
        sharded, _ = checkpoint.load(root / name, progress=False, mesh=mesh)
        bad = []
        for (path, a), b in zip(jax.tree.leaves_with_path(nnx.state(whole)), jax.tree.leaves(nnx.state(sharded)),
                                strict=True):
            for sh in b.addressable_shards:
                if not np.array_equal(np.asarray(a)[sh.index], np.asarray(sh.data)):
                    bad.append(jax.tree_util.keystr(path))
        one, _ = checkpoint.load(root / name, progress=False, mesh=sharding.make_mesh(1))
        later = sharding.shard_model(whole, mesh)
        logits = prefill_then_steps(sharded, tokens, 6)
        same = np.array_equal(logits, prefill_then_steps(later, tokens, 6))
        same_tp1 = np.array_equal(logits, prefill_then_steps(one, tokens, 6))
        out[name] = dict(bad=bad, same_logits=bool(same), same_as_tp1=bool(same_tp1), per_device=sorted(set(
            sharding.bytes_per_device(sharded).values())), quantized=sharded.config.quantization is not None)
    return out


# --- the tests ---


@pytest.fixture(scope="module")
def dense_logits():
    return _worker("logits", "tiny_dense")


def test_logits_are_bit_identical_at_tp_1_2_and_4(dense_logits):
    hashes = dense_logits["hashes"]
    assert hashes["2"] == hashes["1"] and hashes["4"] == hashes["1"], hashes


@pytest.mark.slow  # ~90 s; the slow token test pins the same meshes through whole requests
def test_lane_round_is_bit_identical_with_lanes_split_over_data():
    # dp > 1 once rounded DeltaNet's gates differently (XLA split the row tiles of the lanes over `data`)
    out = _worker("lane_rows", "tiny_dense")
    hashes = {k: v for k, v in out.items() if "/" not in k}
    assert len(set(hashes.values())) == 1, hashes
    for mesh in ("1x1", "1x2", "2x2", "4x2"):  # each device computes only its own lanes (2 lanes, dp of them)
        assert out[f"{mesh}/lanes"] == [2 // int(mesh[-1])], (mesh, out[f"{mesh}/lanes"])


@pytest.mark.parametrize("tp", ["2", "4"])
def test_each_device_holds_one_nth_of_every_sharded_parameter(dense_logits, tp):
    s = dense_logits["shards"][tp]
    assert s["bad"] == [] and s["sharded"] > 0.9 * s["full"] and s["devices"] == int(tp), s
    replicated = s["full"] - s["sharded"]
    assert s["per_device"] == [s["sharded"] // int(tp) + replicated], s  # every device the same share


@pytest.mark.parametrize("rows", [True, False], ids=["paged_rows", "flash_prompt"])
@pytest.mark.parametrize("heads,kv_heads", [pytest.param(8, 2, marks=pytest.mark.slow), (8, 4),
                                             pytest.param(12, 6, marks=pytest.mark.slow)],
                         ids=["kv_1_a_device", "kv_split", "kv_taken"])  # CI runs the KV split; -m slow the others
def test_attention_kernel_runs_on_each_devices_own_heads(monkeypatch, rows, heads, kv_heads):
    """The GPU path's attention kernel (interpreted here) inside `shard_map`: each device passes it its own q heads
    and their KV heads, the compiled program has no collective, and TP=1, 2, 4 equal the unsharded kernel bit for
    bit (KV pages split where the degree divides them, else whole: one KV head a device, or its heads' KV heads)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import attention as pk
    from pallas_kernels import flash_attention as fa
    from tests.helpers import spy_interpreted
    from tfjax import ops, sharding

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    module, name = (pk, "paged_attention") if rows else (fa, "flash_attention")
    calls = spy_interpreted(monkeypatch, module, name, lambda a, kw: (a[0].shape[2], a[1].shape[2]))
    rng = np.random.default_rng(12)
    n_pages, page, e, width = 12, 16, 64, 5
    pages = ops.KVPages(*(jnp.asarray(rng.standard_normal((n_pages, page, kv_heads, e)), jnp.float32)
                          for _ in range(2)))
    table = jnp.asarray(rng.permutation(n_pages)[: 2 * width].reshape(2, width), jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 3, heads, e)), jnp.float32)
    pos = jnp.asarray([[40, 41, 42], [10, 11, 12]], jnp.int32)

    def attend(q, pages, table, pos, mesh=None):
        with ops.using(ops.PALLAS), ops.using_mesh(mesh):
            return ops.paged_attention(q, pages, table, pos, rows=rows)

    want = jax.jit(attend)(q, pages, table, pos)
    assert calls == [(heads, kv_heads)]
    for tp in (1, 2, 4):
        mesh = sharding.make_mesh(tp)
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: B023, E731
        kv = P(None, None, "model", None) if kv_heads % tp == 0 else P()
        args = (put(q, P(None, None, "model", None)), ops.KVPages(put(pages.k, kv), put(pages.v, kv)),
                put(table, P()), put(pos, P()))
        calls.clear()
        fn = jax.jit(lambda *a: attend(*a, mesh=mesh))  # noqa: B023
        got = fn(*args)
        np.testing.assert_array_equal(got, want, err_msg=f"{tp=}")
        local_kv = kv_heads // tp if kv_heads % tp == 0 else (1 if tp % kv_heads == 0 else heads // tp)
        assert calls == [(heads // tp, local_kv)], (tp, calls)
        if tp > 1:
            hlo = fn.lower(*args).compile().as_text()
            assert "all-gather" not in hlo and "all-reduce" not in hlo and "all-to-all" not in hlo, tp
            assert f"f32[2,3,{heads // tp},64]" in hlo, tp  # q and the output: a device's own heads


@pytest.mark.slow  # interpret mode at TP=1, 2, 4
def test_deltanet_kernel_runs_on_each_devices_own_heads(monkeypatch):
    """The GPU path's fused DeltaNet recurrence (interpreted here) inside `shard_map`: each device passes it its own
    value heads (and their key heads' q, k columns), no collective, and TP=1, 2, 4 equal the unsharded kernel bit for
    bit, state and output, with a replay's `count`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import gated_delta as gdk
    from tests.helpers import spy_interpreted
    from tfjax import ops, sharding

    calls = spy_interpreted(monkeypatch, gdk, "recurrent_qkv", lambda a, kw: (a[0].shape[1], kw["key_heads"]))
    rng = np.random.default_rng(13)
    b, t, hk, hv, dk, dv = 2, 3, 4, 8, 16, 32
    state = jnp.asarray(rng.standard_normal((b, hv, dk, dv)) * 0.1, jnp.float32)
    qkv = jnp.asarray(rng.standard_normal((b, t, 2 * hk * dk + hv * dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 1.0, (b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, hv)), jnp.float32)
    count = jnp.asarray([3, 1], jnp.int32)

    def run(state, qkv, g, beta, count, mesh=None):
        with ops.using(ops.PALLAS), ops.using_mesh(mesh):
            return ops.recurrent_qkv(state, qkv, g, beta, count)

    want = jax.jit(run)(state, qkv, g, beta, count)
    assert calls == [(hv, hk)]
    for tp in (1, 2, 4):
        mesh = sharding.make_mesh(tp)
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: B023, E731
        args = (put(state, P(None, "model")), put(qkv, P()), put(g, P()), put(beta, P()), put(count, P()))
        calls.clear()
        fn = jax.jit(lambda *a: run(*a, mesh=mesh))  # noqa: B023
        got = fn(*args)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"{tp=}")
        assert calls == [(hv // tp, hk // tp)], (tp, calls)
        if tp > 1:
            hlo = fn.lower(*args).compile().as_text()
            assert "all-gather" not in hlo and "all-reduce" not in hlo and "all-to-all" not in hlo, tp


@pytest.mark.parametrize("mode", ["prompt", "rows"])  # ~2-4 s each: compiled, never run
def test_deltanet_layer_runs_on_each_devices_own_heads_and_channels(mode):
    """A DeltaNet layer at TP=2 (the CPU reference path): the conv runs on each device's own channels (no all-gather
    of its taps or conv1d weight), the cache comes back with each device holding half the conv tail's channels and
    half the recurrent state's value heads, and the one DeltaNet-sized all-gather is the conv output's channels
    (head-aligned q, k, v need them whole), beside the two row-parallel products' partials."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax import models, sharding
    from tfjax.models.layers import PROMPT, ROWS

    config = _config("tiny_dense").replace(num_hidden_layers=1, layer_types=("linear_attention",))
    mesh = sharding.make_mesh(2)
    m = nnx.eval_shape(lambda: models.build(config))  # abstract: compiled, never run
    sharding.plan(m, mesh)
    graphdef, state = nnx.split(m)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                          sharding.shardings(m, mesh))
    cache = jax.eval_shape(lambda: m.init_cache(1, 64))
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), cache,
                         sharding.cache_specs(cache, mesh))
    c, hv = config.linear_conv_dim, config.linear_num_value_heads
    t = 16 if mode == "prompt" else 4
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, P()))  # noqa: E731
    fwd = jax.jit(lambda params, *a: nnx.merge(graphdef, params)(*a, PROMPT if mode == "prompt" else ROWS))
    args = (params, i32(1, t), i32(1), i32(1), cache)
    compiled = fwd.lower(*args).compile()
    new = jax.eval_shape(fwd, *args)[1].layers[0]
    placed = compiled.output_shardings[1].layers[0]
    conv, state = placed.conv, placed.state
    assert conv.shard_shape(new.conv.shape) == (1, config.linear_conv_kernel_dim - 1, c // 2)
    assert state.shard_shape(new.state.shape)[1] == hv // 2
    gathers = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", compiled.as_text())
    assert f"f32[{c},{config.linear_conv_kernel_dim}]" not in gathers, gathers  # the conv1d weight
    # besides the row-parallel partials [8 parts, ...] and the logits (gathered whole for sampling)
    big = sorted(g for g in gathers if not g.startswith("f32[8,") and not g.endswith(f",{config.vocab_size}]"))
    assert big == [f"f32[1,{t},{c}]"], big


@pytest.mark.slow  # interpret mode at TP=1, 2, 4
def test_deltanet_conv_chunked_and_norm_kernels_run_on_each_devices_own_channels_and_heads(monkeypatch):
    """The GPU path's other DeltaNet kernels (interpreted here) inside `shard_map`: the fused conv on each device's own
    channels (tail, rows and weight split, programs of a channel block fixed by C), the chunked prompt kernel and the
    gated norm on its own value heads; no collective, and TP=2, 4 equal TP=1 bit for bit (the chunked kernel and the
    norm also the unsharded call: one head, one row a program)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import causal_conv as cc
    from pallas_kernels import gated_delta_chunked as gdc
    from pallas_kernels import row_norm as rn
    from tests.helpers import spy_interpreted
    from tfjax import ops, sharding

    convs = spy_interpreted(monkeypatch, cc, "conv_silu_window", lambda a, kw: a[1].shape[-1])
    chunks = spy_interpreted(monkeypatch, gdc, "chunked", lambda a, kw: a[0].shape[1])
    norms = spy_interpreted(monkeypatch, rn, "row_norm", lambda a, kw: a[0].shape[0])
    rng = np.random.default_rng(15)
    b, t, k, c, hv, dk, dv = 2, 3, 4, 128, 8, 16, 16
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    tail, rows, weight, count = normal(b, k - 1, c), normal(b, t, c), normal(c, k) * 0.5, jnp.asarray([3, 1])
    state, q, kk, v, x, z = (normal(b, hv, dk, dv) * 0.1, normal(b, 16, hv, dk) * 0.2, normal(b, 16, hv, dk) * 0.2,
                             normal(b, 16, hv, dv), normal(b, t, hv, dv), normal(b, t, hv, dv))
    g, beta = jnp.asarray(-rng.uniform(0.01, 1, (b, 16, hv)), jnp.float32), jnp.asarray(rng.uniform(0, 1, (b, 16, hv)),
                                                                                        jnp.float32)
    norm_w = normal(dv)

    def run(tail, rows, weight, count, state, q, kk, v, g, beta, x, z, mesh=None):
        with ops.using(dataclasses.replace(ops.PALLAS, delta_chunked=True)), ops.using_mesh(mesh):
            return (*ops.conv_silu_window(tail, rows, weight, count), *ops.chunked(state, q, kk, v, g, beta, chunk=16),
                    ops.row_norm(x, norm_w, z, kind="gated", eps=1e-6, rows=True, heads=2))

    args = (tail, rows, weight, count, state, q, kk, v, g, beta, x, z)
    unsharded = jax.jit(run)(*args)
    specs = (P(None, None, "model"), P(None, None, "model"), P("model"), P(), P(None, "model"),
             *[P(None, None, "model")] * 5, P(None, None, "model"), P(None, None, "model"))
    want = None
    for tp in (1, 2, 4):
        mesh = sharding.make_mesh(tp)
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
        convs.clear(), chunks.clear(), norms.clear()
        fn = jax.jit(lambda *a: run(*a, mesh=mesh))  # noqa: B023
        got = fn(*placed)
        want = got if want is None else want
        for name, x_, y, u in zip(("conv", "tail", "state", "out", "norm"), got, want, unsharded, strict=True):
            np.testing.assert_array_equal(x_, y, err_msg=f"{tp=} {name}")
            if name in ("state", "out", "norm"):
                np.testing.assert_array_equal(x_, u, err_msg=f"{tp=} {name} unsharded")
        # the last call of each is the kernel's own (`heads_per_shard` asks the outputs' shapes at the whole shapes first)
        assert (convs[-1], chunks[-1], norms[-1]) == (c // tp, hv // tp, b * t * hv // tp), (tp, convs, chunks, norms)
        if tp > 1:
            hlo = fn.lower(*placed).compile().as_text()
            assert "all-gather" not in hlo and "all-reduce" not in hlo and "all-to-all" not in hlo, tp


@pytest.mark.slow  # ~10 s a case: interpret mode at TP=1, 2, 4
@pytest.mark.parametrize("rows", [False, True], ids=["prompt", "lane_round"])
def test_moe_kernel_runs_on_each_devices_own_experts(monkeypatch, rows):
    """The GPU path's MoE kernels (interpreted here; prompts: the grouped GEMM, lane rounds: the K-split kernels)
    inside `shard_map` with the expert stacks split by expert: each device's kernel call sees only its own experts,
    and TP=1, 2, 4 equal the unsharded kernel bit for bit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import moe, quant
    from tests.helpers import spy_interpreted
    from tfjax import ops, sharding

    calls = spy_interpreted(monkeypatch, moe, "moe", lambda a, kw: a[3][0].shape[0])
    rng = np.random.default_rng(15)
    n, k, e, d, i, bits, group = 3, 2, 8, 256, 256, 4, 64

    def stack(out, inp):
        w, sc, b = quant.quantize(jnp.asarray(rng.standard_normal((e, out, inp)) * 0.05, jnp.float32), bits, group)
        return w, sc, b

    gate, up, down = stack(i, d), stack(i, d), stack(d, i)
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.random((n, k)) + 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    def run(x, idx, weights, gate, up, down, mesh=None):
        with ops.using(ops.PALLAS), ops.using_mesh(mesh):
            return ops.experts(x, idx, weights, gate, up, down, bits=bits, group_size=group, rows=rows)

    want = jax.jit(run)(x, idx, weights, gate, up, down)
    assert calls == [e]
    for tp in (1, 2, 4):
        mesh = sharding.make_mesh(tp)
        split = lambda t: tuple(jax.device_put(a, NamedSharding(mesh, P("model"))) for a in t)  # noqa: B023, E731
        calls.clear()
        got = jax.jit(lambda *a: run(*a, mesh=mesh))(x, idx, weights, split(gate), split(up), split(down))  # noqa: B023
        np.testing.assert_array_equal(got, want, err_msg=f"{tp=}")
        assert calls == [e // tp], (tp, calls)


def test_norm_kernel_runs_on_each_devices_own_lanes():  # ~7 s (interpret mode)
    """The GPU path's row norm kernel (interpreted here) under a mesh with lanes over `data`: each device normalises
    only its own lanes' rows, bit for bit the unsharded kernel's (gated norm too)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import row_norm as rn
    from tests.helpers import spy_interpreted
    from tfjax import ops, sharding

    rng = np.random.default_rng(14)
    x, z = (jnp.asarray(rng.standard_normal((4, 3, 64)), jnp.float32) for _ in range(2))
    weight = jnp.asarray(rng.standard_normal(64), jnp.float32)

    def norm(x, z, mesh=None):
        with ops.using(ops.PALLAS), ops.using_mesh(mesh), ops.lanes_over_data(True):
            return ops.row_norm(x, weight, kind="rms", eps=1e-6, rows=True), ops.row_norm(
                x, weight, z, kind="gated", eps=1e-6, rows=True)

    with pytest.MonkeyPatch.context() as mp:
        calls = spy_interpreted(mp, rn, "row_norm", lambda a, kw: a[0].shape[0])
        want = jax.jit(norm)(x, z)
        mesh = sharding.make_mesh(2, 2)
        lanes = NamedSharding(mesh, P(sharding.DATA))
        calls.clear()
        got = jax.jit(lambda x, z: norm(x, z, mesh))(jax.device_put(x, lanes), jax.device_put(z, lanes))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert calls == [12, 6, 12, 6], calls  # each norm: `whole` asks the output's shape (all 12 rows), then the
    # kernel runs on a device's own 2 lanes x 3 rows


@pytest.mark.parametrize("lanes,rows,heads", [(2, 1, 3), (4, 3, 16)])
def test_deltanet_gates_are_bit_identical_with_lanes_split_over_data(lanes, rows, heads):
    """DeltaNet's gates (exp, softplus, sigmoid on [B, T, H]) under a mesh take fixed row tiles of each device's own
    lanes: 1 x 2, 2 x 2 and 4 x 2 give 1 x 1's bits (left to XLA's partitioner, a 1 x 2 exp over a device's 3
    elements rounded some values differently from the same exp over 6: the first case, a few of its draws)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax import ops, sharding
    from tfjax.models import qwen3_5

    def on(tp, dp):
        mesh = sharding.make_mesh(tp, dp)
        lane = NamedSharding(mesh, P(sharding.DATA))

        def gates(b_in, a, a_log, dt_bias):
            with ops.using_mesh(mesh), ops.lanes_over_data(True):
                return qwen3_5.gates(b_in, a, a_log, dt_bias)

        fn = jax.jit(gates)
        return lambda b_in, a, *rest: fn(jax.device_put(b_in, lane), jax.device_put(a, lane), *rest)

    meshes = {(tp, dp): on(tp, dp) for tp, dp in ((1, 1), (1, 2), (2, 2), (4, 2))}
    for draw in range(12):  # the same programs, fresh values
        rng = np.random.default_rng(draw)
        b_in, a = (jnp.asarray(rng.standard_normal((lanes, rows, heads)) * 3, jnp.float32) for _ in range(2))
        args = (b_in, a, jnp.asarray(np.log(rng.uniform(1, 16, heads)), jnp.float32),
                jnp.asarray(rng.standard_normal(heads), jnp.float32))
        want = meshes[1, 1](*args)
        for (tp, dp), fn in meshes.items():
            for got, w in zip(fn(*args), want, strict=True):
                np.testing.assert_array_equal(got, w, err_msg=f"{tp} x {dp}, {draw=}")


@pytest.mark.slow  # ~15-25 s on the shared 2-core machine (two compiles of the sampler)
def test_sampling_sees_every_lane_on_every_device_with_lanes_split_over_data():
    """Under a `data` axis XLA's partitioner gave each device its share of the lanes to sample (top-p's sort, softmax
    and cumulative sum over [L / dp, W, V]: shapes that follow dp); `ops.whole` samples [L, W, V] everywhere."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tfjax import ops, sampling, sharding

    rng = np.random.default_rng(0)
    lanes, width, vocab = 4, 3, 512
    logits = jnp.asarray(rng.standard_normal((lanes, width, vocab)) * 3, jnp.float32)
    positions = jnp.asarray(rng.integers(0, 100, (lanes, width)), jnp.int32)
    params = sampling.SamplingParams.create(lanes, temperature=[0.7, 1.0, 1.3, 1.0], top_k=[0, 20, 300, 0],
                                            top_p=[0.5, 0.9, 0.99, 0.95], seed=[1, 2, 3, 4])
    want = jax.jit(sampling.sample)(logits, positions, params)
    mesh = sharding.make_mesh(1, 2)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(sharding.DATA)))  # noqa: E731

    def sample(*args):
        with ops.using_mesh(mesh):
            return ops.whole(sampling.sample, *args)

    args = (put(logits), put(positions), jax.tree.map(put, params))
    fn = jax.jit(sample)
    np.testing.assert_array_equal(fn(*args), want)
    sorts = re.findall(r"= \((f32\[[0-9,]+\])[^=]*\) sort\(", fn.lower(*args).compile().as_text())
    assert sorts == [f"f32[{lanes},{width},{vocab}]"], sorts  # top-p's full sort: every lane, on every device


@pytest.mark.parametrize("make,says", [
    (lambda s, n: s.make_mesh(4, 4), lambda n: f"tp=4 x dp=4 asks for 16 devices but {n} "),
    (lambda s, n: s.make_mesh(3), lambda n: "tp=3 is not a divisor of 8"),
    (lambda s, n: s.make_mesh(0), lambda n: "tp must be a positive integer, got 0"),
    (lambda s, n: s.serving_mesh(2, 2, lanes=3), lambda n: "dp=2 does not divide the 3 lanes"),
    (lambda s, n: s.check(_config("tiny_dense"), 8), lambda n: "tp=8 does not divide the model's num_attention_heads=4"),
    (lambda s, n: s.check(_config("tiny_dense").replace(intermediate_size=102), 4), lambda n: "intermediate_size=102"),
    (lambda s, n: s.check(_config("tiny_moe").replace(moe_intermediate_size=30), 4),
     lambda n: "moe_intermediate_size=30"),
    (lambda s, n: s.check(_config("tiny_dense").replace(num_attention_heads=8, linear_num_value_heads=2), 4),
     lambda n: "linear_num_value_heads=2"),
], ids=["more_devices_than_present", "tp_not_dividing_8", "tp_zero", "dp_not_dividing_lanes", "attention_heads",
        "mlp_width", "moe_width", "deltanet_heads"])
def test_bad_meshes_are_clear_errors(make, says):
    import jax

    from tfjax import sharding

    n = len(jax.devices())
    if n >= 16:
        pytest.skip("16 devices present")
    with pytest.raises(sharding.MeshError) as e:
        make(sharding, n)
    assert says(n) in str(e.value)


def test_a_mesh_that_leaves_a_process_without_devices_is_a_clear_error(monkeypatch):
    """Two processes of 2 devices each: tp=2 x dp=1 would put the whole mesh on process 0 while process 1 runs the
    same rounds over arrays it holds no part of (it failed reading a token); tp=2 x dp=2 reaches both."""
    from types import SimpleNamespace

    import jax

    from tfjax import sharding

    devices = [SimpleNamespace(id=i, process_index=i // 2) for i in range(4)]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(sharding.MeshError, match=r"tp=2 x dp=1 uses devices of 1 of the run's 2 processes.*"
                                                 r"tp x dp = 4 \(2 devices a process\)"):
        sharding.make_mesh(2, 1, devices)
    monkeypatch.setattr(sharding, "Mesh", lambda devs, names: (devs.shape, names))
    assert sharding.make_mesh(2, 2, devices) == ((2, 2), (sharding.DATA, sharding.MODEL))


def test_multi_host_entry_asks_for_both_process_count_and_id():
    from tfjax import sharding

    with pytest.raises(sharding.MeshError, match="both num_processes and process_id"):
        sharding.initialize_distributed("localhost:1234", num_processes=2)
    with pytest.raises(sharding.MeshError, match=r"process_id=2 is not in 0..1"):
        sharding.initialize_distributed("localhost:1234", num_processes=2, process_id=2)


def test_multi_host_entry_hands_jax_the_coordinator_count_and_id(monkeypatch):
    import jax

    from tfjax import sharding

    seen = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw))
    sharding.initialize_distributed("host0:1234", 4, 3)
    sharding.initialize_distributed()  # JAX reads its environment or the cluster's
    assert seen == [dict(coordinator_address="host0:1234", num_processes=4, process_id=3),
                    dict(coordinator_address=None, num_processes=None, process_id=None)]


@pytest.mark.slow  # 7-18 s on the shared 2-core machine (a worker's jax start and distributed join)
def test_a_one_process_cluster_joins_and_fetches_lanes_split_over_data():
    (out,) = _cluster(1, 8, "join")
    assert out == dict(processes=1, devices=8, same=True, whole=True), out


@pytest.mark.slow  # ~15 s
def test_two_processes_see_every_devices_and_fetch_lanes_split_across_them():
    outs = _cluster(2, 2, "join")
    assert outs == [dict(processes=2, devices=4, same=True, whole=False)] * 2, outs


@pytest.mark.slow  # minutes: four engine runs, two of them over two processes
def test_a_run_over_two_processes_gives_the_one_device_tokens():
    """Two processes on this host, 2 CPU devices each, joined by jax.distributed: lanes over `data` across the
    processes (2 x 2) and the `model` axis across them (4 x 1) give the tokens and logprobs of one device, and so does
    a one-process cluster."""
    want = _worker("cluster", "0", "0", "0", "1x1")
    runs = {"1 process 2x2": _cluster(1, 8, "cluster", "2x2"), "2 processes 2x2": _cluster(2, 2, "cluster", "2x2"),
            "2 processes 4x1": _cluster(2, 2, "cluster", "4x1")}
    for name, outs in runs.items():
        for out in outs:
            assert out["processes"] == len(outs), (name, out)
            for key, value in want.items():
                if "/" in key:
                    assert out[key] == value, (name, key)


@pytest.mark.slow  # ~2-4 min: three tiny engines compiled, two of them over two processes
def test_a_server_over_two_processes_answers_with_the_one_device_tokens(tmp_path):
    """`tfjax serve` across two processes (2 CPU devices each, tp=2 x dp=2: lanes across the processes): process 0
    answers concurrent greedy, sampled and stop-string chats over HTTP, more requests than lanes, after a stream whose
    client went away (cancelled); process 1 runs the same engine steps from process 0's broadcasts. The replies hash as one device's, and both ran the same rounds."""
    from tests.helpers import make_tiny_llama_with_tokenizer
    from tfjax import packaged

    folder = str(make_tiny_llama_with_tokenizer(tmp_path / "tiny", packaged.ensure_converted("smollm2")))
    one = _worker("serve", "0", "0", "0", folder, "none")
    assert len({h for h, _ in one["replies"]}) == len(SERVE_BODIES), one
    assert [r[1] for r in one["replies"]].count("stop") >= 1, one  # a stop string ended a lane early
    leader, follower = _cluster(2, 2, "serve", folder, "2x2", timeout=900)
    assert leader["replies"] == one["replies"] and leader["cancels"] == one["cancels"] == 1, (leader, one)
    assert follower["rounds"] == leader["rounds"] and follower["steps"] > 0, (leader, follower)


@pytest.mark.slow
def test_checkpoints_load_straight_into_their_shards_dense_and_4bit(tmp_path):
    out = _worker("checkpoint", str(tmp_path))
    assert out["q4"]["quantized"] and not out["hf"]["quantized"]
    for name in ("hf", "q4"):
        o = out[name]
        assert o["bad"] == [] and o["same_logits"] and o["same_as_tp1"] and len(o["per_device"]) == 1, o


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_moe", "llama"])
def test_logits_are_bit_identical_across_degree_on_moe_and_llama(name):
    hashes = _worker("logits", name)["hashes"]
    assert hashes["2"] == hashes["1"] and hashes["4"] == hashes["1"], hashes


@pytest.mark.slow  # ~15 min on a loaded 2-core machine
def test_drafted_equals_plain_at_every_degree_with_a_draft_model_and_dflash2():
    out = _worker("drafters", "tiny_dense")
    for kind in ("model", "dflash2"):
        for mode in ("greedy", "sampled"):
            want = out[f"1x1/{kind}/{mode}/plain"]
            for mesh in ("1x1", "2x1", "4x1", "2x2"):
                assert out[f"{mesh}/{kind}/{mode}/drafted"] == want, (mesh, kind, mode)
                assert out[f"{mesh}/{kind}/{mode}/proposed"] > 0, (mesh, kind, mode)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe", "llama"])
def test_token_sha256_is_the_same_at_every_degree_drafted_and_plain(name):
    out = _worker("tokens", name)
    for mode in ("greedy", "sampled", "processors", "resumed", "logprobs"):
        want = out[f"1x1/{mode}/drafted"]
        for key, got in out.items():  # logprobs too: bit for bit at every degree, 2 x 2 included
            if f"/{mode}/" in key:
                assert got == want, (key, got, want)
    assert all(n > 0 for n in out["1x1/cached"]), out  # turn 2 did resume from the cache


if __name__ == "__main__":
    case, *rest = sys.argv[1:]
    print(json.dumps(globals()[f"case_{case}"](*rest)))


@pytest.mark.slow  # two tiny engines compiled, one of them over 4 simulated devices
def test_the_server_over_a_mesh_answers_with_the_one_device_tokens(tmp_path):
    """`tfjax serve --tp 2 --dp 2`: through HTTP, concurrent greedy and sampled replies hash as on one device."""
    import asyncio

    from tests.helpers import make_tiny_llama_with_tokenizer
    from tests.server_helpers import in_process
    from tfjax import api, packaged
    from tfjax.server import create_app

    folder = make_tiny_llama_with_tokenizer(tmp_path / "tiny", packaged.ensure_converted("smollm2"))
    bodies = [{"messages": [{"role": "user", "content": f"Count to {n}"}], "max_tokens": 12, "temperature": t,
               "seed": 3, "ignore_eos": True} for n, t in ((5, 0.0), (9, 0.8), (7, 0.0))]

    async def hashes(llm):
        async with in_process(create_app(llm, name="tiny", max_tokens=16)) as client:
            replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["token_sha256"] for r in replies]

    one = asyncio.run(hashes(api.load(folder, lanes=4, width=4, context=256)))
    mesh = asyncio.run(hashes(api.load(folder, lanes=4, width=4, context=256, tp=2, dp=2)))
    assert mesh == one and len(set(one)) == 3
