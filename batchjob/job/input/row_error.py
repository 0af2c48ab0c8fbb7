"""The error of one row: it becomes that row's output with its message, and the job goes on."""


class RowError(ValueError):
    """This row cannot become a request; the message goes into the output row's `error`."""
