"""Per-stream decode speed of plain, copies-only and drafted decoding on a packaged model, with hash equality.

  PYTHONPATH=. python3 scripts/bench_generate.py --model smollm2 --tokens 96
  PYTHONPATH=. python3 scripts/bench_generate.py --model smollm2 --drafter runs/smollm2-dflash2/drafter
  PYTHONPATH=. python3 scripts/bench_generate.py --model FOLDER --random-weights 4   # plain speed only

`--random-weights BITS` times the folder's geometry (config.json, tokenizer) with random MLX weights
(0 = the config's dtype), for a model too large to ship: plain rows only, since what copies and drafts
accept depends on real weights (`--exact` adds them anyway: their hashes still check exactness on the GPU).

Every row's `token_sha256` is compared with the plain row of its cell (`draft: false`).

`--prompts FILE` (a `tfjax/drafters/corpus.py` prompt set, e.g. a drafter run's OUT/prompts.jsonl.gz) replaces
the built-in prompts with `--per-cell` HELD-OUT prompts of each cell (code edit: edit prompts, code new: code
prompts, chat: chat prompts), which a drafter trained on that set never saw; a row sums their tokens, time and
rounds, and counts equal hashes. `--streams N` runs N of a cell's prompts at once (N lanes; tok/s is the sum of
the N streams, tok/round their mean), `--per-cell` rounded up to a multiple of N. Without `--prompts`, `--streams N`
runs N variants of each built-in prompt at once (a first line naming the stream), so a model with random weights
gives per-stream speed at N streams beside one (issue 32's 4- and 16-stream goals).

Two speeds a row: `tok/s`, every token of the cell over the wall time of its groups (prompts included, so the
slowest stream of a group sets it), and `decode tok/s`, each stream's tokens after its first over the time since
its first arrived (what a streaming client sees, as bench_concurrent.py measures over HTTP), the median stream.
`x plain` is of decode tok/s, `x plain (wall)` of tok/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from flax import nnx

from tfjax import api, models
from tfjax.config import ModelConfig, QuantConfig

CODE = ("Original:\ndef add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n\nThe same function with `total` renamed to `acc`:\ndef add_all(values):\n    acc = 0\n")
CODE_NEW = "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
CHAT = [{"role": "user", "content": "Write three short tips for learning to cook."}]
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.95, seed=3)


def warm(llm, groups: list[list], params: dict) -> None:
    """Compile, untimed, every shape the timed groups take: each group once (8 tokens), so each prompt's prefill
    chunk and page buckets and the round's lane bucket are compiled before any clock starts. The prefix cache is off
    meanwhile, so the timed groups find it as they would have (a fresh prefill runs the chunks a resumed one does).
    Every lane bucket's round is compiled once per engine before this (`precompile` in `main`)."""
    prefix = llm.engine.prefix
    enabled, prefix.enabled = prefix.enabled, False
    try:
        for group in groups:
            llm.generate_many(group, max_tokens=8, draft=True, ignore_eos=True, **params)
    finally:
        prefix.enabled = enabled


def timed_groups(llm, groups: list[list], tokens: int, draft: bool, params: dict):
    """(tok/s summed over each group's streams, the median stream's decode tok/s, tokens a round, replies): the
    groups one after another, each group's prompts at once (every shape compiled first by `warm`), from an empty
    prefix cache: a mode never resumes the prompts an earlier mode left cached (a resumed prefill takes other
    shapes than the warm-up compiled)."""
    llm.engine.prefix.clear()
    spent, outs = 0.0, []
    for group in groups:
        t = time.perf_counter()
        got = llm.generate_many(group, max_tokens=tokens, draft=draft, ignore_eos=True, **params)
        spent += time.perf_counter() - t
        for out in got:
            if out.finish_reason == "error":
                raise SystemExit(f"reply failed (draft={draft}): {out.error}")
        outs += got
    made = sum(len(o.token_ids) for o in outs)
    decode = statistics.median(o.decode_tok_s or 0.0 for o in outs)
    return made / spent, decode, sum(o.tokens_per_round for o in outs) / len(outs), outs


def held_out_cells(path: str, per_cell: int, streams: int) -> list[tuple[str, list[list]]]:
    """(cell, groups of `streams` prompts) from a corpus prompt set's held-out prompts, a fixed pick per cell."""
    from tfjax.drafters import corpus

    prompts = corpus.load(path)
    per_cell = -(-per_cell // streams) * streams
    out = []
    for cell, kind in (("code edit", "edit"), ("code new", "code"), ("chat", "chat")):
        pool = sorted((p for p in prompts if p.held and p.kind == kind), key=lambda p: (p.source, p.text))
        step = max(1, len(pool) // per_cell)
        pick = [[{"role": "user", "content": p.text}] if p.chat else p.text for p in pool[::step][:per_cell]]
        if len(pick) >= streams:
            out.append((cell, [pick[i : i + streams] for i in range(0, len(pick) - streams + 1, streams)]))
    return out


def stream_variants(prompt, n: int) -> list:
    """n prompts that differ from `prompt` by a first line naming the stream (a chat prompt: its first message)."""
    def variant(i: int):
        if isinstance(prompt, str):
            return f"# stream {i}\n{prompt}"
        return [dict(prompt[0], content=f"(stream {i}) {prompt[0]['content']}"), *prompt[1:]]
    return [variant(i) for i in range(n)]


def random_model(path: str, bits: int):
    """(module, config) of the folder's geometry with random weights, MLX `bits`-bit (group 64) unless 0."""
    config = ModelConfig.from_json(api.resolve(path, weights=False))
    if bits:
        config = config.replace(quantization=QuantConfig(bits=bits, group_size=64))
    graphdef, params = models.random_params(config)
    return nnx.merge(graphdef, params), config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", default=None, help="a DFlash2 drafter folder: adds drafted rows")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--copy-match", type=int, default=5)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=None, help="lane rounds a call runs (default: the backend's)")
    ap.add_argument("--lanes", type=int, default=None,
                    help="lane capacity (default: --streams): more than the streams runs the rounds' lane buckets")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--plain-twice", action="store_true", help="a second plain row: is plain decoding deterministic?")
    ap.add_argument("--exact", action="store_true",
                    help="with --random-weights, the drafted rows too (their hashes check exactness; speeds mean little)")
    ap.add_argument("--random-weights", type=int, default=None, metavar="BITS",
                    help="random MLX BITS-bit weights of the folder's geometry (0: unquantized); plain rows only")
    ap.add_argument("--cells", default="code edit,code new,chat", help="prompts to run, comma separated")
    ap.add_argument("--sampling", default="greedy,sampled", help="greedy, sampled or both")
    ap.add_argument("--prompts", default=None, help="a corpus prompt set (.jsonl.gz): its held-out prompts")
    ap.add_argument("--per-cell", type=int, default=4, help="with --prompts: prompts a cell")
    ap.add_argument("--streams", type=int, default=1,
                    help="prompts at once: --prompts' held-out prompts, else variants of each built-in prompt")
    ap.add_argument("--runs", type=int, default=1, help="timed runs of every mode, in turns: tok/s is their median "
                    "(min..max); hashes are checked on every run")
    args = ap.parse_args()
    kw = dict(lanes=args.lanes or max(1, args.streams), width=args.width, context=args.context, rounds=args.rounds)
    if args.random_weights is not None:
        kw["model"] = random_model(args.model, args.random_weights)
    engines = {"copies": api.load(args.model, copy_match=args.copy_match, **kw)}
    if args.drafter:
        engines["dflash2"] = api.load(args.model, drafter=args.drafter, copies=False, **kw)
        engines["dflash2+copies"] = api.load(args.model, drafter=args.drafter, copy_match=args.copy_match, **kw)
    import jax

    print(f"{args.model} on {jax.devices()[0].device_kind}, jax {jax.__version__}"
          + (f", random {args.random_weights}-bit weights" if args.random_weights is not None else ""))
    notes: list[str] = []
    hashes: list[str] = []  # the plain replies' hashes: compare processes (another --rounds, another tree) by them
    print("| cell | mode | decode tok/s a stream | x plain | tok/s (wall) | x plain (wall) | tok/round | hash == plain |")
    print("|---|---|---|---|---|---|---|---|")
    if args.prompts:
        cells = held_out_cells(args.prompts, args.per_cell, args.streams)
    else:
        cells = [(c, [stream_variants(p, args.streams) if args.streams > 1 else [p]])
                 for c, p in (("code edit", CODE), ("code new", CODE_NEW), ("chat", CHAT))]
    cells = [c for c in cells if c[0] in args.cells.split(",")]
    modes = [m for m in (("greedy", {}), ("sampled", SAMPLED)) if m[0] in args.sampling.split(",")]
    for llm in engines.values():  # every lane bucket's round, once: streams that end apart meet buckets warm-ups miss
        llm.engine.runner.compile_rounds()  # (the prompts' programs: `warm` runs the prompts timed here)
    for name, groups in cells:
        for llm in engines.values():  # a draft: false request runs the same programs (its lanes just propose nothing)
            warm(llm, groups, modes[0][1] if modes else {})
        label = (f"{name} (held out x{sum(map(len, groups))}, {args.streams} at once)" if args.prompts
                 else f"{name} ({args.streams} at once)" if args.streams > 1 else name)
        for sampling, params in modes:
            drafted = args.random_weights is None or args.exact
            rows = [("plain", engines["copies"], False)]
            if args.plain_twice:
                rows.append(("plain again", engines["copies"], False))
            rows += [(m, llm, True) for m, llm in engines.items()] if drafted else []
            speeds, decodes, rounds, same, base = {m: [] for m, *_ in rows}, {m: [] for m, *_ in rows}, {}, {}, None
            for _ in range(args.runs):  # the modes in turns, so a change in the machine's load hits all alike
                for mode, llm, draft in rows:
                    s, d, rounds[mode], outs = timed_groups(llm, groups, args.tokens, draft, params)
                    speeds[mode].append(s)
                    decodes[mode].append(d)
                    base = base or outs  # the first plain run: every other run's hashes are checked against it
                    equal = [o.token_sha256 == b.token_sha256 for o, b in zip(outs, base, strict=True)]
                    same[mode] = min(same.get(mode, len(base)), sum(equal))
                    notes += [f"{name} #{k}, {sampling}, {mode}: {first_difference(b.token_ids, o.token_ids)}"
                              for k, (o, b, e) in enumerate(zip(outs, base, equal, strict=True)) if not e]
            plain, plain_decode = statistics.median(speeds["plain"]), statistics.median(decodes["plain"])
            hashes += [f"{label}, {sampling}: plain token_sha256 " + " ".join(o.token_sha256[:16] for o in base)]
            for mode, *_ in rows:
                med, dec = statistics.median(speeds[mode]), statistics.median(decodes[mode])
                equal = "-" if mode == "plain" else f"{same[mode]}/{len(base)}"
                print(f"| {label}, {sampling} | {mode} | {dec:.1f}{spread(decodes[mode])} | {dec / plain_decode:.2f} | "
                      f"{med:.1f}{spread(speeds[mode])} | {med / plain:.2f} | {rounds[mode]:.2f} | {equal} |", flush=True)
    for line in notes + hashes:
        print(line)


def spread(values: list[float]) -> str:
    """" (min..max)" of several runs, nothing for one."""
    return f" ({min(values):.1f}..{max(values):.1f})" if len(values) > 1 else ""


def first_difference(a: list[int], b: list[int]) -> str:
    """Where two replies part: the index and the two tokens there."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i} of {len(a)}: {a[i] if i < len(a) else None} vs {b[i] if i < len(b) else None}"


if __name__ == "__main__":
    main()
