"""The one exception type for bad input. The CLI prints it as one line and exits with status 2."""


class UsageError(Exception):
    """Bad input from the user: a config value, a path, a strategy name, a mismatched backup.

    The message names what is wrong and what to do. Nothing on disk has been changed when it is
    raised.
    """
