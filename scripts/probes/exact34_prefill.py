"""Issue 34: the dflash2 engine's prompt chunk (target, taps and the drafter's absorb in one program) against plain's,
beside candidate fixes; prefill only, bit for bit.

  PYTHONPATH=. python3 scripts/probes/exact34_prefill.py --model /root/sm --drafter RUN/drafter --prompts RUN/prompts.jsonl.gz

Per held-out prompt, into lane 0 from empty caches: plain's production prefill (the reference), then
  production   the dflash2 engine's prompt path (`runner._prefill_with_taps`)
  barrier      the old single program (target, taps and absorb) with an optimization barrier before the absorb
  taps alone   the target with taps as outputs, no drafter in the program
each with `same` or where its logits and K/V differ. Run it under several XLA_FLAGS (autotuning) to tell
autotuning from fusion. H100, 2026-12-06: the single program was a row or two off a few layers in on 3 of 4 held-out
chats, with or without the barrier and under --xla_allow_excess_precision=false; `taps alone` was same on all: the
production path is now that program plus a separate absorb (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import numpy as np

from scripts.probes import exact34
from tfjax import api, models
from tfjax.lanes import blocks
from tfjax.models.decoder import Cache, lane_cache, put_lane, reset_if_first
from tfjax.models.layers import PROMPT


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "pages"), donate_argnames=("cache", "draft_cache"))
def barrier_chunk(target_def, target_params, drafter_def, drafter_params, cache, draft_cache, lane, tokens, start,
                  valid, pages=None):
    drafter = models.merge(drafter_def, drafter_params)
    sub = lane_cache(cache, lane)
    if pages is not None:
        sub = dataclasses.replace(sub, page_table=sub.page_table[:, :pages])
    sub = dataclasses.replace(sub, layers=[reset_if_first(layer, start) for layer in sub.layers])
    mode = dataclasses.replace(PROMPT, taps=drafter.config.target_layer_ids)
    logits, sub, _, taps = models.merge(target_def, target_params)(tokens, start[None], valid[None], sub, mode)
    logits, sub, taps = jax.lax.optimization_barrier((logits, sub, taps))
    drafted = drafter.absorb(taps, start[None], valid[None], blocks._lane_view(draft_cache, lane))
    return logits, put_lane(cache, sub, lane), Cache(drafted.layers, draft_cache.page_table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--cells", default="chat,code edit")
    ap.add_argument("--per-cell", type=int, default=4)
    args = ap.parse_args()
    kw = dict(lanes=1, width=8, context=1024, prefix_cache_gb=0.0)
    plain = api.load(args.model, copy_match=5, model=exact34.target(args.model), **kw)
    dfl = api.load(args.model, drafter=exact34.drafter_folder(args.drafter), copies=False,
                   model=exact34.target(args.model), **kw)
    rp, rd = plain.engine.runner, dfl.engine.runner
    from scripts.bench_generate import held_out_cells

    for cell, groups in held_out_cells(args.prompts, args.per_cell, 1):
        if cell not in args.cells.split(","):
            continue
        for i, (prompt,) in enumerate(groups):
            ids = plain.encode(prompt)
            arr, n = np.asarray(ids, np.int32), len(ids)
            exact34._fresh(rp)
            ref, rp.state.cache = rp._prefill_model(0, rp.target_def, rp.target_params, rp.state.cache, 0, arr, 0,
                                                    None, {})
            ref, ref_kv = np.asarray(ref, np.float32), exact34.kv_of(plain, 0, n)
            runs = {}
            exact34._fresh(rd)
            runs["production"] = (rd._prefill_with_taps(0, arr, 0, None, {}), exact34.kv_of(dfl, 0, n))
            exact34._fresh(rd)
            st, logits = rd.state, None
            for tokens, s, c, pages in rd._chunks(arr, 0):
                logits, st.cache, st.draft_cache = barrier_chunk(
                    rd.target_def, rd.target_params, rd.drafter_def, rd.drafter_params, st.cache, st.draft_cache,
                    jax.numpy.int32(0), tokens, jax.numpy.int32(s), jax.numpy.int32(c), pages=pages)
            runs["barrier"] = (logits, exact34.kv_of(dfl, 0, n))
            exact34._fresh(rp)
            runs["taps alone"] = (exact34._tapped_prefill(rp, arr, rd._models[1].config.target_layer_ids),
                                  exact34.kv_of(plain, 0, n))
            rp.reset()
            rd.reset()
            for name, (lg, kv) in runs.items():
                lg = np.asarray(lg, np.float32)
                same = "same" if np.array_equal(lg, ref) else f"differ (max |d| {np.abs(lg - ref).max():.3g})"
                print(f"{cell} #{i} ({n} tokens), {name}: logits {same}; {exact34.compare('K/V', ref_kv, kv, n)}",
                      flush=True)


if __name__ == "__main__":
    main()
