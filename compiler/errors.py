"""Errors of the compile step."""

from mlc_spec.errors import UserError


class CompileError(UserError):
    """A model source, option or output path that cannot be compiled; worded for the user."""
