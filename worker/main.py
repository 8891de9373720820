"""``basertd-worker``: one engine process per device (issue 5)."""

import sys


def main() -> int:
    """Entry point; not implemented until the worker issue lands."""
    print("basertd-worker: not yet implemented (issue 5)", file=sys.stderr)
    return 1
