"""The one error type model loading raises: its message names the file, field or value at fault."""


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says what is wrong and, where possible, what to do."""


class HubNotFoundError(ModelLoadError):
    """The Hugging Face hub has no such repository, revision or file (or it is private without a token)."""


class HubAccessError(ModelLoadError):
    """The repository is gated: its licence must be accepted and a token passed."""


class HubUnavailableError(ModelLoadError):
    """The hub cannot be reached (or offline mode is on: `offline`) and the files are not in the
    download cache."""

    def __init__(self, message: str, *, offline: bool = False) -> None:
        super().__init__(message)
        self.offline = offline
