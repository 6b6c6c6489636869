"""Turning k3's own errors into a clear message and an exit code, without a traceback."""

from __future__ import annotations

import functools
import sys

import typer


def _known_errors() -> tuple[type[BaseException], ...]:
    from k3.model.checkpoint import CheckpointError
    from k3.model.config import ConfigError
    from k3.model.tokenizer import TokenizerError

    errs: list[type[BaseException]] = [ConfigError, CheckpointError, TokenizerError, FileNotFoundError]
    try:
        from k3.train.data import DataError

        errs.append(DataError)
    except ImportError:
        pass
    try:
        from k3.train.scaling import ScalingFitError

        errs.append(ScalingFitError)
    except ImportError:
        pass
    try:
        from k3.train.loop import TrainingError

        errs.append(TrainingError)
    except ImportError:
        pass
    return tuple(errs)


def friendly_errors(fn):
    """Decorator for a Typer command: k3 errors print `error: <message>` to stderr and exit with code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _known_errors() as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(code=2) from None

    return wrapper
