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
    """Decorator for a Typer command: k3 errors print `error: <message>` to stderr and exit with code 2; Ctrl-C
    outside the train loop's own handling (loading, data preparation, generation) exits with 130 (128 + SIGINT),
    as shells expect of an interrupted command (click would print "Aborted!" and exit with 1, an ordinary failure)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _known_errors() as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(code=130) from None

    return wrapper
