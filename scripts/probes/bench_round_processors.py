"""Does the processors' code cost a round where no lane uses it? SmolLM2, 2 lanes, interleaved (median of 5).

Times `lane_round` compiled without the processors (`RoundSpec.processors=False`, what the runner dispatches
while no live lane uses them) against compiled with them but unused.
`python scripts/probes/bench_round_processors.py [MODEL]` (a packaged name, folder or hub id; default smollm2)
"""

from __future__ import annotations

import statistics
import sys

from tfjax import api, profiling, sampling


def main() -> None:
    llm = api.load(sys.argv[1] if len(sys.argv) > 1 else "smollm2", lanes=2, width=6, context=1024, copy_match=3)
    runner = llm.engine.runner
    for lane in range(2):
        runner.prefill(lane, llm.encode(f"Count to {lane + 20}: 1, 2, 3"), sampling.SamplingParams.create(1), True,
                       list(range(lane * runner.lanes.pages_per_lane, (lane + 1) * runner.lanes.pages_per_lane)))

    def rounds(traced: bool) -> float:
        runner.processed = {0} if traced else set()  # as if lane 0 used them: the round traces the processors
        return profiling.round_ms(runner)

    times = {"absent": [], "present, unused": []}
    for _ in range(5):
        times["absent"].append(rounds(False))
        times["present, unused"].append(rounds(True))
    for name, ts in times.items():
        print(f"{name:16s} {statistics.median(ts):7.2f} ms/round (spread {max(ts) - min(ts):.2f})")


if __name__ == "__main__":
    main()
