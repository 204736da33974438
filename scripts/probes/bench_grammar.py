"""Grammar libraries on SmolLM2's vocabulary: schema compile time and per-token mask cost (median of 3)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from tfjax import packaged
from tfjax.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                            "age": {"type": "integer"}, "tags": {"type": "array",
                                                                                  "items": {"type": "string"}}},
          "required": ["name", "age"]}
TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}'


def timed(fn, n=3):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times), max(times) - min(times)


def main() -> None:
    path = packaged.ensure_converted("smollm2")
    tok = Tokenizer.from_dir(path)
    ids = tok.encode(TEXT)
    import outlines_core as oc

    from tfjax import grammar

    vocab, v_s, _ = timed(lambda: grammar.outlines_vocabulary(tok, tok.eos_ids[0]), 1)
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index, c_med, c_spread = timed(lambda: oc.Index(regex, vocab))
    trans = index.get_transitions()
    states = len(trans)
    (table, _), t_med, t_spread = timed(lambda: grammar.dense_table(index, tok.vocab_size))

    def walk():
        s = index.get_initial_state()
        for t in ids:
            np.asarray(index.get_allowed_tokens(s))
            s = index.get_next_state(s, t)
    _, w_med, _ = timed(walk)
    print(f"outlines-core: vocabulary {v_s:.2f} s, Index {c_med:.2f} s (spread {c_spread:.2f}), {states} states, "
          f"dense table {t_med:.2f} s {table.nbytes / 1e6:.0f} MB, host mask {w_med / len(ids) * 1e3:.2f} ms/token")
    import xgrammar as xg
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size)
    compiler = xg.GrammarCompiler(info, cache_enabled=False)
    compiled, x_med, x_spread = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    bitmask = xg.allocate_token_bitmask(1, info.vocab_size)

    def walk_x():
        m = xg.GrammarMatcher(compiled)
        for t in ids:
            m.fill_next_token_bitmask(bitmask)
            assert m.accept_token(t)
    _, xw_med, _ = timed(walk_x)
    print(f"xgrammar: compile {x_med:.3f} s (spread {x_spread:.3f}), host mask {xw_med / len(ids) * 1e3:.3f} ms/token; "
          "a pushdown automaton (stack), no finite token-level table to put on the device")


if __name__ == "__main__":
    sys.exit(main())
