"""Model sources: `hf://ORG/NAME[/FILE.gguf]`, `pvc://CLAIM[/PATH]` or an absolute local path, parsed strictly."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

# Hugging Face repository ids: letters, digits, '-', '_', '.'; no '--' or '..' (the Hub refuses them).
_HF_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
# A PersistentVolumeClaim name is a DNS-1123 subdomain.
_CLAIM = re.compile(r"^[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?$")


class SpecError(ValueError):
    """A spec the CRD schema accepts but the operator cannot honour; the message is shown to users."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class SourceKind(str, Enum):
    HUGGING_FACE = "hf"
    PVC = "pvc"
    LOCAL = "local"


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from; `model_arg` is what the runtime's `--model` receives."""

    kind: SourceKind
    repo_id: str = ""  # hf: "org/name"
    filename: str = ""  # hf: one .gguf file inside the repository ("" = a snapshot of the repository)
    claim: str = ""  # pvc: the claim name
    path: str = ""  # pvc: the path inside the claim ("" = its root); local: the absolute path

    @property
    def hub_model(self) -> str:
        """What the runtime's --model takes for a hub source (`org/name` or `hf://org/name/file.gguf`)."""
        return f"hf://{self.repo_id}/{self.filename}" if self.filename else self.repo_id

    @property
    def default_served_name(self) -> str:
        if self.kind is SourceKind.HUGGING_FACE:
            return self.repo_id
        tail = self.path.rstrip("/").rsplit("/", 1)[-1]
        return tail or self.claim


def _clean_path(field: str, path: str) -> str:
    """Reject `..`, empty segments and control characters; they would escape or confuse the mount."""
    segments = path.split("/")
    if any(segment == ".." for segment in segments):
        raise SpecError(field, f"path {path!r} must not contain '..' segments")
    if any(ord(char) < 32 for char in path):
        raise SpecError(field, "path must not contain control characters")
    if "//" in path:
        raise SpecError(field, f"path {path!r} must not contain empty segments ('//')")
    return path


def parse_model_source(source: str, field: str = "spec.model.source") -> ModelSource:
    """Parse a model source; raises SpecError with a user-facing message when it is malformed."""
    if not isinstance(source, str) or not source:
        raise SpecError(
            field, "a model source is required (hf://ORG/NAME[/FILE.gguf], pvc://CLAIM[/PATH] or /PATH)"
        )
    if source.startswith("hf://"):
        parts = source[len("hf://") :].split("/")
        filename = "/".join(parts[2:])
        if len(parts) < 2 or (filename and not filename.endswith(".gguf")):
            raise SpecError(field, f"{source!r} must look like hf://ORG/NAME or hf://ORG/NAME/FILE.gguf")
        if filename:
            _clean_path(field, filename)
        for part in parts[:2]:
            if not _HF_PART.match(part) or "--" in part or ".." in part:
                raise SpecError(
                    field,
                    f"{part!r} in {source!r} is not a valid Hugging Face name "
                    "(letters, digits, '-', '_', '.'; at most 96 characters; no '--' or '..')",
                )
        return ModelSource(SourceKind.HUGGING_FACE, repo_id="/".join(parts[:2]), filename=filename)
    if source.startswith("pvc://"):
        claim, _, path = source[len("pvc://") :].partition("/")
        if not _CLAIM.match(claim):
            raise SpecError(field, f"{claim!r} in {source!r} is not a valid PersistentVolumeClaim name")
        return ModelSource(SourceKind.PVC, claim=claim, path=_clean_path(field, path.rstrip("/")))
    if source.startswith("/"):
        if source == "/":
            raise SpecError(field, "a local model path must name a directory or file, not '/'")
        return ModelSource(SourceKind.LOCAL, path=_clean_path(field, source.rstrip("/")))
    scheme = source.split("://", 1)[0] if "://" in source else ""
    hint = f"unsupported scheme {scheme + '://'!r}" if scheme else "not an absolute path"
    raise SpecError(field, f"{source!r}: {hint}; use hf://ORG/NAME[/FILE.gguf], pvc://CLAIM[/PATH] or /PATH")
