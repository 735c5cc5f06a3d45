"""Errors a user can act on.

Anything raised as an `AutotuneError` reaches the user as one line (no traceback) and a non-zero
exit from the CLI; from the Python API it is an ordinary exception with a readable message.
"""


class AutotuneError(Exception):
    """A problem the user can fix: bad input, a missing file, an impossible budget."""


class ModelError(AutotuneError):
    """The model named cannot be resolved or built."""


class SpaceError(AutotuneError):
    """A search-space file is malformed or names something unknown."""


class ProfileError(AutotuneError):
    """A profile file is missing, corrupt, truncated or of another format version."""


def os_reason(exc: OSError) -> str:
    """What an OSError says, readable at the end of a one-line error."""
    if isinstance(exc, FileExistsError):  # mkdir where a file has the folder's name
        return "a file is in the way"
    return exc.strerror or str(exc)
