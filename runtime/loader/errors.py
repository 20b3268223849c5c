"""The one error type model loading raises: its message names the file, field or value at fault."""


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says what is wrong and, where possible, what to do."""
