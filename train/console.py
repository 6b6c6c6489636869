"""The rich consoles k3's commands print through."""

from __future__ import annotations

from rich.console import Console


def make_console(*, stderr: bool = False) -> Console:
    """A rich Console on stdout (stderr=True: stderr) that wraps lines to a terminal's width but never wraps them
    when the stream is a pipe or a file: rich then assumes 80 columns and would break a long line, splitting
    paths (`checkpoint: runs/.../final`) that logs are read and grepped for. The stream itself is asked, not
    rich's is_terminal, which FORCE_COLOR (set by many CI systems) turns on for pipes too.

    Example: make_console().print(f"checkpoint: {path}")
    """
    console = Console(stderr=stderr)
    if not console.file.isatty():
        console.soft_wrap = True
    return console
