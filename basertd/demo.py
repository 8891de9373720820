"""``make demo``: the main job end to end on the default model (issue 7 completes it)."""

import sys


def main() -> int:
    """Run what exists and say what is missing."""
    print("basertd demo: the coordinator (issue 7) has not landed yet; nothing to serve.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
