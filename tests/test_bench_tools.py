"""The kernel-timing helpers of the bench scripts: device time from profiler events, the load-only probe."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))  # the scripts import each other by bare name
from scripts.probe_qmatmul import probe  # noqa: E402
from scripts.timing import kernel_seconds  # noqa: E402


def test_kernel_seconds_is_the_median_matching_launch_or_all_kernels_per_op():
    events = [{"name": "qmatmul_tiled", "dur": d} for d in (30.0, 10.0, 20.0)] + [{"name": "loop_add", "dur": 6.0}]
    assert math.isclose(kernel_seconds(events, "qmatmul", ops=3), 20e-6)
    assert math.isclose(kernel_seconds(events, None, ops=3), 22e-6)
    assert math.isnan(kernel_seconds(events, "attention", ops=3))


def test_probe_xors_exactly_the_words_of_each_programs_k_range():
    w = jax.random.bits(jax.random.key(0), (128, 256), jnp.uint32)
    got = np.asarray(probe(w, block_n=64, words_per_step=32, split=2, interpret=True))
    words = np.asarray(w).reshape(128, 2, 4, 32)  # [row, split, step, word]
    acc = np.bitwise_xor.reduce(words, axis=2)  # [row, split, word]
    want = acc.astype(np.float32).sum(-1).T  # [split, row]
    np.testing.assert_allclose(got, want, rtol=1e-6)
