"""``basertctl``: the operator's client of the control API (issues 7 and 9)."""

import sys


def main() -> int:
    """Entry point; not implemented until the coordinator issue lands."""
    print("basertctl: not yet implemented (issue 7)", file=sys.stderr)
    return 1
