"""The built-in load: Poisson arrivals with prompt and output lengths from a distribution, or a trace file.

A trace is JSON Lines, one request per line:
`{"arrival_s": 0.0, "prompt_tokens": 32, "output_tokens": 1024}` — or `"prompt": "text"` instead of
`prompt_tokens`. With `output_tokens` the request produces exactly that many tokens (EOS ignored).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

DISTRIBUTIONS = ("fixed", "uniform", "exponential", "pareto")
MAX_RATE = 10_000
LOAD_KNOBS = ("load_rate", "length_dist")     # a running PoissonLoad's knobs, set live


def check_load_knob(name: str, value):
    """The value to set (a rate as a float), or ValueError naming what the knob takes."""
    if name == "load_rate":
        rate = value
        if isinstance(value, str):
            try:
                rate = float(value)
            except ValueError:
                pass
        if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and math.isfinite(rate)
                                          and 0 <= rate <= MAX_RATE):
            raise ValueError(f"load rate must be in [0, {MAX_RATE}] requests/s, got {value!r}")
        return float(rate)
    if name == "length_dist":
        if value not in DISTRIBUTIONS:
            raise ValueError(f"length distribution must be one of {', '.join(DISTRIBUTIONS)}, got {value!r}")
        return value
    raise ValueError(f"unknown load knob {name!r}; load knobs: {', '.join(LOAD_KNOBS)}")


@dataclass(frozen=True)
class LengthDist:
    """fixed: `mean`; uniform: [low, high]; exponential: `mean`; pareto: scale `low`, shape `alpha`.

    Every draw is clipped to [low, high].
    """
    kind: str = "exponential"
    mean: float = 64.0
    low: int = 1
    high: int = 1024
    alpha: float = 1.5

    def __post_init__(self):
        check_load_knob("length_dist", self.kind)
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got low={self.low}, high={self.high}")
        if not self.mean > 0 or not self.alpha > 0:
            raise ValueError("mean and alpha must be > 0")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.mean
        elif self.kind == "uniform":
            value = rng.randint(self.low, self.high)
        elif self.kind == "exponential":
            value = rng.expovariate(1.0 / self.mean)
        else:
            value = self.low * rng.paretovariate(self.alpha)
        return int(min(max(round(value), self.low), self.high))


@dataclass(frozen=True)
class SharedPrefixes:
    """`count` fixed prefixes of `num_tokens` tokens each (a system prompt, a few-shot preamble);
    a request starts with one of them, drawn uniformly, with probability `share`."""
    count: int = 1
    num_tokens: int = 256
    share: float = 1.0
    seed: int = 1

    def __post_init__(self):
        if self.count < 1 or self.num_tokens < 1 or not 0.0 <= self.share <= 1.0:
            raise ValueError(f"need count >= 1, num_tokens >= 1 and share in [0, 1], got {self}")

    def prefixes(self) -> list[tuple[int, ...]]:
        rng = random.Random(self.seed)
        return [tuple(synthetic_prompt(self.num_tokens, rng)) for _ in range(self.count)]

    def draw(self, rng: random.Random, prefixes: list[tuple[int, ...]]) -> tuple[int, ...]:
        return prefixes[rng.randrange(len(prefixes))] if rng.random() < self.share else ()


@dataclass(frozen=True)
class TraceItem:
    arrival_s: float
    output_tokens: int | None
    prompt_tokens: int | None = None       # synthetic tokens after the prefix
    prompt: str | None = None
    prefix_ids: tuple[int, ...] = ()       # a shared prefix the prompt starts with


def item_prompt(item: TraceItem, rng: random.Random) -> str | list[int]:
    """The prompt of a trace item: its text, or its prefix and synthetic tokens."""
    if item.prompt is not None:
        return item.prompt
    return list(item.prefix_ids) + synthetic_prompt(item.prompt_tokens, rng)


class PoissonLoad:
    """Arrivals at `rate` per second; `due(elapsed)` hands out every request whose time has come.
    With `prefixes`, requests start with shared prefixes (`prompt` draws the length after it)."""

    def __init__(self, rate: float, prompt: LengthDist, output: LengthDist, seed: int = 0,
                 prefixes: SharedPrefixes | None = None):
        self.rng = random.Random(seed)
        self.prompt, self.output = prompt, output
        self.shared = prefixes
        self._prefixes = prefixes.prefixes() if prefixes is not None else []
        self.rate = 0.0
        self._last_s = 0.0
        self.set_rate(rate)

    def set_rate(self, rate: float) -> None:
        self.rate = check_load_knob("load_rate", rate)
        self._next_s = self._last_s + self._gap()

    def start_at(self, elapsed_s: float) -> None:
        """Take over a running clock: the first arrival comes a gap after `elapsed_s`, not after 0."""
        self._last_s = elapsed_s
        self._next_s = elapsed_s + self._gap()

    def _gap(self) -> float:
        return self.rng.expovariate(self.rate) if self.rate > 0 else math.inf

    def due(self, elapsed_s: float) -> list[TraceItem]:
        self._last_s = elapsed_s
        items = []
        while self._next_s <= elapsed_s:
            prefix = self.shared.draw(self.rng, self._prefixes) if self.shared is not None else ()
            items.append(TraceItem(self._next_s, self.output.draw(self.rng), self.prompt.draw(self.rng),
                                   prefix_ids=prefix))
            self._next_s += self._gap()
        return items

    def next_arrival_s(self) -> float:
        return self._next_s


class TraceLoad:
    def __init__(self, items: list[TraceItem]):
        self.items = sorted(items, key=lambda i: i.arrival_s)
        self._index = 0

    @classmethod
    def from_file(cls, path: str) -> "TraceLoad":
        return cls(read_trace(path))

    def due(self, elapsed_s: float) -> list[TraceItem]:
        start = self._index
        while self._index < len(self.items) and self.items[self._index].arrival_s <= elapsed_s:
            self._index += 1
        return self.items[start:self._index]

    def next_arrival_s(self) -> float:
        return self.items[self._index].arrival_s if self._index < len(self.items) else math.inf

    @property
    def exhausted(self) -> bool:
        return self._index >= len(self.items)


def read_trace(path: str) -> list[TraceItem]:
    items = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                item = TraceItem(float(data["arrival_s"]), _positive(data.get("output_tokens")),
                                 _positive(data.get("prompt_tokens")), data.get("prompt"))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: bad trace line ({error})") from None
            if (item.prompt is None) == (item.prompt_tokens is None):
                raise ValueError(f"{path}:{number}: give exactly one of prompt_tokens and prompt")
            items.append(item)
    return items


def _positive(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"token counts must be integers >= 1, got {value!r}")
    return int(value)


def synthetic_prompt(num_tokens: int, rng: random.Random, vocab_low: int = 1000,
                     vocab_high: int = 30000) -> list[int]:
    """Prompt token ids for a length-only request: ordinary vocabulary, no special tokens."""
    return [rng.randrange(vocab_low, vocab_high) for _ in range(num_tokens)]
