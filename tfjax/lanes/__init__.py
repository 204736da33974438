"""Lanes: one stream's slot in the shared, jitted round (config, root copies, drafter facts)."""

from __future__ import annotations

from tfjax.lanes.config import LaneConfig
from tfjax.lanes.copies import propose_copies, propose_copies_reference
from tfjax.lanes.drafter import (
    Drafted,
    Facts,
    ModelFacts,
    RoundFacts,
    copy_match_for,
    effective_copy_match,
    round_facts,
)

__all__ = [
    "Drafted",
    "Facts",
    "LaneConfig",
    "ModelFacts",
    "RoundFacts",
    "copy_match_for",
    "effective_copy_match",
    "propose_copies",
    "propose_copies_reference",
    "round_facts",
]
