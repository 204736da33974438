"""Compile a Pallas qmatmul kernel for sm_90a on a CPU-only machine and print what ptxas and the SASS say.

    pip install --target /tmp/tri triton==3.6.0      # the H200 image's Triton version; once
    PYTHONPATH=. python scripts/sass_qmatmul.py --kernel gemv --m 16 --kw "dict(groups_per_step=1)"
        [--n 17408 --k 5120] [--packed] [--triton /tmp/tri] [--keep /tmp/sass]

No device time: jax lowers the kernel to Triton IR for the "cuda" platform (export on the CPU), the
text of that module is compiled by the pip Triton (TTGIR, PTX, cubin), then its own ptxas -v reports
registers and spills and cuobjdump lists the SASS, counted by opcode. XLA on the device bundles its own
Triton, so this is a lead (spills, I2F, shared-memory round trips), not the device's exact code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax import export


def triton_module_text(kernel: str, n: int, k: int, m: int, kw: dict, packed: bool = False) -> str:
    """The Triton IR of the kernel as text (pallas_call's debug print, captured), locations dropped."""
    from jax.experimental import pallas as pl

    from pallas_kernels import qmatmul as qm

    qm.pl.pallas_call = functools.partial(pl.pallas_call, debug=True)
    if kernel == "gemv":
        fn, bs, wshape = qm.qmatmul_gemv, qm.GemvBlockSizes.for_weight(n, k, **kw), (k // 8, n)
    else:
        fn, bs, wshape = qm.qmatmul_tiled, qm.TiledBlockSizes.for_weight(n, k, 4, 64, **kw), (n, k // 8)
    sb = jax.ShapeDtypeStruct((k // 64, n), jnp.uint32 if packed else jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct(wshape, jnp.uint32), sb,
            None if packed else jax.ShapeDtypeStruct((k // 64, n), jnp.bfloat16))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            export.export(jax.jit(lambda x, w, s, b: fn(x, w, s, b, block_sizes=bs)), platforms=["cuda"])(*args)
        except ValueError as e:  # export refuses the Triton custom call after lowering it: expected
            if "xla.gpu.triton" not in str(e):
                raise
    text = buf.getvalue()
    out = []
    for line in text[text.index("module @"):].splitlines():
        if line.startswith("#loc"):
            continue
        line = re.sub(r"\s*\[unknown\]", "", line)
        line = re.sub(r"\s*loc\(#loc\d*\)", "", line)
        line = re.sub(r"\s*loc\([^()]*\)", "", line)
        line = re.sub(r'\s*"[^"]*"\(#loc\d*\)', "", line)
        out.append(line)
        if line == "}":
            break
    print(f"{kernel} {n}x{k} M={m} {bs}")
    return "\n".join(out) + "\n", bs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=["gemv", "tiled"], default="gemv")
    ap.add_argument("--n", type=int, default=17408)
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--kw", default="{}", help="block-size keywords, e.g. \"dict(groups_per_step=1)\"")
    ap.add_argument("--triton", default="/tmp/tri", help="where pip put triton (--target)")
    ap.add_argument("--keep", default="/tmp/sass", help="folder for the .ttir/.ttgir/.ptx/.cubin/.sass")
    ap.add_argument("--packed", action="store_true", help="scales and biases as one uint32 array (tiled)")
    a = ap.parse_args()
    ttir, bs = triton_module_text(a.kernel, a.n, a.k, a.m, eval(a.kw), a.packed)  # noqa: S307 (a local tool)
    os.makedirs(a.keep, exist_ok=True)
    stem = os.path.join(a.keep, f"{a.kernel}_m{a.m}" + "_packed" * a.packed)
    with open(stem + ".ttir", "w") as f:
        f.write(ttir)
    sys.path.insert(0, a.triton)
    import triton
    from triton.backends.compiler import GPUTarget

    ck = triton.compile(stem + ".ttir", target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=bs.num_warps, num_stages=bs.num_stages))
    for key in ("ttgir", "ptx"):
        with open(f"{stem}.{key}", "w") as f:
            f.write(ck.asm[key])
    tools = os.path.join(a.triton, "triton", "backends", "nvidia", "bin")
    rep = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", stem + ".ptx", "-o", stem + ".cubin"],
                         capture_output=True, text=True).stderr
    print(" ".join(line.split(":", 1)[-1].strip() for line in rep.splitlines() if "registers" in line or "spill" in line))
    print(f"shared memory {ck.metadata.shared} B; layout conversions in TTGIR: "
          f"{open(stem + '.ttgir').read().count('ttg.convert_layout')}")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", stem + ".cubin"], capture_output=True, text=True).stdout
    with open(stem + ".sass", "w") as f:
        f.write(sass)
    ops = collections.Counter(line.split()[1].split(".")[0] for line in sass.splitlines()
                              if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
    print("SASS:", ", ".join(f"{op} {c}" for op, c in ops.most_common(24)))


if __name__ == "__main__":
    main()
