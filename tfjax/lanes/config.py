"""Static lane geometry: how many lanes, how many rows each verifies per round, copy thresholds.

`LaneConfig` is frozen and hashable so the compiled round can take it as a static argument; each field
change is a recompile.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LaneConfig:
    """Lane capacity and round shape; `width` rows per lane per round = 1 pending + proposals; `rounds` rounds
    run by one call of the compiled round (one dispatch and one fetch for them all)."""

    capacity: int
    width: int
    context: int
    enter_match: int = 5
    long_match: int = 20
    page_size: int = 16
    rounds: int = 1

    def __post_init__(self) -> None:
        for name in ("capacity", "width", "context", "enter_match", "long_match", "page_size", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"LaneConfig.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"LaneConfig.{name}={value} must be >= 1")
        if self.long_match < self.enter_match:
            raise ValueError(
                f"LaneConfig long_match={self.long_match} must be >= enter_match={self.enter_match}"
            )
        if self.width > self.context:
            raise ValueError(f"LaneConfig width={self.width} must be <= context={self.context}")

    @property
    def max_proposals(self) -> int:
        """Proposals verified per lane per round (the pending token takes the first row)."""
        return self.width - 1

    @property
    def pages_per_lane(self) -> int:
        """KV pages a lane needs to hold `context` tokens."""
        return -(-self.context // self.page_size)
