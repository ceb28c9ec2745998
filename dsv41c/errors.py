"""Exceptions raised by dsv41c.

Every message names the file, key or tensor, what was expected and what was found.
The CLI turns any of them into one red line and exit code 2.
"""
import contextlib
from collections.abc import Iterator


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


def wrapped_error(exc: BaseException) -> "DSV41CError | None":
    """The dsv41c error that `exc` is or wraps: torch's compile stack raises a graph pass's error
    inside its own (Dynamo's `BackendCompilerFailed`, Inductor's `InductorError`), which keep it as
    `inner_exception`; explicit causes (`raise ... from`) are followed too."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DSV41CError):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    return None


@contextlib.contextmanager
def unwrapped() -> Iterator[None]:
    """While the block runs, a dsv41c error that torch's compile stack wrapped is raised as itself
    (chained to the wrapper), so that callers and the CLI see the pass's own error and message."""
    try:
        yield
    except Exception as exc:
        inner = wrapped_error(exc)
        if inner is None or inner is exc:
            raise
        raise inner from exc
