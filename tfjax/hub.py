"""Model names -> checkpoint folders: a local folder, a packaged model, or a Hugging Face hub id.

Hub ids (`org/name`, optionally `org/name@revision`) go through `huggingface_hub.snapshot_download`:
its cache (`HF_HUB_CACHE`, `HF_HOME`), `HF_HUB_OFFLINE`, and its progress bars. Only the files a
checkpoint needs are fetched (configs, tokenizer, chat template, safetensors), so MLX community 4-bit
repos and plain bf16 repos both arrive as folders `checkpoint.load` reads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# What a checkpoint folder needs from a hub repo: config/tokenizer/generation_config JSON, the weights, a template.
HUB_FILES = ("*.json", "*.safetensors", "*.jinja")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class ModelNotFound(FileNotFoundError):
    """A model name that no folder, packaged model or reachable hub id matches; the message says what to do."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now rather than when huggingface_hub was imported."""
    from huggingface_hub import constants

    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE or any(_truthy(os.environ.get(k)) for k in names)


def check_folder(path: Path, weights: bool = True) -> Path:
    """`path` if it looks like a checkpoint folder (config.json that parses, safetensors unless `weights` is False:
    a geometry timed with random weights), else ModelNotFound."""
    config = path / "config.json"
    if not config.is_file():
        raise ModelNotFound(f"{path} has no config.json, so it is not a checkpoint folder; pass a Hugging Face-style "
                            f"folder (config.json, tokenizer.json, *.safetensors) or convert a GGUF with "
                            f"`tfjax convert FILE.gguf OUT`")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelNotFound(f"{config} is not valid JSON ({e}); fix or re-download the checkpoint") from None
    files = sorted(path.glob("*.safetensors")) if weights else []
    if weights and not files:
        raise ModelNotFound(f"{path} has no .safetensors weights; download the checkpoint's weights into it")
    from safetensors import SafetensorError, safe_open

    for f in files:  # reads each header only
        try:
            with safe_open(f, "numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise ModelNotFound(f"{f} is not a readable safetensors file ({e}); re-download or re-convert the "
                                f"checkpoint") from None
    return path


def download(repo: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local snapshot folder of hub id `repo` (`org/name[@revision]`), fetched into the hub cache if needed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, _, revision = repo.partition("@")
    is_offline = offline()
    try:
        path = snapshot_download(repo_id, revision=revision or None, allow_patterns=list(HUB_FILES),
                                 cache_dir=cache_dir or os.environ.get("HF_HUB_CACHE"), local_files_only=is_offline)
    except GatedRepoError:
        raise ModelNotFound(f"{repo_id} is gated on the Hugging Face hub; accept its licence on huggingface.co and "
                            f"log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"no model {repo_id!r} on the Hugging Face hub (or it is private: log in with "
                            f"`hf auth login`); check the id, or pass a local folder") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{repo_id} has no revision {revision!r}; drop `@{revision}` or name an existing "
                            f"branch, tag or commit") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if is_offline else "the Hugging Face hub cannot be reached"
        raise ModelNotFound(f"{repo_id!r} is not in the Hugging Face cache and {why}; download it once online "
                            f"(`hf download {repo_id}`), or pass a local folder or a packaged model name") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelNotFound(f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
                            f"check the network, or pass a local folder") from None
    return check_folder(Path(path))


def resolve(name_or_path: str | os.PathLike, weights: bool = True) -> Path:
    """A checkpoint folder for a folder path, a packaged model name, or a hub id (in that order); `weights=False`
    accepts a folder of config and tokenizer only."""
    from tfjax import packaged

    path = Path(name_or_path)
    name = str(name_or_path)
    known = ", ".join(sorted(packaged.MODELS))
    if path.is_dir():
        return check_folder(path, weights)
    if path.is_file():
        hint = " (a GGUF: convert it first with `tfjax convert FILE.gguf OUT`)" if path.suffix == ".gguf" else ""
        raise ModelNotFound(f"{name} is a file, not a checkpoint folder{hint}")
    if name in packaged.MODELS:
        return packaged.ensure_converted(name)
    if HUB_ID.match(name):
        try:
            return download(name)
        except ModelNotFound as e:
            if path.parent.is_dir():  # `runs/x` with a `runs/` here: more likely a mistyped folder than a hub id
                raise ModelNotFound(f"there is no folder {name}; as a Hugging Face id: {e}") from None
            raise
    raise ModelNotFound(f"{name!r} is not a checkpoint folder, a packaged model ({known}) or a Hugging Face id "
                        f"(org/name); pass one of those")
