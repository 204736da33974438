"""The kernel-timing helpers of the bench scripts (`tfjax.profiling`): device time from profiler events."""

from __future__ import annotations

import math

from tfjax.profiling import kernel_seconds


def test_kernel_seconds_is_the_median_matching_launch_or_all_kernels_per_op():
    events = [{"name": "qmatmul_tiled", "dur": d} for d in (30.0, 10.0, 20.0)] + [{"name": "loop_add", "dur": 6.0}]
    assert math.isclose(kernel_seconds(events, "qmatmul", ops=3), 20e-6)
    assert math.isclose(kernel_seconds(events, None, ops=3), 22e-6)
    assert math.isnan(kernel_seconds(events, "attention", ops=3))
