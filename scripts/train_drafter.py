"""Distill a DFlash2 drafter for a target on the target's own generations; resumable, exported as safetensors.

  TFJAX_CACHE=/tmp/tfjax-cache PYTHONPATH=. python3 scripts/train_drafter.py --model smollm2 --out runs/smollm2-dflash2

Writes OUT/data.npz (the target's generations), OUT/feats.npy (its tapped states), OUT/ckpt (orbax, every
--save-every steps; a rerun resumes from the latest) and OUT/drafter (config.json + model.safetensors in the
published DFlash2 layout, loadable with `tfjax.load(model, drafter=OUT/drafter)`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from tfjax import api, checkpoint, models, ops
from tfjax.drafters import dflash2, dflash2_checkpoint, train
from tfjax.tokenizer import Tokenizer

CODE = [
    "def triangle_numbers(n):\n", "def is_prime(n):\n", "def binary_search(items, target):\n",
    "class Queue:\n    def __init__(self):\n", "def merge_sort(values):\n", "def read_csv(path):\n",
    "import os\n\ndef list_files(folder):\n", "def flatten(nested):\n", "def word_count(text):\n",
    "class Node:\n    def __init__(self, value, next=None):\n", "def reverse_words(sentence):\n",
    "def gcd(a, b):\n", "def parse_args():\n    parser = argparse.ArgumentParser()\n", "SELECT name, email FROM",
    "function debounce(fn, wait) {\n", "def matrix_multiply(a, b):\n", "def to_snake_case(name):\n",
    "for i in range(10):\n", "def unique(values):\n    seen = set()\n", "def factorial(n):\n",
    "def chunked(items, size):\n", "class LRUCache:\n    def __init__(self, capacity):\n", "def median(values):\n",
    "def is_palindrome(text):\n", "def transpose(matrix):\n", "async def fetch_all(urls):\n",
    "def count_vowels(word):\n", "class Vector:\n    def __init__(self, x, y):\n", "def rotate(items, k):\n",
    "def histogram(values, bins):\n", "def dedent(text):\n", "def celsius_to_fahrenheit(c):\n",
    "#include <stdio.h>\n\nint main(void) {\n", "fn main() {\n", "def quicksort(values):\n",
    "def parse_date(text):\n", "const sum = (xs) =>", "def levenshtein(a, b):\n", "def pairwise(items):\n",
    "CREATE TABLE users (\n",
]
# Edit prompts: a snippet, then the same snippet with one name renamed (the model copies most of it back).
EDITS = [
    ("def mean(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s / len(xs)\n", "s", "running"),
    ("def find(items, key):\n    for i, item in enumerate(items):\n        if item == key:\n            return i\n"
     "    return -1\n", "item", "value"),
    ("class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def bump(self):\n"
     "        self.count += 1\n        return self.count\n", "count", "n"),
    ("def squares(limit):\n    out = []\n    for k in range(limit):\n        out.append(k * k)\n    return out\n",
     "out", "result"),
    ("def longest(words):\n    best = ''\n    for w in words:\n        if len(w) > len(best):\n            best = w\n"
     "    return best\n", "best", "longest_word"),
    ("function clamp(x, lo, hi) {\n  if (x < lo) return lo;\n  if (x > hi) return hi;\n  return x;\n}\n", "x",
     "value"),
    ("def evens(numbers):\n    kept = []\n    for n in numbers:\n        if n % 2 == 0:\n            kept.append(n)\n"
     "    return kept\n", "kept", "evens_found"),
    ("def join_lines(lines):\n    text = ''\n    for line in lines:\n        text += line + '\\n'\n    return text\n",
     "text", "joined"),
]
EDIT_PROMPTS = [f"Original:\n{code}\nThe same code with `{a}` renamed to `{b}`:\n" for code, a, b in EDITS]
CHAT = [
    "How do I start running regularly?", "Explain what a hash table is.", "How do I make a paper plane?",
    "Give me a short poem about the sea.", "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet.", "How can I sleep better?", "Write a haiku about autumn.",
    "What are the planets of the solar system?", "Explain recursion to a child.", "Suggest a name for a cat.",
    "How do I boil an egg?", "What is machine learning?", "Write a short story about a robot.",
    "List five fruits and their colours.", "How does a refrigerator work?", "Why do leaves change colour in autumn?",
    "Give me a recipe for pancakes.", "What is the capital of Japan and what is it known for?",
    "Write a thank-you note to a teacher.", "How do vaccines work?", "Plan a three-day trip to Rome.",
    "What is the difference between weather and climate?", "Give me five ideas for a birthday party.",
    "Explain how a compiler works in simple terms.", "Write a limerick about a programmer.",
    "What should I pack for a camping trip?", "How do I start learning the guitar?",
    "Describe the water cycle.", "Write a short email asking for a day off.", "What is photosynthesis?",
    "Compare cats and dogs as pets.", "How do I keep houseplants alive?", "Explain what an API is.",
    "Give me a weekly workout plan for beginners.", "What causes earthquakes?", "Write a product description "
    "for a reusable water bottle.", "How can I improve my handwriting?", "Explain the rules of chess briefly.",
    "What are good habits for saving money?",
]


def prompt_ids(tok: Tokenizer, path: str | None) -> list[list[int]]:
    """Code and edit prompts as raw text, chat prompts through the chat template (or a JSON list of strings).

    None of them is a prompt of `bench_generate.py` or `bench_concurrent.py`."""
    if path:
        return [tok.encode(p) for p in json.loads(Path(path).read_text())]
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT]
    return [tok.encode(c) for c in CODE + EDIT_PROMPTS] + chat


def build_data(args, model: Path, target, tok, prompts: list[list[int]], out: Path) -> dict[str, np.ndarray]:
    """The target's own generations of `prompts` (greedy, then sampled with other seeds), cached in OUT/data.npz.

    On a GPU they come from the serving setup (checkpoint dtype, kernel layout, Pallas kernels) as `tfjax.load`
    builds it from `model`; on the CPU from the float32 `target` itself."""
    path = out / "data.npz"
    if path.exists():
        return dict(np.load(path))
    if ops.Kernels.default().pallas:
        target = api.load(model, lanes=args.lanes).model
    seqs_p, seqs_o = [], []
    for rep in range(args.samples):
        temp = 0.0 if rep == 0 else args.temperature
        bar = tqdm(total=len(prompts), desc=f"generating {rep + 1}/{args.samples} (T={temp})")
        outs = train.generate(target, prompts, args.max_tokens, lanes=args.lanes, temperature=temp, seed=1000 * rep,
                              eos_ids=tuple(tok.eos_ids), progress=lambda n, bar=bar: bar.update(n - bar.n))
        bar.close()
        seqs_p += prompts
        seqs_o += outs
    data = train.pack(seqs_p, seqs_o, args.seq_len)
    np.savez(path, **data)
    return data


def build_feats(args, tdef, tparams, data, taps, out: Path) -> np.ndarray:
    """The target's tapped states of every sequence, cached in OUT/feats.npy (float16)."""
    path = out / "feats.npy"
    if path.exists():
        return np.load(path, mmap_mode="r")
    chunks = []
    for s in tqdm(range(0, len(data["tokens"]), args.feat_batch), desc="tapping the target"):
        f = train.tap_features(tdef, tparams, jnp.asarray(data["tokens"][s : s + args.feat_batch]), taps)
        chunks.append(np.asarray(f, np.float16))
    feats = np.concatenate(chunks)
    if not np.isfinite(feats).all():
        raise ValueError("tapped states overflow float16")
    np.save(path, feats)
    return feats


def split_by_prompt(sequences: int, prompts: int, held_prompts: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held, trained) sequence indices; sequence i answers prompt i % prompts, and every answer to a held
    prompt is held, so the held-out loss measures prompts the drafter never saw."""
    if not 0 < held_prompts < prompts:
        raise ValueError(f"--held-prompts {held_prompts} must be between 1 and the {prompts} prompts - 1")
    held_ids = np.random.default_rng(seed).choice(prompts, held_prompts, replace=False)
    held = np.isin(np.arange(sequences) % prompts, held_ids)
    return np.flatnonzero(held), np.flatnonzero(~held)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default=None, help="a JSON list of prompt strings (default: built-in code + chat)")
    ap.add_argument("--samples", type=int, default=3, help="generations per prompt: 1 greedy + sampled ones")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--feat-batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--taps", type=int, default=5)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--held-prompts", type=int, default=4,
                    help="prompts whose generations are never trained on; the reported loss is theirs")
    args = ap.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = api.resolve(args.model)
    target, tcfg = checkpoint.load(path, dtype="float32")
    target.kernels = ops.REFERENCE  # gradients flow through the target's embedding and lm_head: jnp ops only
    tok = Tokenizer.from_dir(path)
    tdef, tparams = models.split(target)
    added = tok.backend.get_added_tokens_decoder()
    mask = max(added) if added else tcfg.vocab_size - 1  # a special token plain text never holds
    cfg = train.config_for(tcfg, layers=args.layers, block=args.block, taps=args.taps, mask_token_id=mask,
                           rank=args.rank, top_k=args.top_k, intermediate=args.intermediate)
    prompts = prompt_ids(tok, args.prompts)
    data = build_data(args, path, target, tok, prompts, out)
    data["feats"] = build_feats(args, tdef, tparams, data, cfg.target_layer_ids, out)

    drafter = dflash2.build(cfg, seed=args.seed).bind(tcfg)
    drafter.kernels = ops.REFERENCE  # trained through jnp ops (its kernels have no gradients)
    ddef, params = nnx.split(drafter)
    opt = train.optimizer(args.lr, min(50, args.steps // 10), args.steps)
    opt_state = opt.init(params)
    mngr = ocp.CheckpointManager(out / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt": opt_state}))
        params, opt_state = restored["params"], restored["opt"]
        print(f"resumed at step {start}")
    step = train.make_step(opt, args.anchors, args.gamma)
    held, trained = split_by_prompt(len(data["tokens"]), len(prompts), args.held_prompts, args.seed)

    def rows(idx):
        return {k: jnp.asarray(np.asarray(v[idx], np.float32 if k == "feats" else None)) for k, v in data.items()}

    evalb = rows(held[: args.batch])
    loss0 = float(train.evaluate(ddef, params, tdef, tparams, evalb, args.anchors, args.gamma)[0])
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="training")
    for i in bar:
        batch = rows(np.sort(np.random.default_rng(args.seed * 100_003 + i).choice(trained, args.batch, replace=False)))
        params, opt_state, loss, stats = step(ddef, params, opt_state, tdef, tparams, batch, jax.random.key(i))
        bar.set_postfix({k: f"{float(v):.3f}" for k, v in stats.items()})
        if (i + 1) % args.save_every == 0 or i + 1 == args.steps:
            mngr.save(i + 1, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
    mngr.wait_until_finished()
    loss1, stats1 = train.evaluate(ddef, params, tdef, tparams, evalb, args.anchors, args.gamma)
    print(f"held-out loss ({len(evalb['tokens'])} sequences of {args.held_prompts} unseen prompts): {loss0:.3f} -> "
          f"{float(loss1):.3f} ({', '.join(f'{k} {float(v):.3f}' for k, v in stats1.items())})")
    loss_t, stats_t = train.evaluate(ddef, params, tdef, tparams, rows(trained[: args.batch]), args.anchors, args.gamma)
    print(f"training-set loss: {float(loss_t):.3f} ({', '.join(f'{k} {float(v):.3f}' for k, v in stats_t.items())})")
    dest = dflash2_checkpoint.save(nnx.merge(ddef, params), out / "drafter", dtype="bfloat16")
    print(f"drafter: {dest}")


if __name__ == "__main__":
    main()
