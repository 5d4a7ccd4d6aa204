"""Where the benchmarks write: one section of docs/benchmarks.md each (the reliability runs: of
docs/reliability.md), and the facts a figure carries."""
from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
RELIABILITY = DOCS.parent / "reliability.md"      # the reliability runs' figures (engine/reliability)


def write_section(section: str, text: str, doc: Path = DOCS) -> None:
    """Replace the section headed `section` (up to the next `## `) with `text`, or append it; the other
    sections stay as they are."""
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old).rstrip("\n") + "\n"
    else:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    doc.write_text(new)


def publish(section: str, text: str, *, write: bool, doc: Path = DOCS) -> int:
    """Print a benchmark's section and, when `write`, put it into `doc`; exit status 0."""
    print(text)
    if write:
        write_section(section, text, doc)
    return 0


def cpu_name() -> str:
    """The CPU's model name and its vector unit ("AMD EPYC (AVX2 and FMA, no AVX-512)"): one model name
    covers hosts with and without AVX-512, and the engine's products differ between them."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name} ({vector_unit()})"


def vector_unit() -> str:
    """The vector unit the kernels' product tiles are written for, in words (kernels/cpu.py)."""
    from batchtop.kernels import cpu  # it imports torch: only when a figure is written
    unit = cpu.vector_unit()
    words = {"AVX-512": "AVX-512", "AVX2": "AVX2 and FMA, no AVX-512", "": "no AVX2"}[unit]
    return words + (" and AMX" if unit == "AVX-512" and "amx_tile" in cpu.cpu_features().split() else "")


def span(values, unit: str = "s") -> str:
    """A range of whole numbers as words: "5-8 s", or "5 s" where they round to one value."""
    low, high = f"{min(values):.0f}", f"{max(values):.0f}"
    return f"{low} {unit}" if low == high else f"{low}-{high} {unit}"


def commit() -> str:
    """The commit the running code came from: HEAD when this module was first imported (a benchmark's
    start), not when its figures are written (the checkout may have moved on meanwhile)."""
    return _COMMIT_AT_START


def _head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=DOCS.parent).stdout.strip() or "?"
    except OSError:
        return "?"


_COMMIT_AT_START = _head()
