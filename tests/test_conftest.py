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
