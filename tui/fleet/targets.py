"""Which engines a fleet watches: `--url` (repeated), `--urls-file`, or a data-parallel vLLM's
`--base-port P --ranks N [--host H]` (rank r serves batchtop's endpoint on P + r).

Every engine gets a short, unique name: the one its line in the file gives, `rank R` for a
data-parallel rank, else host:port. A line of the file may name the environment variable that holds
that engine's API key (`URL [NAME] [key=VAR]`: the key itself stays out of the file); other engines
use `--api-key`. Bad input is a ValueError with one line that says what is wrong.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

MAX_RANKS = 256


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    rank: int | None = None          # a data-parallel rank (the ranks of one vLLM run in lock step)
    api_key: str | None = None       # its own key (a file's `key=VAR`), else the command's --api-key

    def key(self, default: str | None) -> str | None:
        return self.api_key if self.api_key is not None else default


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


def read_urls_file(path: str) -> list[Target]:
    """A target per line of `path`: `URL [NAME] [key=VAR]`, blank lines and `#` comments skipped."""
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
        try:
            out.append(_target_of_line(words))
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
    if not out:
        raise ValueError(f"the URLs file {path} names no engine")
    return out


def _target_of_line(words: list[str]) -> Target:
    key_words = [w for w in words[1:] if w.startswith("key=")]
    rest = [w for w in words[1:] if not w.startswith("key=")]
    if len(rest) > 1 or len(key_words) > 1 or (key_words and words[-1] != key_words[0]):
        raise ValueError(f"want `URL [NAME] [key=VAR]`, got {' '.join(words)!r}")
    url = check_url(words[0])
    return Target(rest[0] if rest else _short(url), url, api_key=_key_from(key_words[0][4:]) if key_words
                  else None)


def _key_from(variable: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", variable):
        raise ValueError(f"key={variable}: want the name of an environment variable that holds the key")
    key = os.environ.get(variable)
    if not key:
        raise ValueError(f"key={variable}: the environment variable {variable} is not set")
    return key


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
    out = [Target(_short(url), url) for url in map(check_url, urls)]
    if urls_file:
        out += read_urls_file(urls_file)
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
        unique.append(target if n == 1 else replace(target, name=f"{target.name}#{n}"))
    return unique
