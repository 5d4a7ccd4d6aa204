"""A command's error as its tests read it."""
from __future__ import annotations

FLIGHT = "batchtop: flight recorder"


def error_lines(err: str) -> list[str]:
    """The lines of a command's stderr, less the flight recorders' lines: a command that ends in an error
    has every engine in the process dump its flight recorder, and other tests leave engines (servers of
    session fixtures) in the test worker's process."""
    return [line for line in err.strip().splitlines() if not line.startswith(FLIGHT)]
