"""Text a client chose (a request's path, a header, a name), as it may enter a log line or a
response body.

Written verbatim, a CR/LF in a decoded path (`%0D%0A`) ends the gateway's line and starts one
the client wrote, which an operator reads as the gateway's own. `loggable` quotes the text as
Python's repr does, so every control and non-printable character is an escape (`\\r`, `\\n`,
`\\x1b`, `\\u2028`), and cuts it to a bound, so one request cannot fill the log either. `writable` escapes what UTF-8 cannot carry, for
the error bodies that quote a client's input.
"""

from __future__ import annotations

MAX_LOGGED_CHARS = 300
"""The most characters of one client-chosen value a log line holds."""


def loggable(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """`text` quoted and escaped (repr), cut to `limit` characters with how many were left out."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text) - limit:,} more characters)"


def writable(text: str) -> str:
    """`text` with what UTF-8 cannot carry escaped: a lone surrogate (JSON may hold one,
    `"\\udc80"`) quoted from a client's input made the body unwritable, a 500."""
    return text.encode("utf-8", "backslashreplace").decode()
