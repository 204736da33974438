"""Serving engine: a plain-Python scheduler, a runner that owns device state, and the engine loop."""

from __future__ import annotations

from tfjax.engine.engine import Engine, Request, Result
from tfjax.engine.scheduler import ContextLengthExceeded

__all__ = ["ContextLengthExceeded", "Engine", "Request", "Result"]
