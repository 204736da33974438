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


def memory_mappings() -> int:
    """This process's memory mappings (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def mapping_limit() -> int:
    """The kernel's cap on one process's mappings (vm.max_map_count; 65530 by default)."""
    with open("/proc/sys/vm/max_map_count") as f:
        return int(f.read())


def free_compiled_programs_past(threshold: int) -> bool:
    """Drop every cached compiled program (`jax.clear_caches`) once this process holds more than `threshold`
    mappings; whether it did."""
    if memory_mappings() <= threshold:
        return False
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    return True


@pytest.fixture(scope="module", autouse=True)
def compiled_programs_stay_under_the_mapping_limit():
    """An XLA CPU executable holds ~7 memory mappings, and the jit caches keep every program a session compiles:
    the whole suite in one process reached vm.max_map_count and the next compile died (SIGSEGV in
    `backend_compile_and_load`, CI 2026-12-07). After a module, past half the limit, the programs are freed."""
    yield
    if os.path.exists("/proc/self/maps"):
        free_compiled_programs_past(mapping_limit() // 2)
