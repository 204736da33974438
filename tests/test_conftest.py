"""`pytest -m gpu` picks the GPU by itself; every other selection stays on the CPU."""

from __future__ import annotations

import pytest

from tests.conftest import gpu_selected


@pytest.mark.parametrize("expr,want", [("gpu", True), ("gpu and not slow", True), ("not slow and not gpu", False),
                                       ("slow", False), ("", False), ("gpu or slow", True),
                                       ("not slow", False), ("not gpu", False)])
def test_only_a_marker_expression_that_selects_gpu_tests_leaves_the_cpu(expr, want):
    assert gpu_selected(expr) is want


def test_this_run_is_on_the_cpu():
    import jax

    assert jax.default_backend() == "cpu"


def test_compiled_programs_are_freed_past_the_mapping_threshold():
    """Each XLA CPU executable maps memory; past the threshold they are all dropped and their mappings with them."""
    import jax
    import jax.numpy as jnp

    from tests.conftest import free_compiled_programs_past, memory_mappings

    for i in range(40):
        jax.jit(lambda x, i=i: jnp.sin(x) * i)(jnp.ones(i + 1)).block_until_ready()
    held = memory_mappings()
    assert not free_compiled_programs_past(held + 1000), "under the threshold nothing is freed"
    # past any threshold (0): a count just under `held` can pass unfreed where another thread unmapped meanwhile
    assert free_compiled_programs_past(0) and memory_mappings() < held - 100
