"""``basertd``: the coordinator daemon's command line (issue 7)."""

import sys


def main() -> int:
    """Entry point; not implemented until the coordinator issue lands."""
    print("basertd: not yet implemented (issue 7)", file=sys.stderr)
    return 1
