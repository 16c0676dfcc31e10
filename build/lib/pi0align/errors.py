"""Errors a user can cause. The CLI prints them as one line and exits with their code."""


class UserError(Exception):
    """Bad input: a missing or corrupt file, a mismatched run, an unknown device, a missing library.

    The message is one line that says what is wrong and, where it helps, which flag fixes it.
    """

    exit_code = 2


def check_writable(path) -> None:
    """Raise the UserError a command gives for an output it could not write, before the command's
    work rather than after it: `path` (a file or folder, made if missing) must be writable."""
    import os
    from pathlib import Path

    path = existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise UserError(f"cannot write {path}: {existing} is not a folder")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise UserError(f"cannot write {path}: read-only file system")
    if not os.access(existing, os.W_OK):
        raise UserError(f"cannot write {path}: permission denied")
