"""Pallas kernels, each beside its plain jax.numpy reference (see each module's docstring)."""

from __future__ import annotations
