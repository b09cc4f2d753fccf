"""The one domain error type of ddops.

Library code raises `DdopsError(obj, cause)`; the CLI edge turns it into
`Error: <obj>: <cause>` on stderr and exit code 1 (2 for `InputError`: bad input, such as an
inventory value, that no run could act on). Nothing below the CLI calls sys.exit.
"""

from __future__ import annotations


class DdopsError(Exception):
    """An operation on a named object failed for a stated cause."""

    exit_code = 1

    def __init__(self, obj: str, cause: str, detail: str = "") -> None:
        self.obj = obj
        self.cause = cause
        self.detail = detail
        super().__init__(f"{obj}: {cause}" if obj else cause)


class InputError(DdopsError):
    """Bad input (an inventory value, a target string): the CLI exits 2, Click's convention."""

    exit_code = 2
