"""Issue 34: which of a DFlash2 engine's target computations differ bitwise from the plain engine's.

  PYTHONPATH=. python3 scripts/probes/exact34.py --model /root/sm --drafter RUN/drafter --prompts RUN/prompts.jsonl.gz

Two engines of one target as `bench_generate` builds them: `copies` (the plain baseline, `draft: false`) and
`dflash2` (a block drafter, copies off). For each held-out prompt (or random ids):
1. prefill: the prompt through plain's production prefill (`round.prefill_chunk`, a bucket of pages), the same
   over the whole page table, and the dflash2 engine's production prefill (plain's `round.prefill_chunk` itself,
   then `blocks.absorb_chunk` apart); logits and every layer's prompt K/V compared bit for bit with the first;
2. rounds: `--tokens` tokens by plain (`copies`, draft off), then by `dflash2` draft off, drafting ORACLE blocks
   (the plain run's own next tokens: every round accepts the whole block) and HALF blocks (those, then wrong ones
   from a point that varies: partial acceptance); again with the dflash2 engine's target prefill swapped for plain's
   program, so only the rounds differ. Each run's tokens and every layer's committed K/V compared with plain's.
A folder without model.safetensors gets random 4-bit weights of its geometry (both engines the same ones); a
drafter folder without weights gets a random drafter of its config (its own proposals do not matter here).
Prints one line per check: `same` or the first layer and position whose K/V differ.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tfjax import api, models
from tfjax.config import ModelConfig, QuantConfig
from tfjax.drafters import dflash2, dflash2_checkpoint
from tfjax.lanes import round as lane_round_mod

ORACLE = {"next": {}, "mode": "oracle"}  # read at run time by the drafter's proposals (a host callback)


def _oracle_host(start: np.ndarray, pending: np.ndarray, b: int) -> np.ndarray:
    """Proposals [N, b] for lanes at `start` with `pending` [N]: the plain run's own next tokens there (`oracle`), or
    those then wrong ones from a point that varies with the round (`half`); zeros where the plain runs never were."""
    out = np.zeros((len(start), b), np.int32)
    for i, (s, p) in enumerate(zip(np.asarray(start).tolist(), np.asarray(pending).tolist(), strict=True)):
        good = ORACLE["next"].get((s, p))
        if good is None:
            continue
        keep = b if ORACLE["mode"] == "oracle" else (s * 5 + 1) % (b + 1)  # 0..b right
        out[i] = np.where(np.arange(b) < keep, good[:b], good[:b] + 1)
    return out


def set_oracle(prompts: list[list[int]], replies: list[list[int]], b: int = 64) -> None:
    """The plain runs' next tokens after each (position, token) of their histories (a lane is known by both)."""
    ORACLE["next"] = {}
    for ids, out in zip(prompts, replies, strict=True):
        h = np.asarray(ids + out + [0] * b, np.int32)
        for pos in range(len(ids) - 1, len(ids) + len(out)):
            ORACLE["next"][(pos, int(h[pos]))] = h[pos + 1 : pos + 1 + b]


def _oracle_propose(self, target, pending, start, cache):
    b = self.config.block_size - 1
    return jax.pure_callback(lambda s, p: _oracle_host(s, p, b),
                             jax.ShapeDtypeStruct((pending.shape[0], b), jnp.int32), start, pending)


dflash2.DFlashDrafter.propose = _oracle_propose


def target(path: str):
    """(module, config): the folder's weights, else random MLX 4-bit weights of its geometry (seed 0)."""
    if (Path(path) / "model.safetensors").exists():
        return None
    config = ModelConfig.from_json(Path(path)).replace(quantization=QuantConfig(bits=4, group_size=64))
    graphdef, params = models.random_params(config)
    from flax import nnx

    return nnx.merge(graphdef, params), config


def drafter_folder(path: str) -> str:
    if (Path(path) / "model.safetensors").exists():
        return path
    cfg = dflash2.DFlashConfig.from_dict(json.loads((Path(path) / "config.json").read_text()))
    out = Path(tempfile.mkdtemp()) / "drafter"
    dflash2_checkpoint.save(dflash2.build(cfg, seed=3), out)
    return str(out)


def kv_of(llm, lane: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every attention layer's (K, V) [n, G, E] of `lane`'s first n positions, as raw bits."""
    st = llm.engine.runner.state
    row = np.asarray(st.cache.page_table[lane])
    out = []
    for layer in st.cache.layers:
        if not hasattr(layer, "k"):
            continue
        k, v = (np.asarray(a[row]).reshape(-1, *a.shape[2:])[:n] for a in (layer.k, layer.v))
        out.append((k.view(np.uint16) if k.dtype.itemsize == 2 else k.view(np.uint32),
                    v.view(np.uint16) if v.dtype.itemsize == 2 else v.view(np.uint32)))
    return out


def compare(name: str, ref, got, n_prompt: int) -> str:
    for i, ((rk, rv), (gk, gv)) in enumerate(zip(ref, got, strict=True)):
        bad = np.nonzero(np.any((rk != gk).reshape(len(rk), -1) | (rv != gv).reshape(len(rv), -1), axis=1))[0]
        if len(bad):
            where = "prompt" if bad[0] < n_prompt else "output"
            return f"{name} differ first at layer {i}, position {bad[0]} ({where}; {len(bad)} positions)"
    return f"{name} same ({len(ref[0][0])} positions, {len(ref)} layers)"


def _fresh(r, lane: int = 0):
    """The runner reset, `lane`'s page-table rows the identity; the lane's page row."""
    r.reset()
    row = jnp.arange(r.lanes.pages_per_lane, dtype=jnp.int32)
    st = r.state
    st.cache.page_table = st.cache.page_table.at[lane].set(row)
    if st.draft_cache is not None:
        st.draft_cache.page_table = st.draft_cache.page_table.at[lane].set(row)
    return row


def prefill_check(plain, dfl, ids: list[int]) -> None:
    """The prompt's prefill into lane 0 from empty caches, three ways: plain's production program (a bucket of
    pages), the same over the whole page table, and the dflash2 engine's production path (plain's program, then the
    drafter's absorb apart). Logits and K/V against the first."""
    arr, n = np.asarray(ids, np.int32), len(ids)
    rp, rd = plain.engine.runner, dfl.engine.runner
    runs = {}
    _fresh(rp)
    logits, rp.state.cache = rp._prefill_model(0, rp.target_def, rp.target_params, rp.state.cache, 0, arr, 0, None, {})
    runs["plain"] = (logits, kv_of(plain, 0, n))
    _fresh(rp)
    cache = rp.state.cache
    for tokens, s, c, _ in rp._chunks(arr, 0):
        logits, cache, _ = lane_round_mod.prefill_chunk(rp.target_def, rp.target_params, cache, jnp.int32(0), tokens,
                                                     jnp.int32(s), jnp.int32(c), pages=None)
    rp.state.cache = cache
    runs["plain, whole page table"] = (logits, kv_of(plain, 0, n))
    _fresh(rd)
    logits = rd._prefill_with_taps(0, arr, 0, None, {})
    runs["dflash2 production"] = (logits, kv_of(dfl, 0, n))
    rp.reset()
    rd.reset()
    ref_logits, ref_kv = runs["plain"]
    ref_logits = np.asarray(ref_logits, np.float32)
    for name, (lg, kv) in list(runs.items())[1:]:
        lg = np.asarray(lg, np.float32)
        same = np.array_equal(lg, ref_logits)
        print(f"  prefill, {name}: logits {'same' if same else f'differ (max |d| {np.abs(lg - ref_logits).max():.3g})'}"
              f"; " + compare("K/V", ref_kv, kv, n))


def pin_prefill(llm) -> None:
    """Make the dflash2 engine's target prefill plain's program: the drafter's context from its own prefill, then
    the target's K/V and logits from `round.prefill_chunk` over the same chunks (what plain writes)."""
    r = llm.engine.runner
    taps = r._prefill_with_taps

    def pinned(lane, prompt, resume, restore, saves):
        taps(lane, prompt, resume, restore, saves)
        logits, r.state.cache = r._prefill_model(0, r.target_def, r.target_params, r.state.cache, lane, prompt,
                                                 resume, restore, saves)
        return logits

    r._prefill_with_taps = pinned


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return "tokens same" if i is None and len(a) == len(b) else f"tokens differ first at {i}: {a[i]} vs {b[i]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True, help="a DFlash2 folder (config.json; random weights if none)")
    ap.add_argument("--prompts", default=None, help="a corpus prompt set: its held-out prompts (else random ids)")
    ap.add_argument("--cells", default="code edit,chat")
    ap.add_argument("--per-cell", type=int, default=2)
    ap.add_argument("--streams", type=int, default=1, help="prompts at once (lanes)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--no-prefill-check", action="store_true")
    args = ap.parse_args()
    kw = dict(lanes=args.streams, width=8, context=args.context, prefix_cache_gb=0.0)
    plain = api.load(args.model, copy_match=5, model=target(args.model), **kw)
    folder = drafter_folder(args.drafter)
    dfl = api.load(args.model, drafter=folder, copies=False, model=target(args.model), **kw)
    pinned = api.load(args.model, drafter=folder, copies=False, model=target(args.model), **kw)
    pin_prefill(pinned)
    print(f"{args.model} on {jax.devices()[0].device_kind}, jax {jax.__version__}, {plain.model.kernels}, "
          f"{args.streams} at once")
    if args.prompts:
        from scripts.bench_generate import held_out_cells

        cells = [(c, g) for c, g in held_out_cells(args.prompts, args.per_cell, args.streams)
                 if c in args.cells.split(",")]
        groups = [[(f"{c} #{i * args.streams + j}", plain.encode(p)) for j, p in enumerate(g)]
                  for c, gs in cells for i, g in enumerate(gs)]
    else:
        rng = np.random.default_rng(0)
        ids = [rng.integers(0, plain.config.vocab_size, 40 + 37 * i).tolist() for i in range(args.per_cell)]
        groups = [[(f"random #{i + j}", ids[i + j]) for j in range(args.streams)]
                  for i in range(0, len(ids) - args.streams + 1, args.streams)]
    for group in groups:
        prompts = [ids for _, ids in group]
        for name, ids in group:
            print(f"{name} ({len(ids)} prompt tokens)", flush=True)
            if not args.no_prefill_check:
                prefill_check(plain, dfl, ids)
        ORACLE["next"] = {}
        base = plain.generate_many(prompts, max_tokens=args.tokens, draft=False, ignore_eos=True)
        ns = [len(ids) + len(r.token_ids) - 1 for ids, r in zip(prompts, base, strict=True)]  # the last is pending
        refs = [kv_of(plain, lane, n) for lane, n in enumerate(ns)]
        set_oracle(prompts, [r.token_ids for r in base])
        for label, llm in (("dflash2", dfl), ("dflash2, plain's prefill", pinned)):
            for mode, draft in (("draft off", False), ("oracle", True), ("half", True)):
                ORACLE["mode"] = mode
                got = llm.generate_many(prompts, max_tokens=args.tokens, draft=draft, ignore_eos=True)
                for lane, ((name, ids), b, g) in enumerate(zip(group, base, got, strict=True)):
                    print(f"  {name}, {label}, {mode}: {first_difference(b.token_ids, g.token_ids)}, "
                          f"{g.tokens_per_round:.2f} tokens a round; "
                          + compare("K/V", refs[lane], kv_of(llm, lane, ns[lane]), len(ids)), flush=True)


if __name__ == "__main__":
    main()
