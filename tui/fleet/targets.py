"""Which engines a fleet watches: `--url` (repeated), `--urls-file`, or a data-parallel vLLM's
`--base-port P --ranks N [--host H]` (rank r serves batchtop's endpoint on P + r).

Every engine gets a short, unique name: the one its line in the file gives, `rank R` for a
data-parallel rank, else host:port. Bad input is a ValueError with one line that says what is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_RANKS = 256


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    rank: int | None = None          # a data-parallel rank (the ranks of one vLLM run in lock step)


def check_url(url: str) -> str:
    """`url` without its trailing slash; ValueError unless it is http(s)://host[:port]."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an engine URL: {url!r} (want http://HOST:PORT)")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"not an engine URL: {url!r} (bad port)") from None
    return url.strip().rstrip("/")


def read_urls_file(path: str) -> list[tuple[str, str | None]]:
    """(url, name or None) per line of `path`: `URL [NAME]`, blank lines and `#` comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read the URLs file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the URLs file {path} is not text") from None
    out = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"{path}:{number}: want `URL [NAME]`, got {line.strip()!r}")
        try:
            out.append((check_url(words[0]), words[1] if len(words) == 2 else None))
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
    if not out:
        raise ValueError(f"the URLs file {path} names no engine")
    return out


def rank_targets(host: str, base_port: int, ranks: int) -> list[Target]:
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"--ranks must be in [1, {MAX_RANKS}], got {ranks}")
    if not 1 <= base_port or base_port + ranks - 1 > 65535:
        raise ValueError(f"--base-port {base_port} with {ranks} ranks leaves the ports 1..65535")
    return [Target(f"rank {rank}", check_url(f"http://{host}:{base_port + rank}"), rank)
            for rank in range(ranks)]


def targets(urls: list[str], urls_file: str | None = None, base_port: int | None = None,
            ranks: int | None = None, host: str = "127.0.0.1") -> list[Target]:
    """The engines named on the command line, in order; ValueError when none is, or one is named twice."""
    named: list[tuple[str, str | None]] = [(check_url(url), None) for url in urls]
    if urls_file:
        named += read_urls_file(urls_file)
    out = [Target(name or _short(url), url) for url, name in named]
    if (base_port is None) != (ranks is None):
        raise ValueError("--base-port and --ranks go together "
                         "(a data-parallel vLLM: rank r on base port + r)")
    if base_port is not None:
        out += rank_targets(host, base_port, ranks)
    if not out:
        raise ValueError("no engine to watch: give --url URL (repeatable), --urls-file FILE, "
                         "or --base-port P --ranks N")
    seen: dict[str, str] = {}
    for target in out:
        if target.url in seen:
            raise ValueError(f"{target.url} is named twice")
        seen[target.url] = target.name
    return _unique_names(out)


def _short(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname or url


def _unique_names(out: list[Target]) -> list[Target]:
    counts: dict[str, int] = {}
    unique = []
    for target in out:
        n = counts[target.name] = counts.get(target.name, 0) + 1
        unique.append(target if n == 1 else Target(f"{target.name}#{n}", target.url, target.rank))
    return unique
