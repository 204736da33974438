"""Kernels and the decode graph on a GPU, each beside its roofline (issue 5 receipts); the sections live in
`tfjax.bench`, one module each.

    PYTHONPATH=. python3 scripts/bench_graph.py [--sections base,qmatmul,attention,delta,delta_prompt,prompt,flash,prefill,decode,hf]
        [--sweep] [--out results.json]
    BENCH_QSHAPES=decode BENCH_MS=1,16 ... --sections base,qmatmul   # the shapes a decode step multiplies

Ceilings measured in the same run: copy bandwidth (device-to-device, bytes read + written) and the bf16
matmul rate (8192^3, random data). Every time is the median of many runs of one jitted program that
applies the op to enough distinct input sets that L2 cannot hold them, divided by the set count (no
compile time). The HF transformers peer runs in a child process after the JAX sections (its own memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from tfjax.bench import attention, decode, delta, hf, prompt, qmatmul
from tfjax.bench.common import RESULTS, ROWS, base

SECTIONS = ("base", "qmatmul", "attention", "delta", "delta_prompt", "prompt", "flash", "prefill", "decode")


def run_section(name: str, a: argparse.Namespace, sections: list[str]) -> None:
    """One JAX section with its command-line options."""
    if name == "base":
        base()
    elif name == "qmatmul":
        qmatmul.qmatmul_section(a.sweep and (a.qsweep if a.qsweep != "tiles" else True))
    elif name == "attention":
        attention.attention_section(a.sweep and ("chunks" if a.asweep == "chunks" else True))
    elif name == "delta":
        delta.delta_section()
    elif name == "delta_prompt":
        delta.delta_prompt_section()
    elif name == "prefill":
        decode.prefill_section(rows=a.prefill_rows, layers=a.layers)
    elif name == "prompt":
        prompt.prompt_section()
    elif name == "flash":
        if "prompt" not in sections:  # prompt runs it too
            prompt.flash_section()
    else:
        decode.decode_section(context=a.decode_context, span=a.decode_span, layers=a.layers,
                              modes=tuple(a.decode_modes.split(",")), rows=a.decode_rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="base,qmatmul,attention,prompt,decode,hf")
    ap.add_argument("--sweep", action="store_true", help="sweep tile configs first (qmatmul, attention)")
    ap.add_argument("--asweep", choices=["tiles", "chunks"], default="tiles",
                    help="with --sweep: the attention candidates (tiles at 16k, or chunk policies at every context)")
    ap.add_argument("--qsweep", choices=["tiles", "unpack", "options"], default="tiles",
                    help="with --sweep: the qmatmul candidates (tile shapes, the unpack variants, or the pair "
                    "kernel's options)")
    ap.add_argument("--decode-rows", type=int, default=1, help="decode: rows a step (8: a width-8 lane round's "
                    "verify shape, the engine's default)")
    ap.add_argument("--decode-context", type=int, default=2048, help="decode: the lane's context (keys before the "
                    "first step)")
    ap.add_argument("--decode-span", type=int, default=0, help="decode: the cache's keys a lane (0: the context "
                    "and the steps; more: a lane of a longer-context engine)")
    ap.add_argument("--layers", type=int, default=0, help="decode, prefill: truncate the layer count (0 = all 64)")
    ap.add_argument("--prefill-rows", type=int, default=2048, help="prefill: the prompt chunk's tokens")
    ap.add_argument("--decode-modes", default="reference,kernel", help="decode: the paths to time")
    ap.add_argument("--pairs-policy", default="", help="decode: keywords replacing the pair layout's dispatch tiles, "
                    "e.g. \"dict(programs=264, sums_outside=False)\" (A/B runs)")
    ap.add_argument("--attn-blocks", default="", help="attention's default BlockSizes keywords (decode and the "
                    "attention section), e.g. \"dict(q_blocks=1)\"")
    ap.add_argument("--attn-cands", default="", help="attention: instead of the table, device time of each "
                    "candidate, e.g. \"[dict(kernel='mgpu'), dict(kernel='mgpu', chunk_k=128), dict(num_stages=1, page=64)]\"")
    ap.add_argument("--attn-span", type=int, default=0, help="attention candidates: page tables spanning this many "
                    "keys at every context (a short context in a long-context engine's lane)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.attn_cands:
        attention.ATTN_CANDS.extend(eval(a.attn_cands))  # noqa: S307 (a benchmark's own flag)
    attention.ATTN_SPAN[0] = a.attn_span
    sections = a.sections.split(",")
    if a.attn_blocks:
        from pallas_kernels import attention as pa

        pa.DEFAULT = pa.BlockSizes(**eval(a.attn_blocks))  # noqa: S307 (a benchmark's own flag)
    if a.pairs_policy:
        qmatmul.override_pairs_policy(eval(a.pairs_policy))  # noqa: S307 (a benchmark's own flag)
    if sections == ["hf"]:
        hf.hf_section()
        return
    if "hf" in sections:  # first, in a child, before this process's JAX takes most of the GPU's memory
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")])))
        p = subprocess.run([sys.executable, __file__, "--sections", "hf"], capture_output=True, text=True, env=env)
        print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                RESULTS["hf"] = json.loads(line)
    import jax

    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    RESULTS["device"] = jax.devices()[0].device_kind
    t0 = time.perf_counter()
    for name in SECTIONS:
        if name in sections or (name == "base" and len(sections) > 0):
            ts = time.perf_counter()
            try:
                run_section(name, a, sections)
            except Exception as e:  # one failing section must not lose the others' numbers
                import traceback

                traceback.print_exc()
                RESULTS[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[{name}: {time.perf_counter() - ts:.0f} s]", flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(RESULTS, f, indent=1, default=str)
    if "hf" in sections:
        if "hf" in RESULTS and "decode_kernel" in RESULTS:
            ratio = RESULTS["decode_kernel"]["tok_s"] / RESULTS["hf"]["hf_tok_s"]
            ROWS.append(("peer", f"HF transformers bf16 dense27 1 stream ctx 2048: {RESULTS['hf']['hf_tok_s']:.1f} "
                         f"tok/s", f"{RESULTS['hf']['hf_ms'] * 1e3:.0f} us", f"ours/HF {ratio:.1f}x", "goal 5x",
                         f"{ratio / 5:.0%}"))
    print(f"\n{RESULTS['device']}; copy {RESULTS.get('copy_GBps', 0):.0f} GB/s; bf16 matmul "
          f"{RESULTS.get('bf16_TFLOPs', 0):.0f} TFLOP/s; total {time.perf_counter() - t0:.0f} s")
    print("| section | what | time | achieved | ceiling | fraction |\n|---|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")
    if a.out:
        RESULTS["table"] = ROWS
        with open(a.out, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
