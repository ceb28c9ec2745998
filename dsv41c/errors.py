"""Exceptions raised by dsv41c.

Every message names the file, key or tensor, what was expected and what was found.
The CLI turns any of them into one red line and exit code 2.
"""


class DSV41CError(Exception):
    """Base class of every error dsv41c raises on purpose."""


class ConfigError(DSV41CError):
    """A model config is malformed: unknown key, bad value, inconsistent layer map."""


class CheckpointError(DSV41CError):
    """A checkpoint is missing a tensor, has an unexpected one, or one of the wrong shape/dtype."""


class InputError(DSV41CError):
    """A user input is invalid: token id out of range, prompt too long, missing file."""


class GoldenMismatch(DSV41CError):
    """A golden check found outputs outside the numerics bounds."""


class ArtifactError(DSV41CError):
    """An exported artifact is missing, tampered with, or was built by other versions."""
