"""Errors that reach users as one line (the CLI prints them without a traceback)."""


class UsageError(Exception):
    """Bad input from the user: the message names the problem and the fix."""


class ConfigError(UsageError):
    """A configuration that cannot run; raised before any rank starts."""
