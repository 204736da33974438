"""tfjax: JAX-compiled LLM inference with exact speculative decoding in lane rounds."""

from __future__ import annotations

__version__ = "0.1.0"
