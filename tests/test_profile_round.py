"""scripts/profile_round.py reads device kernels out of a Perfetto trace and sums them per round."""

from __future__ import annotations

from scripts.profile_round import device_events, summarize


def _trace():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    host = [{"ph": "X", "pid": 1, "name": "PjitFunction(lane_round)", "dur": 9000.0}]
    gpu = [{"ph": "X", "pid": 7, "name": "fusion_1", "dur": 30.0} for _ in range(4)]
    gpu += [{"ph": "X", "pid": 7, "name": "qmatmul_tiled", "dur": 100.0} for _ in range(2)]
    return {"traceEvents": meta + host + gpu}


def test_device_tracks_are_preferred_over_the_host():
    names = sorted({e["name"] for e in device_events(_trace())})
    assert names == ["fusion_1", "qmatmul_tiled"]


def test_kernels_are_summed_per_round_and_ranked_by_time():
    text = summarize(device_events(_trace()), rounds=2, wall_s=0.01)
    lines = text.splitlines()
    assert "5.00 ms wall a round" in lines[0] and "device busy 0.16 ms a round (3%)" in lines[0]
    assert "3 kernels a round" in lines[0]
    assert lines[3] == "| qmatmul_tiled | 1.0 | 100.0 | 62.5% |"
    assert lines[4] == "| fusion_1 | 2.0 | 60.0 | 37.5% |"


def test_a_cpu_trace_has_no_device_kernels():
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["pid"] == 1]
    assert device_events(trace) == []
