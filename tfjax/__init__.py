"""tfjax: JAX-compiled LLM inference with exact speculative decoding in lane rounds."""

from __future__ import annotations

__version__ = "0.1.0"


def load(name_or_path, **kw):
    """Load a checkpoint folder or packaged model (see `tfjax.api.load`)."""
    from tfjax.api import load as _load

    return _load(name_or_path, **kw)
