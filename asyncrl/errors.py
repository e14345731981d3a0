"""Errors that reach the user as one line and a non-zero exit, never as a traceback."""


class UserError(Exception):
    """Bad input or environment the user can fix; the message says what and how."""
