"""Distillation prompts from source trees: the held-out split is by file, deterministic, and never trained on."""

from __future__ import annotations

import random
import textwrap

from tfjax.drafters import corpus


def _module(rng: random.Random, i: int) -> str:
    """A small Python module with a docstring'd function and a class method, names drawn from `rng`."""
    a, b = rng.sample(["count", "total", "items", "buffer", "limit", "index", "rows", "label"], 2)
    return textwrap.dedent(f'''\
        """Module {i}: helpers for tallying {a} and {b} in a tiny test tree, written for the corpus tests."""


        def tally_{i}(values):
            """Sum the values that are positive."""
            {a} = 0
            for v in values:
                if v > 0:
                    {a} = {a} + v
            return {a}


        class Box{i}:
            def grow(self, {b}):
                {b} = {b} * 2
                self.size = {b} + {i}
                return self.size
        ''')


def _tree(tmp_path, files: int = 24):
    rng = random.Random(7)
    root = tmp_path / "lib"
    for i in range(files):
        path = root / f"pkg{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_module(rng, i))
    prose = " ".join(f"Sentence {k} explains how the helpers fit together and why they exist." for k in range(12))
    (root / "README.md").write_text(f"# Helpers\n\n{prose}\n\n{prose}\n")
    return [("stdlib", root)]


def test_held_out_split_is_by_file_disjoint_and_deterministic(tmp_path):
    roots = _tree(tmp_path)
    first = corpus.build(roots, prompts=1000, held=0.3, per_file=2)
    assert first == corpus.build(roots, prompts=1000, held=0.3, per_file=2)
    held = {p.source for p in first if p.held}
    trained = {p.source for p in first if not p.held}
    assert held and trained and not held & trained
    assert all(p.held == corpus.is_held(p.source.split("/", 1)[1], 0.3) for p in first)
    assert {p.kind for p in first} >= {"code", "edit", "chat"}
    assert all(p.chat == (p.kind == "chat") for p in first)


def test_split_depends_on_the_path_alone():
    """The same relative path is held out on every machine; a vendored copy counts as the package's own file."""
    paths = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(20)]
    held = [corpus.is_held(p, 0.1) for p in paths]
    assert 10 < sum(held) < 80
    assert held == [corpus.is_held(p, 0.1) for p in paths]
    assert all(corpus.is_held(f"pip/_vendor/{p}", 0.1) == h for p, h in zip(paths, held, strict=True))


def test_an_identical_file_is_read_once(tmp_path):
    """A second copy of a file (e.g. vendored under another name) adds no prompts, so a held-out file's text never
    comes back as training text."""
    roots = _tree(tmp_path, files=6)
    root = roots[0][1]
    (root / "copy").mkdir()
    for i in range(6):
        (root / "copy" / f"other{i}.py").write_text((root / f"pkg{i % 3}" / f"mod{i}.py").read_text())
    prompts = corpus.build(roots, prompts=1000, held=0.5)
    sources = {p.source for p in prompts}
    assert not any(f"stdlib/copy/other{i}.py" in sources and f"stdlib/pkg{i % 3}/mod{i}.py" in sources
                   for i in range(6))
    held_texts = {p.text for p in prompts if p.held}
    assert not any(p.text in held_texts for p in prompts if not p.held)


def test_prompt_file_round_trips(tmp_path):
    prompts = corpus.build(_tree(tmp_path, files=6), prompts=50, held=0.5)
    path = corpus.save(prompts, tmp_path / "prompts.jsonl.gz")
    assert corpus.load(path) == prompts


def test_bench_cells_take_only_held_out_prompts(tmp_path):
    from scripts.bench_generate import held_out_cells

    prompts = corpus.build(_tree(tmp_path), prompts=1000, held=0.5)
    path = corpus.save(prompts, tmp_path / "p.jsonl.gz")
    held_texts = {p.text for p in prompts if p.held}
    cells = held_out_cells(str(path), per_cell=2, streams=1)
    assert cells
    for _, groups in cells:
        for group in groups:
            for prompt in group:
                text = prompt[0]["content"] if isinstance(prompt, list) else prompt
                assert text in held_texts


def test_bench_stream_variants_are_distinct_prompts_that_keep_the_original():
    from scripts.bench_generate import CHAT, CODE, stream_variants

    for prompt in (CODE, CHAT):
        variants = stream_variants(prompt, 4)
        texts = [v if isinstance(v, str) else v[0]["content"] for v in variants]
        original = prompt if isinstance(prompt, str) else prompt[0]["content"]
        assert len(set(texts)) == 4 and all(t.endswith(original) for t in texts)
        assert all(isinstance(v, type(prompt)) for v in variants)
