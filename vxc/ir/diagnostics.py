"""Errors with a location: ``file:line:col: message``, the offending line, a caret."""

from __future__ import annotations


class IRSyntaxError(Exception):
    def __init__(self, filename: str, text: str, line: int, col: int, message: str):
        self.filename, self.line, self.col, self.message = filename, line, col, message
        src = text.splitlines()[line - 1] if 0 < line <= len(text.splitlines()) else ""
        self.source_line = src
        caret = " " * (max(col, 1) - 1) + "^"
        super().__init__(f"{filename}:{line}:{col}: error: {message}\n  {src}\n  {caret}")


class VxcError(Exception):
    """A user-facing refusal: one clear message, no traceback."""
