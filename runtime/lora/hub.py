"""LoRA adapters on the Hugging Face hub (`hf://org/name`): downloaded with the model's own hub code
(runtime/loader/source.py), so the same cache (`--download-dir`, else KVASIR_DOWNLOAD_DIR, else the
Hugging Face cache), token (HF_TOKEN) and offline mode (HF_HUB_OFFLINE=1) apply. Only the two
files of a PEFT adapter are fetched; the folder is then read and checked like any local adapter.

Called on the registry's loading thread, never the event loop or the engine's thread.
"""

from __future__ import annotations

from kvasir.runtime.loader.source import download_from_hub
from kvasir.runtime.lora.modules import HubAdapter

# A PEFT adapter's files, and nothing else: not the `adapter_model.bin` pickle, not a README.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def download_adapter(adapter: HubAdapter, *, download_dir: str | None, token: str | None) -> str:
    """The local folder of `adapter`'s files, downloaded unless already in the cache. Raises the
    loader's hub errors (HubNotFoundError, HubAccessError, HubUnavailableError, ModelLoadError)."""
    folder = download_from_hub(
        adapter.repo_id, adapter.revision, download_dir, token, allow_patterns=ADAPTER_FILES
    )
    return str(folder)
