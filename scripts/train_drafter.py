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

from tfjax import api, checkpoint, models
from tfjax.drafters import dflash2, dflash2_checkpoint, train
from tfjax.tokenizer import Tokenizer

CODE = [
    "def fibonacci(n):\n", "def is_prime(n):\n", "def binary_search(items, target):\n",
    "class Stack:\n    def __init__(self):\n", "def merge_sort(values):\n", "def read_csv(path):\n",
    "import json\n\ndef load_config(path):\n", "def flatten(nested):\n", "def word_count(text):\n",
    "class Node:\n    def __init__(self, value, next=None):\n", "def reverse_words(sentence):\n",
    "def gcd(a, b):\n", "def parse_args():\n    parser = argparse.ArgumentParser()\n", "SELECT name, email FROM",
    "function debounce(fn, wait) {\n", "def matrix_multiply(a, b):\n", "def to_snake_case(name):\n",
    "for i in range(10):\n", "def unique(values):\n    seen = set()\n", "def factorial(n):\n",
]
CHAT = [
    "Write three short tips for learning to cook.", "Explain what a hash table is.", "How do I make a paper plane?",
    "Give me a short poem about the sea.", "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet.", "How can I sleep better?", "Write a haiku about autumn.",
    "What are the planets of the solar system?", "Explain recursion to a child.", "Suggest a name for a cat.",
    "How do I boil an egg?", "What is machine learning?", "Write a short story about a robot.",
    "List five fruits and their colours.", "How does a bicycle work?", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "What is the capital of Japan and what is it known for?",
    "Write a thank-you note to a teacher.",
]


def prompt_ids(tok: Tokenizer, path: str | None) -> list[list[int]]:
    """Code prompts as raw text, chat prompts through the chat template (or a JSON list of strings)."""
    if path:
        return [tok.encode(p) for p in json.loads(Path(path).read_text())]
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT]
    return [tok.encode(c) for c in CODE] + chat


def build_data(args, target, tok, out: Path) -> dict[str, np.ndarray]:
    """The target's own generations (greedy, then sampled with other seeds), cached in OUT/data.npz."""
    path = out / "data.npz"
    if path.exists():
        return dict(np.load(path))
    prompts = prompt_ids(tok, args.prompts)
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
    args = ap.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = api.resolve(args.model)
    target, tcfg = checkpoint.load(path, dtype="float32")
    tok = Tokenizer.from_dir(path)
    tdef, tparams = models.split(target)
    added = tok.backend.get_added_tokens_decoder()
    mask = max(added) if added else tcfg.vocab_size - 1  # a special token plain text never holds
    cfg = train.config_for(tcfg, layers=args.layers, block=args.block, taps=args.taps, mask_token_id=mask,
                           rank=args.rank, top_k=args.top_k, intermediate=args.intermediate)
    data = build_data(args, target, tok, out)
    data["feats"] = build_feats(args, tdef, tparams, data, cfg.target_layer_ids, out)

    ddef, params = nnx.split(dflash2.build(cfg, seed=args.seed).bind(tcfg))
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
    n = len(data["tokens"])
    held = np.arange(min(args.batch, n))
    evalb = {k: jnp.asarray(np.asarray(v[held], np.float32 if k == "feats" else None)) for k, v in data.items()}
    loss0 = float(train.evaluate(ddef, params, tdef, tparams, evalb, args.anchors, args.gamma)[0])
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="training")
    for i in bar:
        idx = np.sort(np.random.default_rng(args.seed * 100_003 + i).choice(n, args.batch, replace=False))
        batch = {k: jnp.asarray(np.asarray(v[idx], np.float32 if k == "feats" else None)) for k, v in data.items()}
        params, opt_state, loss, stats = step(ddef, params, opt_state, tdef, tparams, batch, jax.random.key(i))
        bar.set_postfix({k: f"{float(v):.3f}" for k, v in stats.items()})
        if (i + 1) % args.save_every == 0 or i + 1 == args.steps:
            mngr.save(i + 1, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
    mngr.wait_until_finished()
    loss1, stats1 = train.evaluate(ddef, params, tdef, tparams, evalb, args.anchors, args.gamma)
    print(f"loss on {len(held)} sequences: {loss0:.3f} -> {float(loss1):.3f} "
          f"({', '.join(f'{k} {float(v):.3f}' for k, v in stats1.items())})")
    dest = dflash2_checkpoint.save(nnx.merge(ddef, params), out / "drafter", dtype="bfloat16")
    print(f"drafter: {dest}")


if __name__ == "__main__":
    main()
