"""The Python API: `tfjax.load(name_or_path)` and `model.generate(...)`, every token through the lane rounds."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from tfjax import checkpoint, grammar, ops, sharding
from tfjax.engine import Engine, Request, Result
from tfjax.engine.runner import compile_all
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts
from tfjax.models.layers import fuse_projections, serving_layout, use_int8
from tfjax.tokenizer import Tokenizer

PREFIX_CACHE_GB = 2.0  # device memory for cached prompt prefixes beyond the lanes' own pages (0: off)
ROUNDS = {"gpu": 4}  # backend -> lane rounds a call runs by default, where measurement chose more than 1 (docs/benchmarks.md)
QUANTIZE = ("none", "int8")  # "int8": dense weights requantized per channel, activations per row (`tfjax.int8`)


@dataclasses.dataclass
class Generation:
    """A reply: text, token ids, their sha256, and how the rounds went."""

    text: str
    token_ids: list[int]
    token_sha256: str
    finish_reason: str
    tokens_per_round: float
    prompt_tokens: int
    error: str | None = None  # what ended the reply when finish_reason is "error"
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache instead of prefilled
    logprobs: list[float] | None = None  # per token, when asked (`logprobs=True` or `top_logprobs`)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob), most likely first
    ttft_s: float | None = None  # seconds from submit to the first token (queueing and prefill)
    decode_s: float | None = None  # seconds from the first token to the last

    @property
    def decode_tok_s(self) -> float | None:
        """Decode speed after the first token, as a streaming client sees it (None under two tokens)."""
        if self.decode_s is None or self.decode_s <= 0 or len(self.token_ids) < 2:
            return None
        return (len(self.token_ids) - 1) / self.decode_s


# Sampling fields a checkpoint's generation_config.json may set for requests that leave them out (as vLLM does),
# and the API's own defaults where it does not: greedy.
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def resolve(name_or_path: str | Path, weights: bool = True) -> Path:
    """A checkpoint folder: a path, a packaged model (fetched and converted once) or a Hugging Face hub id."""
    from tfjax import hub

    return hub.resolve(name_or_path, weights)


def generation_defaults(path: Path) -> dict:
    """The sampling values the checkpoint's generation_config.json names (a subset of SAMPLING_DEFAULTS' keys)."""
    import json

    file = Path(path) / "generation_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except ValueError:
        config = {}
    kinds = {"temperature": float, "top_k": int, "top_p": float, "min_p": float}
    return {k: kinds[k](v) for k, v in config.items() if k in kinds and isinstance(v, int | float)}


def default_rounds() -> int:
    """Lane rounds a call runs by default: set by measurement on each backend (docs/benchmarks.md, "rounds")."""
    import jax

    return ROUNDS.get(jax.default_backend(), 1)


class LLM:
    """A loaded target (and optional drafter) behind an engine with `lanes` lanes."""

    def __init__(self, path: Path, *, drafter: str | Path | None = None, lanes: int = 4, width: int = 8,
                 context: int = 2048, copy_match: int = 0, copies: bool = True, dtype: str | None = None,
                 model=None, prefix_cache_gb: float = PREFIX_CACHE_GB, tp: int | None = None, dp: int = 1,
                 prefill_chunk: int | None = None, quantize: str = "none", rounds: int | None = None):
        self.path = path
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize={quantize!r} is not one of {', '.join(QUANTIZE)}")
        if quantize != "none" and tp is not None:
            raise ValueError(f"quantize={quantize!r} does not run tensor parallel yet: leave out tp")
        # tp: tensor parallel over a (data=dp, model=tp) mesh, exact across tp (`tfjax.sharding`); None: one device
        mesh = sharding.serving_mesh(tp, dp, lanes)
        # `model`: an already built (module, config) for this folder's tokenizer, e.g. random weights for timing
        self.model, self.config = model if model is not None else checkpoint.load(path, dtype=dtype, progress=True,
                                                                                  mesh=mesh)
        self.tokenizer = Tokenizer.from_dir(path)
        self.generation_defaults = generation_defaults(path)  # what a request that is silent on them gets
        draft_model = None
        if drafter is not None:
            from tfjax.drafters import dflash2_checkpoint

            draft_path = resolve(drafter)
            if dflash2_checkpoint.is_dflash(draft_path):  # a block drafter: checked against this target
                draft_model = dflash2_checkpoint.load(draft_path, dtype=dtype, target=self.config)
            else:
                draft_model, _ = checkpoint.load(draft_path, dtype=dtype, progress=True)
        kernels = ops.Kernels.default()  # the GPU's kernels, else the references: static, in each model's graphdef
        for m in (self.model, draft_model):
            if m is None:
                continue
            m.kernels = kernels
            if mesh is not None and m is self.model:  # fixed blocks and chunks in the MLX layout (no fusion, no repack)
                sharding.shard_model(m, mesh)
                continue
            if kernels.pallas:  # the GPU serving layout, once here: fused projections, kernel packing
                serving_layout(m)
            if quantize == "int8":  # siblings fused first (one quantization of their input; bit-identical)
                fuse_projections(m)
                use_int8(m)
            if mesh is not None:  # a drafter stays whole on every device: its proposals never change the tokens
                sharding.replicate(m, mesh)
        # rounds: lane rounds one compiled call runs (None: the backend's measured default, `default_rounds`)
        self.lanes = LaneConfig(capacity=lanes, width=width, context=context,
                                rounds=default_rounds() if rounds is None else rounds)
        eos = tuple(self.tokenizer.eos_ids) or self.config.eos_token_id
        self.grammars = grammar.Grammars(self.tokenizer, eos, self.config.vocab_size)  # response_format
        self.engine = Engine(self.model, self.lanes, drafter=draft_model, eos_ids=eos, prefix_cache_gb=prefix_cache_gb,
                             prefill_chunk=prefill_chunk)  # None: the platform's (`runner.default_prefill_chunk`)
        if copy_match or not copies:  # copy_match replaces the merged facts' match; copies=False turns them off
            facts = self.engine.runner.spec.facts
            self.engine.runner.set_facts(RoundFacts(copy_match=(copy_match or facts.copy_match) if copies else 0,
                                                    draft_block=facts.draft_block))

    def precompile(self, workers: int | None = None) -> int:
        """Compile every lane bucket's round, every prompt call's program and the small programs around a prompt now
        (a server does before it listens), so no first request of a shape stalls the lanes: how many programs.
        `workers`: threads compiling at once (default: `runner.compile_workers()`)."""
        runner = self.engine.runner
        return compile_all(itertools.chain(runner.lower_rounds(), runner.lower_prompts(), runner.lower_admission()),
                           workers)

    def encode(self, prompt: str | list[dict] | list[int], chat: bool | None = None) -> list[int]:
        """Token ids of a prompt string, of chat messages rendered with the checkpoint's template, or ids as given."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list):  # the template writes any BOS itself
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt), add_special_tokens=False)
        return self.tokenizer.encode_prompt(prompt)

    def sampling(self, **given) -> dict:
        """temperature/top_k/top_p/min_p: as given, else the checkpoint's generation_config.json, else greedy."""
        return {k: v if (v := given.get(k)) is not None else self.generation_defaults.get(k, d)
                for k, d in SAMPLING_DEFAULTS.items()}

    def request(self, prompt, *, max_tokens: int = 128, temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None, seed: int | None = None,
                stop: list[str] | None = None, draft: bool = True, ignore_eos: bool = False, on_tokens=None,
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                logit_bias: dict[int, float] | None = None, logprobs: bool = False, top_logprobs: int = 0,
                response_format: dict | None = None, regex: str | None = None, on_logprobs=None) -> Request:
        """One engine request. `response_format` (OpenAI's) or `regex` (outlines-core syntax, e.g. tool calls')
        constrains the output; `on_tokens` / `on_logprobs` get each round's kept tokens and their logprobs."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        ids = self.encode(prompt)
        knobs = self.sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        if regex is not None and response_format not in (None, {"type": "text"}):
            raise ValueError("give response_format or regex, not both")
        token_grammar = self.grammars.compile_regex(regex) if regex is not None else self.grammars.compile(response_format)
        stop_check = None
        if stop:
            def stop_check(out: list[int], stops=tuple(stop)) -> int | None:
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                hits = [text.find(s) for s in stops if s in text]
                if not hits:
                    return None
                cut = min(hits)
                n = len(out)
                while n > 0 and len(self.tokenizer.decode(out[:n], skip_special_tokens=True)) > cut:
                    n -= 1
                return n
        args = dict(prompt=ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    seed=seed, stop=stop, draft=draft, ignore_eos=ignore_eos, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, logit_bias=logit_bias,
                    logprobs=logprobs, top_logprobs=top_logprobs, response_format=response_format, regex=regex)
        return Request(ids, max_tokens=max_tokens, **knobs, seed=seed, draft=draft, ignore_eos=ignore_eos,
                       stop_check=stop_check, on_tokens=on_tokens, on_logprobs=on_logprobs,
                       presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                       logit_bias=logit_bias, logprobs=logprobs, top_logprobs=top_logprobs, grammar=token_grammar,
                       args=args)

    def _reply(self, r: Result) -> Generation:
        return Generation(self.tokenizer.decode(r.token_ids, skip_special_tokens=True), r.token_ids, r.token_sha256,
                          r.finish_reason, r.tokens_per_round, r.prompt_tokens, r.error, cached_tokens=r.cached_tokens,
                          logprobs=r.logprobs, top_logprobs=r.top_logprobs, ttft_s=r.ttft_s, decode_s=r.decode_s)

    def generate(self, prompt: str | list[dict], **kw) -> Generation:
        """Generate for one prompt (text, or chat messages)."""
        return self.generate_many([prompt], **kw)[0]

    def generate_many(self, prompts: list, **kw) -> list[Generation]:
        """Generate for several prompts at once, as concurrent lanes."""
        return [self._reply(r) for r in self.engine.run([self.request(p, **kw) for p in prompts])]


def load(name_or_path: str | Path, **kw) -> LLM:
    """Load a checkpoint folder, a packaged model name (`smollm2`, ...) or a Hugging Face hub id (`org/name`)."""
    from tfjax import compile_cache

    compile_cache.enable()
    sharding.serving_mesh(kw.get("tp"), kw.get("dp", 1), kw.get("lanes", 4))  # a bad mesh is refused before a download
    return LLM(resolve(name_or_path, weights=kw.get("model") is None), **kw)  # `model`: weights already built
