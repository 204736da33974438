"""The OpenAI-compatible HTTP server over the engine (`create_app`); `scripts/serve.py` runs it."""

from __future__ import annotations

from tfjax.server.app import create_app

__all__ = ["create_app"]
