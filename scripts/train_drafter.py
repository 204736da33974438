"""Distill a DFlash2 drafter for a target on the target's own generations of real prompts; resumable, exported by
held-out acceptance.

  PYTHONPATH=. python3 scripts/train_drafter.py --model smollm2 --out runs/smollm2-dflash2 --time-budget 520

Prompts (`tfjax/drafters/corpus.py`): code, edit, chat and text prompts cut from this install's standard library
and site-packages, the files held out by a hash of their relative path (never trained on). Writes, in OUT:
  prompts.jsonl.gz  the prompt set (a rerun, or `--prompts-file`, reuses it);
  data.npz          the target's continuations (greedy, and sampled for `--sampled` of the training prompts),
                    generated once through the serving setup, `draft: false`;
  ckpt/             orbax, every --save-every steps (or `--ckpt DIR`); a rerun resumes from the latest;
  drafter/          config.json + model.safetensors (bf16, the published DFlash2 layout) of the best drafter so far
                    by held-out acceptance: tokens a round of its blocks alone in the real lane round, greedy, on
                    held-out prompts; loadable with `tfjax.load(model, drafter=OUT/drafter)`;
  log.jsonl         one line an evaluation (step, seconds, held-out loss, acceptance by kind).
`--time-budget` bounds the whole run: generation stops admitting prompts at `--gen-share` of it, training stops
early enough for the last evaluation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from tfjax import api, checkpoint, compile_cache, models, ops
from tfjax.drafters import corpus, dflash2, dflash2_checkpoint, train
from tfjax.models.layers import serving_layout
from tfjax.tokenizer import Tokenizer

EVAL_KINDS = ("code", "edit", "chat")  # the bench cells: code new, code edit, chat


def serving(module):
    """`module` set up as `tfjax.load` serves it: the GPU's kernels and layout, else the references."""
    module.kernels = ops.Kernels.default()
    if module.kernels.pallas:
        serving_layout(module)
    return module


def prompt_set(args, out: Path, tok: Tokenizer) -> tuple[list[corpus.Prompt], list[list[int]]]:
    """The prompts (built once from this install's sources, kept in OUT) and their token ids, over-long ones out."""
    path = Path(args.prompts_file) if args.prompts_file else out / "prompts.jsonl.gz"
    if path.exists():
        prompts = corpus.load(path)
    else:
        t = time.perf_counter()
        prompts = corpus.build(prompts=args.prompts, held=args.held, per_file=args.per_file, seed=args.seed)
        corpus.save(prompts, path)
        print(f"built {len(prompts)} prompts in {time.perf_counter() - t:.0f} s -> {path}")
    ids = [p.ids(tok) for p in prompts]
    keep = [i for i, x in enumerate(ids) if 0 < len(x) <= args.max_prompt_tokens]
    prompts, ids = [prompts[i] for i in keep], [ids[i] for i in keep]
    print(corpus.summary(prompts))
    if not any(p.held for p in prompts) or all(p.held for p in prompts):
        raise SystemExit(f"{len(prompts)} prompts, all held out or none: raise --prompts or change --held")
    return prompts, ids


def build_data(args, out: Path, target, prompts, ids, eos, deadline: float) -> dict[str, np.ndarray]:
    """The target's continuations, in OUT/data.npz: every prompt greedy, `--sampled` of the training ones sampled
    too; held-out prompts first so a deadline never leaves the held-out set empty."""
    path = out / "data.npz"
    if path.exists():
        return dict(np.load(path))
    rng = np.random.default_rng(args.seed)
    held = [i for i, p in enumerate(prompts) if p.held]
    trained = rng.permutation([i for i, p in enumerate(prompts) if not p.held]).tolist()
    sampled = trained[: int(args.sampled * len(trained))]
    which = held + trained + sampled
    temps = [0.0] * (len(held) + len(trained)) + [args.temperature] * len(sampled)
    t = time.perf_counter()
    outs = train.generate(target, [ids[i] for i in which], args.max_tokens, lanes=args.lanes, temperatures=temps,
                          seed=args.seed * 1000, eos_ids=eos, deadline=deadline)
    done = [k for k, o in enumerate(outs) if o is not None]
    new = sum(len(outs[k]) for k in done)
    print(f"generated {len(done)}/{len(which)} continuations, {new} tokens in {time.perf_counter() - t:.0f} s "
          f"({new / (time.perf_counter() - t):.0f} tok/s, {args.lanes} lanes)")
    data = train.pack([ids[which[k]] for k in done], [outs[k] for k in done], args.max_prompt_tokens + args.max_tokens)
    data["prompt"] = np.array([which[k] for k in done], np.int32)
    data["held"] = np.array([prompts[which[k]].held for k in done])
    data["temperature"] = np.array([temps[k] for k in done], np.float32)
    np.savez(path, **data)
    return data


def eval_prompts(prompts, ids, per_kind: int, seed: int) -> dict[str, list[list[int]]]:
    """`per_kind` held-out prompts of each evaluated kind, fixed by `seed`."""
    rng = np.random.default_rng(seed + 1)
    out = {}
    for kind in EVAL_KINDS:
        pool = [i for i, p in enumerate(prompts) if p.held and p.kind == kind]
        out[kind] = [ids[i] for i in sorted(rng.permutation(pool)[:per_kind].tolist())]
    return {k: v for k, v in out.items() if v}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default=None, help="orbax folder (default OUT/ckpt)")
    ap.add_argument("--prompts-file", default=None, help="a corpus .jsonl.gz (default: OUT/prompts.jsonl.gz, built)")
    ap.add_argument("--prompts", type=int, default=4000, help="prompts to build, training and held out")
    ap.add_argument("--held", type=float, default=0.1, help="fraction of source files held out")
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--sampled", type=float, default=0.25, help="fraction of training prompts answered sampled too")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lanes", type=int, default=128, help="lanes generating the data")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--gen-share", type=float, default=0.35, help="share of --time-budget generation may take")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--taps", type=int, default=5)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", default="bfloat16", help="the drafter's compute dtype (masters stay float32)")
    ap.add_argument("--target-dtype", default=None, help="the target's dtype (default: the checkpoint's)")
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--eval-every", type=float, default=60, help="seconds of training between evaluations")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts of each kind for acceptance")
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.monotonic()
    compile_cache.enable()
    budget = args.time_budget or float("inf")

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = api.resolve(args.model)
    tok = Tokenizer.from_dir(path)
    served, tcfg = checkpoint.load(path, dtype=args.target_dtype, progress=False)
    served = serving(served)  # generation and acceptance run the target as it is served
    eos = tuple(tok.eos_ids) or tcfg.eos_token_id
    prompts, ids = prompt_set(args, out, tok)
    data = build_data(args, out, served, prompts, ids, eos, t0 + args.gen_share * budget)

    target, _ = checkpoint.load(path, dtype=args.target_dtype, progress=False)
    target.kernels = ops.REFERENCE  # gradients flow through the target's embedding and lm_head: jnp ops only
    tdef, tparams = models.split(target)
    added = tok.backend.get_added_tokens_decoder()
    mask = max(added) if added else tcfg.vocab_size - 1  # a special token plain text never holds
    cfg = train.config_for(tcfg, layers=args.layers, block=args.block, taps=args.taps, mask_token_id=mask,
                           rank=args.rank, top_k=args.top_k, intermediate=args.intermediate, dtype=args.dtype)
    drafter = dflash2.build(cfg, seed=args.seed).bind(tcfg)
    drafter.kernels = ops.REFERENCE  # trained through jnp ops (its kernels have no gradients)
    ddef, params = nnx.split(drafter)
    params = train.cast(params, jnp.float32)  # float32 masters; steps compute in cfg.dtype
    compute = jnp.dtype(args.dtype)
    opt = train.unit_optimizer()
    opt_state = opt.init(params)
    mngr = ocp.CheckpointManager(Path(args.ckpt or out / "ckpt").resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=1))
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt": opt_state}))
        params, opt_state = restored["params"], restored["opt"]
        print(f"resumed at step {start}")
    step = train.make_step(opt, args.anchors, args.gamma, compute)
    held = np.flatnonzero(data["held"])
    trained = np.flatnonzero(~data["held"])
    tokens = {k: jnp.asarray(data[k]) for k in ("tokens", "lengths", "starts")}  # all on the device, a few MB

    def rows(idx):
        return {k: v[jnp.asarray(idx)] for k, v in tokens.items()}

    evalb = rows(held[: args.batch])
    cases = eval_prompts(prompts, ids, args.eval_prompts, args.seed)
    context = -(-(args.max_prompt_tokens + args.eval_tokens + args.block + 2) // 16) * 16  # one compiled round
    print(f"{len(trained)} training sequences, {len(held)} held out; {int(data['lengths'].sum())} tokens; "
          f"acceptance on {sum(map(len, cases.values()))} held-out prompts ({', '.join(cases)})")
    log = (out / "log.jsonl").open("a")
    best = {"score": -1.0}

    def evaluate(i: int) -> None:
        t = time.perf_counter()
        loss, stats = train.evaluate(ddef, params, tdef, tparams, evalb, args.anchors, args.gamma,
                                     compute_dtype=compute)
        candidate = serving(nnx.merge(ddef, jax.tree.map(jnp.copy, train.cast(params, compute))))
        acc = {k: train.acceptance(served, candidate, v, args.eval_tokens, lanes=args.eval_prompts, eos_ids=eos,
                                   context=context)[0] for k, v in cases.items()}
        score = float(np.mean(list(acc.values())))
        row = {"step": i, "seconds": round(time.monotonic() - t0, 1), "held_loss": round(float(loss), 4),
               **{f"held_{k}": round(float(v), 4) for k, v in stats.items()},
               **{f"tokens_a_round_{k}": round(v, 3) for k, v in acc.items()}, "eval_s": round(time.perf_counter() - t, 1)}
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(row, flush=True)
        best["eval_s"] = time.perf_counter() - t  # the next evaluation's cost, kept back from the budget
        if score > best["score"]:
            best.update(score=score, step=i, row=row)
            dflash2_checkpoint.save(nnx.merge(ddef, train.cast(params, compute)), out / "drafter", dtype="bfloat16")

    i, last = start, None
    rng = np.random.default_rng(args.seed * 100_003 + start)
    evaluate(i)  # the untrained drafter's numbers, and the compile of the drafted round
    last, t_train, t_eval = i, time.monotonic(), time.monotonic()
    stop = t0 + budget - 5  # the whole run's end; training leaves room for one more evaluation
    while i < args.steps and time.monotonic() < stop - 1.5 * best["eval_s"]:
        progress = max((i + 1) / args.steps, (time.monotonic() - t_train) / max(stop - 1.5 * best["eval_s"] - t_train, 1))
        batch = rows(np.sort(rng.choice(trained, args.batch, replace=False)))
        params, opt_state, loss, stats = step(ddef, params, opt_state, tdef, tparams, batch, jax.random.key(i),
                                              train.learning_rate(progress, args.lr))
        i += 1
        if i % 50 == 0:
            print(f"step {i} loss {float(loss):.3f} " + " ".join(f"{k} {float(v):.3f}" for k, v in stats.items())
                  + f" ({(time.monotonic() - t_train) / (i - start):.3f} s a step, progress {progress:.2f})", flush=True)
        if i % args.save_every == 0:
            mngr.save(i, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
        if time.monotonic() - t_eval >= args.eval_every:
            evaluate(i)
            last, t_eval = i, time.monotonic()
    if i == start < args.steps:  # (a resumed run already at --steps has nothing left to train)
        raise SystemExit(f"no training step fit in --time-budget {budget:.0f} s: the data and the first evaluation took "
                         f"{time.monotonic() - t0:.0f} s (its compiles {best['eval_s']:.0f} s). Raise --time-budget; "
                         f"{out / 'data.npz'} is kept, so a rerun with the same --out trains at once.")
    if last != i:
        evaluate(i)
    if mngr.latest_step() != i:
        mngr.save(i, args=ocp.args.StandardSave({"params": params, "opt": opt_state}), force=True)
    mngr.wait_until_finished()
    print(f"best held-out acceptance at step {best['step']}: {best['row']}")
    print(f"drafter: {out / 'drafter'} ({time.monotonic() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
