"""The `tfjax` command: help, refusals as one line on stderr (exit 2), generate and chat on a tiny model."""

from __future__ import annotations

import inspect
import io
import json
from types import SimpleNamespace

import pytest

from tfjax import api, cli


def run(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `tfjax ARGV` in this process; argparse's refusals exit too."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_clear_line(err: str) -> str:
    """The error line (after any progress bars, which redraw with carriage returns), the only one."""
    assert "Traceback" not in err
    bars = ("it/s]", "tensor/s]", "s/it]", "s/tensor]")  # a slow load's bar reads "1.31s/tensor]"
    lines = [line for line in err.splitlines() if line.strip() and not any(b in line for b in bars)]
    assert len(lines) == 1 and lines[0].startswith("tfjax "), err
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer (and chat template)."""
    from tests.helpers import make_tiny_llama_with_tokenizer
    from tfjax import packaged

    return make_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny") / "tiny",
                                          packaged.ensure_converted("smollm2"))


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return api.load(tiny, lanes=1, context=256)


def test_generate_help_lists_packaged_models_every_flag_and_its_default(capsys):
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0
    for text in ("smollm2", "qwen2.5-coder-0.5b", "org/name", "--min-p", "--no-draft", "(default: 64)",
                 "(default: 2048)"):
        assert text in out, text
    flags = [a for a in cli.parser()._subparsers._group_actions[0].choices["generate"]._actions if a.option_strings]
    assert all(a.help for a in flags)


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_max_tokens_below_one_is_refused_before_loading(capsys, value):
    code, _, err = run(capsys, "generate", "no-such-model", "hi", "--max-tokens", value)
    assert code == 2
    assert "--max-tokens" in err and "at least 1" in err and "Traceback" not in err


def test_top_p_outside_zero_one_is_refused(capsys):
    code, _, err = run(capsys, "generate", "smollm2", "hi", "--top-p", "1.5")
    assert code == 2 and "--top-p" in err and "[0, 1]" in err


@pytest.mark.parametrize("argv,says", [
    (["generate", "smollm2", "hi", "--tp", "3"], "tp=3 is not a divisor of 8"),
    (["serve", "smollm2", "--tp", "4", "--dp", "4"], "tp=4 x dp=4 asks for 16 devices"),
    (["serve", "smollm2", "--dp", "3", "--parallel", "4"], "dp=3 does not divide the 4 lanes"),
])
def test_a_mesh_the_machine_cannot_take_is_one_line_before_loading(capsys, monkeypatch, argv, says):
    monkeypatch.setattr(api, "resolve", lambda *a, **k: pytest.fail("resolved a model for a bad mesh"))
    code, _, err = run(capsys, *argv)
    assert code == 2 and says in one_clear_line(err), err


@pytest.mark.parametrize("value", ["0", "two"])
def test_tp_below_one_is_refused_by_the_parser(capsys, value):
    code, _, err = run(capsys, "generate", "no-such-model", "hi", "--tp", value)
    assert code == 2 and "--tp" in err and "at least 1" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,want", [(["generate", "m", "hi", "--tp", "2"], (2, 1)),
                                       (["chat", "m", "--tp", "4"], (4, 1)),
                                       (["serve", "m", "--tp", "2", "--dp", "2"], (2, 2)),
                                       (["serve", "m"], (None, 1))])
def test_tp_and_dp_reach_tfjax_load_under_the_same_names(monkeypatch, argv, want):
    seen = {}
    monkeypatch.setattr(api, "load", lambda model, **kw: seen.update(kw))
    cli._load(cli.parser().parse_args(argv), lanes=4)
    assert (seen["tp"], seen["dp"]) == want


@pytest.mark.parametrize("argv,want", [(["generate", "m", "hi", "--quantize", "int8"], "int8"),
                                       (["serve", "m", "--quantize", "int8"], "int8"), (["chat", "m"], "none")])
def test_quantize_reaches_tfjax_load_under_the_same_name(monkeypatch, argv, want):
    seen = {}
    monkeypatch.setattr(api, "load", lambda model, **kw: seen.update(kw))
    cli._load(cli.parser().parse_args(argv), lanes=4)
    assert seen["quantize"] == want


@pytest.mark.parametrize("argv,want", [(["generate", "m", "hi", "--rounds", "4"], 4), (["serve", "m", "--rounds", "2"], 2),
                                       (["chat", "m"], None)])
def test_rounds_reach_tfjax_load_under_the_same_name(monkeypatch, argv, want):
    seen = {}
    monkeypatch.setattr(api, "load", lambda model, **kw: seen.update(kw))
    cli._load(cli.parser().parse_args(argv), lanes=4)
    assert seen["rounds"] == want


def test_rounds_give_the_api_the_replies_of_one_round_a_call(tiny, tiny_llm):
    four = api.load(tiny, lanes=2, context=256, rounds=4)
    assert (four.lanes.rounds, tiny_llm.lanes.rounds) == (4, 1)
    prompts = ["The capital of France is", "One, two, three,"]
    kw = dict(max_tokens=11, temperature=0.8, seed=5)
    assert [g.token_ids for g in four.generate_many(prompts, **kw)] == \
        [tiny_llm.generate(p, **kw).token_ids for p in prompts]


def test_rounds_below_one_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parser().parse_args(["generate", "m", "hi", "--rounds", "0"])
    assert e.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_an_unknown_quantize_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parser().parse_args(["generate", "m", "hi", "--quantize", "int4"])
    assert e.value.code == 2 and "int4" in capsys.readouterr().err


@pytest.mark.parametrize("argv,want", [
    (["--coordinator", "host0:1234", "--num-processes", "2", "--process-id", "1"], ("host0:1234", 2, 1)),
    (["--distributed"], (None, None, None)),  # JAX reads JAX_COORDINATOR_ADDRESS, ... or the cluster's environment
    ([], None)])
def test_multi_host_flags_join_the_run_before_the_model_loads(monkeypatch, argv, want):
    from tfjax import sharding

    order = []
    monkeypatch.setattr(sharding, "initialize_distributed", lambda *a: order.append(("join", a)))
    monkeypatch.setattr(api, "load", lambda model, **kw: order.append(("load", kw["tp"])))
    cli._load(cli.parser().parse_args(["generate", "m", "hi", "--tp", "2", *argv]), lanes=1)
    assert order == ([] if want is None else [("join", want)]) + [("load", 2)]


@pytest.mark.parametrize("argv,says", [
    (["serve", "m", "--num-processes", "2", "--process-id", "2"], "process_id=2 is not in 0..1"),
    (["chat", "m", "--coordinator", "h:1", "--process-id", "0"], "both num_processes and process_id"),
    (["generate", "m", "hi", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     "process_id=2 is not in 0..1"),
    (["generate", "m", "hi", "--coordinator", "h:1", "--num-processes", "2"], "both num_processes and process_id")])
def test_a_multi_host_run_the_command_cannot_take_is_one_line(capsys, monkeypatch, argv, says):
    import jax

    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("joined a run it should refuse"))
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("loaded a model for a refused run"))
    if argv[0] == "serve":
        pytest.importorskip("uvicorn")
    code, _, err = run(capsys, *argv)
    assert code == 2 and says in one_clear_line(err), err


@pytest.mark.parametrize("process", [0, 1])
def test_a_multi_host_serve_serves_on_process_0_and_follows_elsewhere(monkeypatch, process):
    """Process 0 runs the HTTP app with a lockstep leader (its engine steps are broadcast); another process runs
    the same engine steps without HTTP, until process 0 stops."""
    pytest.importorskip("uvicorn")
    import jax
    import uvicorn

    from tfjax import server, sharding
    from tfjax.engine import lockstep

    did = []
    llm = SimpleNamespace(engine=object(), precompile=lambda: did.append("precompile"))
    monkeypatch.setattr(sharding, "initialize_distributed", lambda *a: did.append("join"))
    monkeypatch.setattr(api, "load", lambda model, **kw: llm)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(lockstep, "Channel", lambda: "channel")
    monkeypatch.setattr(lockstep, "follow", lambda got, channel: did.append(("follow", got is llm, channel)))
    monkeypatch.setattr(server, "create_app", lambda got, **kw: did.append(("app", type(kw["lockstep"]).__name__)))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: did.append("http"))
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a follower's _load sends its stdout to devnull
    assert cli.main(["serve", "m", "--coordinator", "h:1", "--num-processes", "2", "--process-id", str(process)]) == 0
    assert did == (["join", "precompile", ("app", "Leader"), "http"] if process == 0
                   else ["join", "precompile", ("follow", True, "channel")]), did


def test_a_follower_that_diverged_is_one_line(capsys, monkeypatch):
    pytest.importorskip("uvicorn")
    import jax

    from tfjax import sharding
    from tfjax.engine import lockstep

    def diverge(llm, channel):
        raise lockstep.Diverged("this process's engine differs from process 0's before step 3")

    monkeypatch.setattr(sharding, "initialize_distributed", lambda *a: None)
    monkeypatch.setattr(api, "load", lambda model, **kw: SimpleNamespace(engine=None, precompile=lambda: 0))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(lockstep, "Channel", lambda: None)
    monkeypatch.setattr(lockstep, "follow", diverge)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    code, _, err = run(capsys, "serve", "m", "--distributed")
    assert code == 2 and "differs from process 0's before step 3" in one_clear_line(err)
    assert "unexpected" not in err


def test_convert_of_a_file_that_is_not_gguf_fails_and_writes_nothing(capsys, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    code, out, err = run(capsys, "convert", str(readme), str(tmp_path / "x"))
    assert code == 2 and out == ""
    assert "neither a .gguf file nor a checkpoint folder" in one_clear_line(err)
    assert not (tmp_path / "x").exists()


def test_convert_of_a_missing_path_says_so(capsys, tmp_path):
    code, _, err = run(capsys, "convert", str(tmp_path / "nope.gguf"), str(tmp_path / "x"))
    assert code == 2 and "does not exist" in one_clear_line(err)


def test_unknown_model_name_lists_what_would_work(capsys):
    code, _, err = run(capsys, "generate", "no-such-model", "hi")
    line = one_clear_line(err)
    assert code == 2 and "'no-such-model'" in line and "smollm2" in line and "Hugging Face id" in line


def test_folder_without_config_json_is_refused(capsys, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    code, _, err = run(capsys, "generate", str(tmp_path), "hi")
    assert code == 2 and "has no config.json" in one_clear_line(err)


def test_folder_with_broken_safetensors_is_refused(capsys, tmp_path, tiny):
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not a header}  " + b"\1" * 64)
    code, _, err = run(capsys, "generate", str(tmp_path), "hi")
    line = one_clear_line(err)
    assert code == 2 and "not a readable safetensors file" in line and "re-download" in line


def test_prompt_longer_than_the_context_says_which_option_to_raise(capsys, tiny):
    code, _, err = run(capsys, "generate", str(tiny), "word " * 300, "--context", "128", "--max-tokens", "8")
    line = one_clear_line(err)
    assert code == 2 and "raise --context to at least" in line and "round" not in line


def test_generate_streams_the_text_the_api_returns(capsys, monkeypatch, tiny, tiny_llm):
    monkeypatch.setattr(cli, "_load", lambda args, lanes, width=8: tiny_llm)
    expected = tiny_llm.generate("Once upon a time", max_tokens=6)
    code, out, err = run(capsys, "generate", str(tiny), "Once upon a time", "--max-tokens", "6")
    assert code == 0
    assert out == "Once upon a time" + expected.text + "\n"
    assert f"token_sha256={expected.token_sha256}" in err


def test_chat_keeps_the_history_streams_replies_and_stops_at_exit(monkeypatch, tiny, tiny_llm):
    monkeypatch.setattr(cli, "_load", lambda args, lanes, width=8: tiny_llm)
    seen = []
    encode = tiny_llm.encode

    def record(prompt):
        if prompt and isinstance(prompt[0], dict):  # chat messages (not the ids llm.request passes on)
            seen.append(prompt)
        return encode(prompt)

    monkeypatch.setattr(tiny_llm, "encode", record)
    args = cli.parser().parse_args(["chat", str(tiny), "--max-tokens", "4", "--system", "Be brief."])
    stdout = io.StringIO()
    assert cli.chat(args, io.StringIO("hello\n\nand again\n/exit\nnever read\n"), stdout) == 0
    assert [m[-1]["content"] for m in seen] == ["hello", "and again"]
    first_reply = seen[1][2]
    assert seen[1][0] == {"role": "system", "content": "Be brief."} and first_reply["role"] == "assistant"
    assert stdout.getvalue().startswith(first_reply["content"] + "\n")
    # End of input ends the REPL too; /reset forgets the conversation.
    seen.clear()
    assert cli.chat(args, io.StringIO("/reset\nhi"), io.StringIO()) == 0
    assert seen == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]]


def test_a_multi_host_chat_on_process_0_broadcasts_each_turn_then_stops(monkeypatch, tiny, tiny_llm):
    """Process 0 of a multi-host chat runs each turn through a lockstep leader: what it broadcasts makes a follower
    submit the same prompts and step as often, and its end of input stops the follower."""
    import collections

    import jax
    import numpy as np

    from tfjax.engine import lockstep

    sent = collections.deque()
    monkeypatch.setattr(cli, "_load", lambda args, lanes, width=8: tiny_llm)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    channel = lockstep.Channel
    monkeypatch.setattr(lockstep, "Channel", lambda: channel(lambda a: sent.append(np.array(a)) or a))
    steps, submitted = [], []
    monkeypatch.setattr(tiny_llm.engine, "step", lambda step=tiny_llm.engine.step: steps.append(1) or step())
    monkeypatch.setattr(lockstep, "fingerprint", lambda engine: 0)  # the fake follower below keeps no scheduler
    args = cli.parser().parse_args(["chat", str(tiny), "--max-tokens", "3", "--num-processes", "2", "--process-id",
                                    "0", "--coordinator", "h:1"])
    assert cli.chat(args, io.StringIO("hello\nand again\n"), io.StringIO()) == 0
    follower = SimpleNamespace(request=lambda prompt, **kw: SimpleNamespace(id=None, prompt=prompt),
                               engine=SimpleNamespace(submit=lambda r: submitted.append(r.prompt), cancel=None,
                                                      step=lambda: None))
    assert lockstep.follow(follower, channel(lambda a: sent.popleft())) == len(steps) > 0 and not sent
    assert len(submitted) == 2 and submitted[1][: len(submitted[0])] == submitted[0]  # the second turn's history


def test_serve_options_are_the_apps_keyword_arguments():
    args = cli.parser().parse_args(["serve", "smollm2", "--api-key", "k", "--allowed-origins", "http://a", "*",
                                    "--max-body-mb", "4", "--served-model-name", "a", "b", "--no-draft",
                                    "--queue", "3", "--max-tokens", "9"])
    kw = cli.serve_options(args)
    assert kw == {"name": "a", "queue": 3, "max_tokens": 9, "drafts": False, "api_key": "k",
                  "allowed_origins": ("http://a", "*"), "max_body_mb": 4, "served_model_names": ("a", "b")}
    assert cli.serve_options(cli.parser().parse_args(["serve", "m"])) == {"name": "m", "queue": 64, "max_tokens": 256,
                                                                          "drafts": True}
    from tfjax.server import create_app

    params = inspect.signature(create_app).parameters
    assert set(kw) <= set(params)


def test_scripts_serve_passes_model_as_the_positional_argument(monkeypatch):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("serve_script", Path(__file__).parents[1] / "scripts" / "serve.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls = []
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv) or 0)
    script.main(["--model", "m", "--parallel", "2"])
    script.main(["--model=m2"])
    script.main([])
    assert calls == [["serve", "m", "--parallel", "2"], ["serve", "m2"], ["serve", "smollm2"]]


def test_generation_config_fills_what_a_request_leaves_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}))
    defaults = api.generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    llm = SimpleNamespace(generation_defaults=defaults)
    assert api.LLM.sampling(llm, temperature=None, top_k=5) == {"temperature": 0.6, "top_k": 5, "top_p": 0.95,
                                                                "min_p": 0.0}
    assert api.LLM.sampling(SimpleNamespace(generation_defaults={})) == api.SAMPLING_DEFAULTS


def test_compile_cache_lives_under_the_tfjax_cache_unless_named_or_off(monkeypatch, tmp_path):
    from tfjax import compile_cache

    monkeypatch.delenv("TFJAX_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("TFJAX_CACHE", str(tmp_path))
    assert compile_cache.folder() == tmp_path / "jax"
    monkeypatch.setenv("TFJAX_COMPILE_CACHE", str(tmp_path / "elsewhere"))
    assert compile_cache.folder() == tmp_path / "elsewhere"
    monkeypatch.setenv("TFJAX_COMPILE_CACHE", "off")
    assert compile_cache.folder() is None and compile_cache.enable() is None
