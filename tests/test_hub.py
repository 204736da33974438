"""Model names: Hugging Face ids through a local hub cache (offline), clear errors, packaged GGUFs by sha256."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

import pytest

from tfjax import api, hub, packaged
from tfjax.packaged import PackagedModelError, fetch_gguf

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.helpers import make_tiny_llama_with_tokenizer

    return make_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny") / "tiny",
                                          packaged.ensure_converted("smollm2"))


def fake_hub(root, repo: str, folder) -> object:
    """Lay `folder` out in a hub cache at `root` as huggingface_hub does: blobs behind snapshots/<rev>, refs/main."""
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    snapshot = base / "snapshots" / REVISION
    shutil.copytree(folder, snapshot)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_hub_id_resolves_from_the_hub_cache_offline(offline_hub, tiny):
    snapshot = fake_hub(offline_hub, "org/tiny", tiny)
    assert hub.resolve("org/tiny") == snapshot
    assert hub.resolve(f"org/tiny@{REVISION}") == snapshot
    llm = api.load("org/tiny", lanes=1, context=64)
    assert llm.path == snapshot and llm.config.vocab_size == 49152


@pytest.mark.slow  # quantizing the tiny model takes a while on 2 cores; the hub path is the bf16 test's
def test_mlx_4bit_repo_loads_by_hub_id(offline_hub, tiny, tmp_path):
    from tfjax import checkpoint

    mlx = checkpoint.write_mlx(tiny, tmp_path / "mlx", bits=4, group_size=64, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, mlx / name)
    fake_hub(offline_hub, "mlx-community/tiny-4bit", mlx)
    llm = api.load("mlx-community/tiny-4bit", lanes=1, context=64)
    assert llm.config.quantization is not None and llm.config.quantization.bits == 4


def test_hub_id_missing_offline_says_what_to_do(offline_hub):
    with pytest.raises(hub.ModelNotFound, match="not in the Hugging Face cache and HF_HUB_OFFLINE is set") as e:
        hub.resolve("org/absent")
    assert "hf download org/absent" in str(e.value)


def test_cli_hub_id_that_cannot_be_reached_is_one_line(offline_hub, capsys):
    from tfjax import cli

    assert cli.main(["generate", "org/absent", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfjax generate: error: 'org/absent' is not in the Hugging Face cache") and \
        err.count("\n") == 1


def test_a_missing_folder_that_looks_like_a_hub_id_names_both(offline_hub, tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(hub.ModelNotFound, match="there is no folder runs/typo; as a Hugging Face id: 'runs/typo'"):
        hub.resolve("runs/typo")


def test_a_gguf_file_is_pointed_at_convert(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(hub.ModelNotFound, match="tfjax convert FILE.gguf OUT"):
        hub.resolve(tmp_path / "m.gguf")


def test_every_packaged_model_has_a_sha256():
    for m in packaged.MODELS.values():
        assert m.sha256 is not None and len(m.sha256) == 64 and int(m.sha256, 16) >= 0, m.name


def test_packaged_gguf_with_the_right_size_but_wrong_sha256_is_rejected(tmp_path):
    from tests.test_gguf_import import fake_parts

    model = fake_parts(tmp_path, 2, {1, 2}, 200)
    good = fetch_gguf(model, tmp_path / "cache")
    digest = packaged.sha256(good)
    assert fetch_gguf(dataclasses.replace(model, sha256=digest), tmp_path / "cache") == good
    bad = dataclasses.replace(model, sha256="0" * 64)
    good.unlink()
    with pytest.raises(PackagedModelError, match=f"sha256 {digest}, expected 0{{64}}"):
        fetch_gguf(bad, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("fake.gguf*"))  # nothing kept


def test_a_cached_gguf_that_changed_is_fetched_again(tmp_path):
    from tests.test_gguf_import import fake_parts

    model = fake_parts(tmp_path, 2, {1, 2}, 200)
    path = fetch_gguf(model, tmp_path / "cache")
    model = dataclasses.replace(model, sha256=packaged.sha256(path))
    path.write_bytes(b"\7" * 200)  # same size, other bytes
    assert fetch_gguf(model, tmp_path / "cache").read_bytes() == bytes([1]) * 100 + bytes([2]) * 100


def test_a_folder_without_weights_is_refused_unless_random_weights_are_given(tmp_path):
    """bench scripts time a geometry from config.json + tokenizer alone (random weights); a load needs weights."""
    folder = tmp_path / "geometry"
    folder.mkdir()
    shutil.copy(pathlib.Path(__file__).parents[1] / "configs" / "tiny_dense.json", folder / "config.json")
    with pytest.raises(hub.ModelNotFound, match="no .safetensors"):
        hub.resolve(folder)
    assert hub.resolve(folder, weights=False) == folder
