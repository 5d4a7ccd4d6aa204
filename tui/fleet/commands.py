"""`batchtop top` over several engines: each probed at once (in parallel), then the fleet table.

An engine that does not answer at start is shown down and retried; when none answers, the command
stops with one line naming why (exit 2).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .targets import Target

PROBE_TIMEOUT_S = 3.0


def probe(found: list[Target], api_key: str | None) -> dict[str, str | None]:
    """Engine name -> None when something batchtop can show answers at its URL, else why not."""
    from ..sources.scrape import NotAServer, detect

    def one(target: Target) -> str | None:
        try:
            detect(target.url, target.key(api_key), timeout_s=PROBE_TIMEOUT_S)
        except NotAServer as error:
            return str(error)
        return None
    with ThreadPoolExecutor(max_workers=min(16, len(found))) as pool:
        return dict(zip((t.name for t in found), pool.map(one, found)))


def run_fleet(found: list[Target], api_key: str | None, *, period_s: float = 1.0) -> int:
    answers = probe(found, api_key)
    if all(answers.values()):
        first = next(iter(answers.values()))
        raise ValueError(f"none of the {len(found)} engines answers (first: {first})")
    from .member import Member
    from .screen import FleetApp
    FleetApp([Member(target, target.key(api_key), period_s=period_s) for target in found]).run()
    return 0
