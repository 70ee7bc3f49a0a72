"""Text helpers shared by every layer (no dependencies).

``clip`` / ``quote`` shorten a client's value before an error message echoes it: a message that
quoted a 14 MB ``steer`` value in full was a 14 MB response.
"""

from __future__ import annotations

from typing import Any

QUOTE_CHARS = 100  # at most this many characters of a client's value in an error message


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` itself when it has at most ``limit`` characters, else its first ``limit`` and "…"."""
    return text if len(text) <= limit else text[:limit] + "…"


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` clipped to ``limit`` characters (a long string or list is sliced before its
    repr is built, so quoting a multi-megabyte value costs no multi-megabyte copy)."""
    if isinstance(value, (str, list, tuple)):
        value = value[:limit + 1]
    return clip(repr(value), limit)
