"""A module the test fork server imports and then forks a child to run (tests/run/test_forkserver.py): each
execution of its body appends a line to ``$FORK_MAIN_RECORD``; its ``main()`` appends ``main <argv>``."""

import os
import sys


def record(line: str) -> None:
    with open(os.environ["FORK_MAIN_RECORD"], "a") as f:
        f.write(line + "\n")


record(f"executed as {__name__}")


def main() -> None:
    record(f"main {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
