"""The exit codes of every `batchjob` command, defined once (docs/job-file.md lists them)."""

import signal

EXIT_OK = 0
EXIT_CHECKS_FAILED = 1  # `batchjob selftest` ran, and some check failed
EXIT_USAGE = 2  # usage, job-file, input, model or setting error
EXIT_ROW_ERRORS = 3  # finished, but some rows failed (with fail_on_row_errors)
EXIT_INTERNAL = 70  # a bug (EX_SOFTWARE): the message names the log file that holds the traceback
EXIT_IO = 74  # a file cannot be read or written: a read-only folder, a full disk (EX_IOERR); committed rows are kept
EXIT_LOCKED = 75  # another run holds the output folder (EX_TEMPFAIL: try again later)
# Interrupted (128 + the signal), resumable. SIGHUP (the terminal or ssh session went away) stops a run like SIGTERM.
EXIT_SIGNAL = {signal.SIGHUP: 129, signal.SIGINT: 130, signal.SIGTERM: 143}
