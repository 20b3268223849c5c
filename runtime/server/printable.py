"""Client text made safe to write into a log line or to send back in an error message.

A client chooses the bytes of its path, headers and body. Written raw, a line feed forges a log line,
an ESC sequence drives the terminal that shows the log, and a lone surrogate cannot even be encoded
as UTF-8 (the JSON response would fail). Every such character is replaced by a visible escape.
"""

from __future__ import annotations

_CONTROL = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]  # C0, DEL, C1 (0x9B is an 8-bit CSI)
_LINE_BREAKS = [0x85, 0x2028, 0x2029]  # what some viewers also break lines at
_BIDI = [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]  # reorder what follows them on screen
_SURROGATES = range(0xD800, 0xE000)

_ESCAPES = {
    code: (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    for code in [*_CONTROL, *_LINE_BREAKS, *_BIDI, *_SURROGATES]
}


def printable(text: str, limit: int | None = None) -> str:
    """`text` with every control, line-breaking, bidi-override and lone-surrogate character escaped
    (`\\x0a`, `\\u2028`), cut to `limit` characters first (marked with `…`) when given."""
    if limit is not None and len(text) > limit:
        return text[:limit].translate(_ESCAPES) + "…"
    return text.translate(_ESCAPES)
