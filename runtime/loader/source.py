"""Where a model's files are: a local folder, a local `.gguf` file, or a Hugging Face hub download.

Hub forms: `org/name` or `hf://org/name` (a snapshot of the weights, configs and tokenizer files),
and `hf://org/name/file.gguf` (that one GGUF file from a repository of quantizations).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvasir.runtime.loader.errors import (
    HubAccessError,
    HubNotFoundError,
    HubUnavailableError,
    ModelLoadError,
)

HF_SCHEME = "hf://"
DOWNLOAD_DIR_ENV = "KVASIR_DOWNLOAD_DIR"
# What a snapshot downloads: weights, configs and tokenizer files, never `*.bin`/`*.pt` duplicates.
HUB_ALLOW_PATTERNS = ("*.safetensors", "*.json", "*.jinja", "tokenizer.model", "tokenizer*")


def resolve_model_source(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
) -> Path:
    """A local folder or `.gguf` file for `model`, downloading a hub id into the cache if needed."""
    if not model:
        raise ModelLoadError("no model given: pass a local folder, a .gguf file or a Hugging Face id")
    if model.startswith(HF_SCHEME):
        return download_from_hub(model[len(HF_SCHEME) :], revision, download_dir, token)

    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        raise ModelLoadError(
            f"{path}: is a file but not a .gguf; pass a Hugging Face model folder or a .gguf file"
        )
    if _looks_local(model):
        raise ModelLoadError(f"{model}: no such file or directory")
    return download_from_hub(model, revision, download_dir, token)


def check_local_source(model: str) -> None:
    """ModelLoadError now, with nothing downloaded, if `model` names a local path that is missing or
    is a file other than a .gguf; hub ids are left for the download to check."""
    if not model.startswith(HF_SCHEME) and (Path(model).expanduser().exists() or _looks_local(model)):
        resolve_model_source(model)  # a local path: checked, never downloaded


def _looks_local(model: str) -> bool:
    """A hub id is `name` or `org/name`; anything shaped like a filesystem path is not one."""
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf") or model.count("/") > 1


def download_from_hub(
    target: str,
    revision: str | None,
    download_dir: str | None,
    token: str | None,
    *,
    allow_patterns: tuple[str, ...] = HUB_ALLOW_PATTERNS,
) -> Path:
    """The local folder (or `.gguf` file) of hub `target` (`org/name` or `org/name/file.gguf`),
    downloaded into `download_dir` (else KVASIR_DOWNLOAD_DIR, else the Hugging Face cache) unless
    already there; a snapshot takes only the files `allow_patterns` match. ModelLoadError naming the
    cause: HubNotFoundError, HubAccessError, HubUnavailableError (unreachable or offline, not cached),
    or ModelLoadError itself for any other failure."""
    # Imported here: huggingface_hub reads its environment at import time and is only needed for ids.
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    parts = target.split("/")
    repo_id, filename = ("/".join(parts[:2]), "/".join(parts[2:])) if len(parts) > 2 else (target, "")
    if filename and not filename.endswith(".gguf"):
        raise ModelLoadError(f"{HF_SCHEME}{target}: a file inside a hub repository must be a .gguf file")
    cache_dir = download_dir or os.environ.get(DOWNLOAD_DIR_ENV) or None
    # Read the variable ourselves too: huggingface_hub only looks at it when first imported.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        if filename:
            return Path(
                hf_hub_download(
                    repo_id,
                    filename,
                    revision=revision,
                    cache_dir=cache_dir,
                    token=token,
                    local_files_only=offline,
                )
            )
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            local_files_only=offline,
            allow_patterns=list(allow_patterns),
        )
        return Path(folder)
    except HFValidationError as error:
        raise ModelLoadError(
            f"{target}: not a local path and not a valid Hugging Face id (org/name): {error}"
        ) from error
    except GatedRepoError as error:
        raise HubAccessError(
            f"{repo_id}: gated on the Hugging Face hub; accept its licence and pass a token (HF_TOKEN)"
        ) from error
    except RepositoryNotFoundError as error:
        raise HubNotFoundError(
            f"{repo_id}: no local path of that name and no such repository on the Hugging Face hub "
            "(or it is private: pass a token)"
        ) from error
    except RevisionNotFoundError as error:
        raise HubNotFoundError(f"{repo_id}: revision {revision!r} not found on the hub") from error
    except LocalEntryNotFoundError as error:  # offline or unreachable, and not in the cache
        reason = "offline mode is on (HF_HUB_OFFLINE=1)" if offline else "the hub cannot be reached"
        raise HubUnavailableError(
            f"{target}: not a local path, {reason}, and it is not in the download cache "
            f"({cache_dir or 'the Hugging Face cache'}). Pass a local folder or .gguf file, or "
            f"pre-download it where the hub is reachable (`hf download {repo_id}`) into that cache.",
            offline=offline,
        ) from error
    except EntryNotFoundError as error:
        raise HubNotFoundError(f"{repo_id}: has no file {filename!r} on the hub") from error
    except OSError as error:  # other HTTP errors, a full disk, an unwritable cache
        raise ModelLoadError(f"{target}: download from the Hugging Face hub failed: {error}") from error
