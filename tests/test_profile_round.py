"""`tfjax.profiling` reads device kernels out of a Perfetto trace and sums them per round; traced and compiled launch counts."""

from __future__ import annotations

from tfjax.profiling import device_events, host_api_calls, latest_events, summarize


def _trace():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    host = [{"ph": "X", "pid": 1, "name": "PjitFunction(lane_round)", "dur": 9000.0}]
    host += [{"ph": "X", "pid": 1, "name": "cuLaunchKernelEx", "dur": 4.0} for _ in range(6)]
    host += [{"ph": "X", "pid": 1, "name": "cuGraphLaunch", "dur": 20.0}]
    gpu = [{"ph": "X", "pid": 7, "name": "fusion_1", "dur": 30.0} for _ in range(4)]
    gpu += [{"ph": "X", "pid": 7, "name": "qmatmul_tiled", "dur": 100.0} for _ in range(2)]
    return {"traceEvents": meta + host + gpu}


def test_device_tracks_are_preferred_over_the_host():
    names = sorted({e["name"] for e in device_events(_trace())})
    assert names == ["fusion_1", "qmatmul_tiled"]


def test_the_newest_trace_under_a_folder_is_read(tmp_path):
    import gzip
    import json
    import os

    old, new = tmp_path / "a" / "old.trace.json.gz", tmp_path / "b" / "new.trace.json.gz"
    for path, trace in ((old, {"traceEvents": []}), (new, _trace())):
        path.parent.mkdir()
        path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    os.utime(old, (1, 1))
    assert sorted({e["name"] for e in latest_events(tmp_path)}) == ["fusion_1", "qmatmul_tiled"]


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


def test_a_round_with_kernels_loops_only_over_logprob_rows_and_has_one_kernel_per_norm(monkeypatch):
    """With the GPU dispatch forced (tracing only), a 4-bit llama round's norms are kernels, not tile loops, and
    its fused projections leave 4 matmuls a layer."""
    import jax

    from tests.test_dflash2 import TARGET
    from tfjax import models, ops
    from tfjax.config import QuantConfig
    from tfjax.engine.runner import Runner
    from tfjax.lanes import round as lane_round
    from tfjax.lanes.config import LaneConfig
    from tfjax.models.layers import fuse_projections, use_kernel_layout
    from tfjax.profiling import structure

    monkeypatch.setattr(ops, "_FORCE", "kernel")
    config = TARGET.replace(quantization=QuantConfig(4, 32), num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    target = models.build(config, seed=3)  # head dim 64: the attention kernel takes it
    fuse_projections(target)
    use_kernel_layout(target)
    runner = Runner(target, LaneConfig(capacity=2, width=4, context=64, page_size=16))

    def count():
        r = runner
        return structure(lane_round.lane_round.trace(r.target_def, r.target_params, None, None, r.state,
                                                     r.spec).jaxpr)

    layers = TARGET.num_hidden_layers
    got = count()
    # per layer: 2 norms, qkv, o, gate/up, down, attention; then the final norm and the (tied, 4-bit) lm_head; the one
    # loop is logprobs' row loop (`sampling.logprobs`, one row [V] an iteration), inside the cond that runs it only
    # when a lane asks for logprobs
    assert got["loops"] == 1 and got["pallas_call"] == 7 * layers + 2, got
    jax.clear_caches()  # no trace made with the GPU dispatch forced outlives the test


def test_a_mosaic_gpu_kernel_counts_as_one_launch_and_its_pipeline_as_no_loop(monkeypatch):
    """`plgpu.kernel` traces to `mpmd_map`, not `pallas_call`: its in-kernel pipeline is not an XLA loop."""
    import jax
    import jax.numpy as jnp

    from tfjax import ops, quant
    from tfjax.profiling import structure

    monkeypatch.setattr(ops, "_FORCE", "kernel")
    words = jnp.zeros((128, 1024 // 8), jnp.uint32)
    packed = quant.pack_scale_bias(jnp.ones((16, 128), jnp.bfloat16), jnp.ones((16, 128), jnp.bfloat16))
    f = lambda x: ops.qmatmul(x, words, packed, None, bits=4, group_size=64, rows=True, layout="pairs")  # noqa: E731
    got = structure(jax.make_jaxpr(f)(jnp.ones((2, 1024), jnp.bfloat16)).jaxpr)
    assert got["pallas_call"] == 1 and got["loops"] == 0, got


HLO = """HloModule step

%fused_add (p0: f32[4], p1: f32[4]) -> f32[4] {
  ROOT %add.1 = f32[4]{0} add(f32[4]{0} %p0, f32[4]{0} %p1)
}

ENTRY %main (a: f32[4], b: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %loop_add_fusion.7 = f32[4]{0} fusion(f32[4]{0} %a, f32[4]{0} %b), kind=kLoop, calls=%fused_add
  %bitcast.2 = f32[2,2]{1,0} bitcast(f32[4]{0} %loop_add_fusion.7)
  %custom-call.3 = f32[4]{0} custom-call(f32[4]{0} %a), custom_call_target="mosaic_gpu_v2"
  %copy.1 = f32[4]{0} copy(f32[4]{0} %custom-call.3)
  ROOT %tuple.9 = (f32[4]{0}, f32[4]{0}) tuple(f32[4]{0} %loop_add_fusion.7, f32[4]{0} %copy.1)
}
"""


def test_compiled_launches_counts_the_entry_computations_kernels_in_order():
    """Fusions, custom calls and copies launch; parameters, bitcasts and tuples do not; a fused computation's
    own instructions are not the entry's."""
    from tfjax.profiling import compiled_launches

    got = compiled_launches(HLO)
    assert got["names"] == ["loop_add_fusion.7", "custom-call.3", "copy.1"]
    assert got["kinds"] == {"fusion kLoop": 1, "custom-call mosaic_gpu_v2": 1, "copy": 1} and got["launches"] == 3


def test_compiled_launches_reads_a_module_xla_compiled_here():
    import jax
    import jax.numpy as jnp

    from tfjax.profiling import compiled_launches

    x = jnp.ones((8, 8))
    hlo = jax.jit(lambda x: jnp.sort(jnp.sin(x) @ x, axis=0)).lower(x).compile().as_text()
    got = compiled_launches(hlo)
    assert got["launches"] == len(got["names"]) == sum(got["kinds"].values()) >= 2
    assert not {"parameter", "tuple", "bitcast"} & set(got["kinds"])


def test_host_cuda_calls_are_counted_per_round_and_device_tracks_left_out():
    lines = host_api_calls(_trace(), rounds=2).splitlines()
    assert lines[2:] == ["| cuLaunchKernelEx | 3.0 | 12.0 |", "| cuGraphLaunch | 0.5 | 10.0 |"]
    assert host_api_calls({"traceEvents": []}, rounds=1) == "no host CUDA calls in the trace"


def test_other_host_events_are_counted_apart_from_cuda_calls():
    lines = host_api_calls(_trace(), rounds=2, cuda=False).splitlines()
    assert lines[2:] == ["| PjitFunction(lane_round) | 0.5 | 4500.0 |"]
