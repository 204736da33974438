"""Tests run on the CPU in float32 unless a test asks for the GPU (`gpu` marker); the shared tiny target."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402  (after the platform is chosen)


@pytest.fixture(scope="module")
def target():
    """The tiny random qwen3_5 target the lane tests decode with (a module may define its own)."""
    from tfjax import geometry, models

    return models.build(geometry.tiny_dense, seed=11)


@pytest.fixture(scope="session", autouse=True)
def no_compile_cache_in_the_users_cache():
    """Tests never write compiled programs into ~/.cache/tfjax/jax (the packaged models' cache stays shared)."""
    os.environ.setdefault("TFJAX_COMPILE_CACHE", "off")
