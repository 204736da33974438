"""Tests run on the CPU in float32 unless the `gpu` marker is selected (`pytest -m gpu` runs on the GPU by itself);
the shared tiny target."""

from __future__ import annotations

import os

import pytest


def gpu_selected(markexpr: str) -> bool:
    """Whether a `-m` expression selects the `gpu` tests and not the unmarked ones: `gpu` yes; `not gpu`, `not slow` no."""
    if not markexpr:
        return False
    from _pytest.mark.expression import Expression

    expr = Expression.compile(markexpr)
    return expr.evaluate(lambda name: name == "gpu") and not expr.evaluate(lambda name: False)


def pytest_configure(config: pytest.Config) -> None:
    """The platform is chosen here, before any test module imports jax."""
    if not gpu_selected(config.getoption("markexpr", "")):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


@pytest.fixture(scope="module")
def target():
    """The tiny random qwen3_5 target the lane tests decode with (a module may define its own)."""
    from tfjax import geometry, models

    return models.build(geometry.tiny_dense, seed=11)


@pytest.fixture(scope="session", autouse=True)
def no_compile_cache_in_the_users_cache():
    """Tests never write compiled programs into ~/.cache/tfjax/jax (the packaged models' cache stays shared)."""
    os.environ.setdefault("TFJAX_COMPILE_CACHE", "off")
