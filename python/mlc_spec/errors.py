"""The base of every error that is the user's to fix (bad input, missing hardware).

The CLI and the server report these as one clear line; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A problem with the user's input or environment, worded for the user."""
