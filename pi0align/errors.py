"""Errors a user can cause. The CLI prints them as one line and exits with their code."""


class UserError(Exception):
    """Bad input: a missing or corrupt file, a mismatched run, an unknown device, a missing library.

    The message is one line that says what is wrong and, where it helps, which flag fixes it.
    """

    exit_code = 2
