"""What a drafter declares about itself (`Facts`), what the target declares (`ModelFacts`), and the merge.

The merged `RoundFacts` is frozen and hashable: the compiled round takes it as a static argument, so a
change of copy policy or draft block is a recompile, never data. Copy policy: the target alone copies
after `enter_match` (5) matching tokens, because copies are its only proposals; a drafter may replace that
with its own `copy_match` (DFlash2 on the dense 27B: `long_match`, 20) so short matches don't pre-empt its
drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfjax import geometry
from tfjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Facts:
    """A drafter's static facts; `copy_match` 0 keeps the target's match, a positive value replaces it."""

    copy_match: int = 0
    root_copies: bool = True
    block: int = 0  # proposals the drafter drafts per round
    kind: str = "chain"  # "chain": a draft model run token by token in the round; "block": a block drafter

    def __post_init__(self) -> None:
        if self.kind not in ("chain", "block"):
            raise ValueError(f"Facts.kind={self.kind!r} must be 'chain' or 'block'")
        if self.copy_match < 0:
            raise ValueError(f"Facts.copy_match={self.copy_match} must be >= 0 (0: keep the target's)")
        if self.block < 0:
            raise ValueError(f"Facts.block={self.block} must be >= 0")


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """A target backend's static facts: whether it copies from a lane's root, and after how many tokens."""

    root_copies: bool = True
    enter_match: int = 5

    def __post_init__(self) -> None:
        if self.enter_match < 1:
            raise ValueError(f"ModelFacts.enter_match={self.enter_match} must be >= 1")


@dataclasses.dataclass(frozen=True)
class RoundFacts:
    """The merged static facts the compiled round reads; `copy_match` 0 means copies off."""

    copy_match: int
    draft_block: int = 0

    def __post_init__(self) -> None:
        if self.copy_match < 0 or self.draft_block < 0:
            raise ValueError(f"RoundFacts {self.copy_match=} and {self.draft_block=} must be >= 0")

    @property
    def copies(self) -> bool:
        return self.copy_match > 0


def effective_copy_match(target_facts: ModelFacts, drafter_facts: Facts | None) -> int:
    """The copy match in force: the drafter's if non-zero, else the target's `enter_match`; 0 = copies off."""
    if not target_facts.root_copies or (drafter_facts is not None and not drafter_facts.root_copies):
        return 0
    if drafter_facts is not None and drafter_facts.copy_match > 0:
        return drafter_facts.copy_match
    return target_facts.enter_match


def round_facts(target_facts: ModelFacts, drafter_facts: Facts | None = None) -> RoundFacts:
    """Merge target and (optional) drafter facts into the round's static facts."""
    block = 0 if drafter_facts is None else drafter_facts.block
    return RoundFacts(copy_match=effective_copy_match(target_facts, drafter_facts), draft_block=block)


class Drafted:
    """A target backend with a drafter attached (or None: the target alone); `facts` is the merge."""

    def __init__(self, target: Any, drafter: Any | None) -> None:
        if not isinstance(getattr(target, "facts", None), ModelFacts):
            raise TypeError(f"Drafted target needs .facts of type ModelFacts, got {type(target).__name__}")
        if drafter is not None and not isinstance(getattr(drafter, "facts", None), Facts):
            raise TypeError(f"Drafted drafter needs .facts of type Facts, got {type(drafter).__name__}")
        self.target = target
        self.drafter = drafter

    @property
    def facts(self) -> RoundFacts:
        return round_facts(self.target.facts, None if self.drafter is None else self.drafter.facts)

    def __repr__(self) -> str:
        return f"Drafted({self.target!r}, {self.drafter!r})"


def copy_match_for(g: ModelConfig, long_match: int = 20) -> int:
    """DFlash2's copy match: `long_match` on the dense 27B shape, 0 (keep the target's) elsewhere."""
    return long_match if geometry.same_shape(g, geometry.dense27) else 0
