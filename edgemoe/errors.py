"""The one exception type for mistakes a user can fix (paths, configs, flags, request values)."""

from __future__ import annotations


class EdgeMoEError(ValueError):
    """A user error: the message is one line, shown as is by the CLI and the server."""
