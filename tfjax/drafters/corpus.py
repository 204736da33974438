"""Distillation prompts from text and code every Python install carries, split by source file.

Sources: the `.py`, `.md`, `.rst` and README files under the standard library and site-packages
(`sysconfig`). Each file gives a few prompts of four kinds, the shapes users send and the benchmarks measure:
  code  a function's signature and docstring, raw text (the target writes the body),
  edit  a function, then the same function with one local name renamed (the target copies most of it back),
  chat  an instruction about a function or a passage of documentation, rendered through the chat template,
  text  the opening of a documentation passage, raw text.

Held out: a file is held out when the sha256 of its path relative to its source root (vendored copies
reduced to their path inside the vendored package) falls in the first `held` fraction of the hash range.
That depends on the path alone, so the split is the same on every machine and Python version, whatever
other files exist; every prompt of a held-out file is held out, and a training file whose text equals a
held-out file's is dropped. Files are read in the order of a second hash of their path, so a prompt set
is a deterministic function of the source trees, `seed` and the limits.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import json
import re
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

KINDS = ("code", "edit", "chat", "text")
DOC_SUFFIXES = (".md", ".rst", ".txt")
MAX_FILE_BYTES = 200_000
SNIPPET_CHARS = 900  # a prompt's snippet stays under ~250 tokens

CODE_ASKS = (
    "Explain what this Python function does:", "Write a docstring for this function:",
    "Write a unit test for this function:", "Rewrite this function to be easier to read:",
    "Are there any bugs in this code?", "Describe the inputs and outputs of this function:",
    "Translate this function into JavaScript:", "Suggest a better name for this function and explain why:",
    "Add type hints to this function:", "Complete the following code:",
)
DOC_ASKS = (
    "Summarise this passage:", "Explain this to a beginner:", "What are the key points of the following text?",
    "Rewrite this passage in plain English:", "Write three questions a reader might ask about this text:",
)
RENAMES = ("value", "result", "item", "data", "current", "out", "acc", "tmp_value", "entry", "node")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One distillation prompt: raw `text`, or a user message to render through the chat template (`chat`)."""

    kind: str
    source: str  # root/relative path of the file it came from
    held: bool
    text: str
    chat: bool = False

    def ids(self, tokenizer) -> list[int]:
        if self.chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": self.text}])
            return tokenizer.encode(rendered, add_special_tokens=False)
        return tokenizer.encode_prompt(self.text)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def split_key(relative: str) -> str:
    """The path the split hashes: vendored copies (`pip/_vendor/x/y.py`) count as the package's own (`x/y.py`)."""
    parts = Path(relative).as_posix().split("/")
    for marker in ("_vendor", "vendored", "_vendored", "extern", "_distutils"):
        if marker in parts[:-1]:
            parts = parts[len(parts) - parts[::-1].index(marker) :]
    return "/".join(parts)


def is_held(relative: str, held: float) -> bool:
    """Whether the file at `relative` (to its source root) is held out: a function of the path alone."""
    return _digest("held:" + split_key(relative)) < held * 2**64


def source_roots() -> list[tuple[str, Path]]:
    """(name, folder) of this install's standard library and site-packages."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and all(p != r for _, r in roots):
            roots.append(("site", p))
    return roots


def _skipped(relative: str) -> bool:
    """Caches, the stdlib's own site-packages, package metadata and licence texts (the same prose many times)."""
    parts = relative.split("/")
    if "__pycache__" in parts or "site-packages" in parts or any(p.endswith((".dist-info", ".egg-info")) for p in parts):
        return True
    return parts[-1].upper().startswith(("LICENSE", "LICENCE", "COPYING", "AUTHORS", "NOTICE", "THIRD"))


def iter_files(roots: list[tuple[str, Path]], seed: int = 0) -> Iterator[tuple[str, Path]]:
    """(root/relative, path) of every source file, in the order of a hash of its relative path and `seed`."""
    found = []
    for name, root in roots:
        for path in root.rglob("*"):
            if path.suffix in (".py", *DOC_SUFFIXES) or path.name.upper().startswith("README"):
                rel = path.relative_to(root).as_posix()
                if not _skipped(rel):
                    found.append((_digest(f"order:{seed}:{rel}"), f"{name}/{rel}", path))
    found.sort()
    for _, source, path in found:
        yield source, path


def _readable(text: str) -> bool:
    lines = text.splitlines()
    return bool(lines) and max(len(line) for line in lines) <= 120 and sum(map(str.isascii, text)) >= 0.98 * len(text)


def _functions(text: str) -> list[str]:
    """Source of the module's functions and methods that fit a prompt, in file order."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    out, nodes = [], list(tree.body)
    while nodes:  # module-level functions and methods (not ast.walk: nested bodies cost 5x the parse)
        node = nodes.pop()
        if isinstance(node, ast.ClassDef):
            nodes.extend(node.body)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            src = textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno])) + "\n"
            if 3 <= src.count("\n") and len(src) <= SNIPPET_CHARS and _readable(src) and _parses(src):
                out.append((first, src))
    return [src for _, src in sorted(out)]


def _parses(src: str) -> bool:
    try:
        ast.parse(src)
    except (SyntaxError, ValueError):  # e.g. a method whose string literal sits at column 0
        return False
    return True


def _head(src: str) -> str:
    """A function's decorators, signature and docstring (or first body line): the prompt that asks for its body."""
    tree = ast.parse(src)
    fn = tree.body[0]
    body = fn.body[0]
    end = body.end_lineno if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) else body.lineno
    return "\n".join(src.splitlines()[:end]) + "\n"


def _rename(src: str, pick: int) -> tuple[str, str, str] | None:
    """(edited source, old name, new name): a local name assigned in the function and used again, renamed."""
    tree = ast.parse(src)
    stored = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    words = set(re.findall(r"\b\w+\b", src))
    names = sorted({n for n in stored if len(n) > 1 and len(re.findall(rf"\b{n}\b", src)) >= 2})
    if not names:
        return None
    old = names[pick % len(names)]
    new = next((r for r in RENAMES[pick % len(RENAMES):] + RENAMES if r not in words), None)
    return (re.sub(rf"\b{old}\b", new, src), old, new) if new else None


def python_prompts(text: str, source: str, held: bool, per_file: int, salt: int) -> list[Prompt]:
    """Up to `per_file` prompts from a Python file's functions, kinds rotating with `salt`."""
    out, fns = [], _functions(text)
    for i, src in enumerate(fns[:: max(1, len(fns) // max(per_file, 1))][:per_file]):
        kind = ("code", "chat", "edit", "chat", "code")[(salt + i) % 5]
        if kind == "code":
            out.append(Prompt("code", source, held, _head(src)))
        elif kind == "chat":
            ask = CODE_ASKS[(salt + i) % len(CODE_ASKS)]
            out.append(Prompt("chat", source, held, f"{ask}\n\n```python\n{src}```", chat=True))
        else:
            edit = _rename(src, salt + i)
            if edit is not None:
                new_src, old, new = edit
                first = new_src.splitlines(keepends=True)[0]
                out.append(Prompt("edit", source, held,
                                  f"Original:\n{src}\nThe same code with `{old}` renamed to `{new}`:\n{first}"))
    return out


def doc_passages(text: str) -> list[str]:
    """Paragraph runs of documentation text that read as prose (no tables or directives), each a prompt's size."""
    passages, cur = [], []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n")
        if not para.strip() or para.lstrip().startswith(("..", "|", "+-", "<", "```", ":")):
            continue
        cur.append(para)
        joined = "\n\n".join(cur)
        if len(joined) >= 300:
            if len(joined) <= SNIPPET_CHARS and _readable(joined) and len(re.findall(r"[A-Za-z]{3,}", joined)) >= 30:
                passages.append(joined)
            cur = []
    return passages


def _module_doc(text: str) -> str | None:
    """A module docstring long enough to be a passage (the file's opening string literal)."""
    m = re.match(r'\s*(?:#[^\n]*\n\s*)*[rRuU]?("""|\'\'\')(.*?)\1', text, re.S)
    return m.group(2) if m and len(m.group(2)) >= 300 else None


def doc_prompts(text: str, source: str, held: bool, per_file: int, salt: int) -> list[Prompt]:
    out = []
    for i, passage in enumerate(doc_passages(text)[:per_file]):
        if (salt + i) % 3 == 2:
            out.append(Prompt("text", source, held, passage[: len(passage) // 2]))
        else:
            ask = DOC_ASKS[(salt + i) % len(DOC_ASKS)]
            out.append(Prompt("chat", source, held, f"{ask}\n\n{passage}", chat=True))
    return out


def build(roots: list[tuple[str, Path]] | None = None, *, prompts: int = 4000, held: float = 0.1,
          per_file: int = 2, seed: int = 0) -> list[Prompt]:
    """About `prompts` prompts (training and held-out together) from the source trees, deterministically."""
    roots = source_roots() if roots is None else roots
    out: list[Prompt] = []
    seen: set[str] = set()
    for source, path in iter_files(roots, seed):
        if len(out) >= prompts:
            break
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:  # an identical copy of a file already read: its held-out status stays the first's
            continue
        seen.add(digest)
        relative = source.split("/", 1)[1]
        h = is_held(relative, held)
        salt = _digest(f"salt:{seed}:{relative}") % 1000
        if path.suffix == ".py":
            got = python_prompts(text, source, h, per_file, salt)
            doc = _module_doc(text)
            if doc and salt % 2:  # half the modules with a long docstring give one prose prompt too
                got += doc_prompts(doc, source, h, 1, salt)
        else:
            got = doc_prompts(text, source, h, per_file, salt)
        out.extend(got)
    held_texts = {p.text for p in out if p.held}
    return [p for p in out if p.held or p.text not in held_texts]  # a function two files share stays held out


def save(prompts: list[Prompt], path: str | Path) -> Path:
    """Write prompts as gzipped JSON lines."""
    path = Path(path)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(dataclasses.asdict(p)) + "\n")
    return path


def load(path: str | Path) -> list[Prompt]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [Prompt(**json.loads(line)) for line in f if line.strip()]


def summary(prompts: list[Prompt]) -> str:
    """Counts by kind, training / held out."""
    parts = []
    for kind in KINDS:
        n = [sum(1 for p in prompts if p.kind == kind and p.held == h) for h in (False, True)]
        parts.append(f"{kind} {n[0]}/{n[1]}")
    return "training/held-out prompts: " + ", ".join(parts)
