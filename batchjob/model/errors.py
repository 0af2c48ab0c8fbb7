"""The model layer's errors, importable without torch: the CLI maps them to exit codes before any model loads."""


class ModelError(RuntimeError):
    """A model that cannot be used, said in one line that names it: the user's to fix (exit 2)."""


class ModelNotFoundError(ModelError):
    """The model named is neither built in, a local file or folder, nor a Hub id that resolves."""


class ModelLoadError(ModelError):
    """The model was found but its files cannot be used: a damaged or incomplete file, weights that do not fit its
    config, a chat template that does not parse."""


class CacheDirError(RuntimeError):
    """No folder for batchjob's cache: BATCHJOB_CACHE is unset and the home folder is unknown."""
