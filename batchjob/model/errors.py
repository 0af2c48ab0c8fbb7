"""The model layer's errors, importable without torch: the CLI maps them to exit codes before any model loads."""


class ModelNotFoundError(RuntimeError):
    """The model named is neither built in, a local file or folder, nor a Hub id that resolves."""
