"""Step time from a recording's own StepFinished timings: no profiling run.

The forward pass is fitted on what each step computed (`StepShape`: prefill tokens, decode rows, rows
through the LM head, context tokens read, prefill attention work) by several linear laws with
non-negative coefficients (one of them, "products", prices the weight products at the model's own
multiply-adds: a row's last token also goes through the LM head; where the engine's products run in tiles
of rows, it is also fitted with a price per tile beside the price per row), each fitted to minimise the
relative error (robust to steps slowed by other work on the machine); the simplest law whose held-out
error (MAPE over 5 interleaved folds) is within one standard error or 5% of the lowest wins (a recording
tells its laws apart only on the shapes it ran) and is refitted on every step. A predicted forward time
is the law times the recording's own ratio of measured to fitted time, split in two (`Slowdown`): a
factor per number of rows (where the law misfits a batch size), and the machine's load over time, drawn
(seeded) from the recorded steps nearest the step's start on the virtual clock: a shared machine slows
some steps many-fold and whole stretches of a run two-fold, queues grow with the mean step, not the
typical one, and a what-if of an incident keeps the incident's moments of load where they were. The other
phases (schedule, prepare, sample, update) are fitted linear in the rows. The gap between back-to-back
steps (the loop's own time: the finished requests handed out, the new arrivals taken in) is a `GapLaw`
linear in the arrivals and retirements, fitted to the recorded gaps by least squares (their mean: a queue
grows with the mean gap). A step whose shape lies beyond what the recording saw is counted as
extrapolated, with how far.
"""
from __future__ import annotations

import functools
import math
import operator
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from batchtop.telemetry.slowdown import Slowdown

from .virtual import PhaseTimes, StepShape

PRODUCTS = "products"   # a law's feature: the weight products' multiply-adds, in tokens (`products_getter`)
IN_TILES = "_in_tiles"  # a feature's rows rounded up to whole tiles of the engine's products (`tiled`)

# name: the StepShape features of a law (an intercept always); a law with PRODUCTS is fitted only where
# the recording names its model's multiply-adds, and comes first: of laws alike in size it is preferred
LAWS: dict[str, tuple[str, ...]] = {
    # the layers' products are paid per token, the LM head's per head row: a decode row costs more than
    # a prompt token by the head's share (SmolLM2-135M: 0.27), which a recording at 4 rows cannot
    # measure (its steps have 1 to 4 head rows, alike) and a what-if at 32 rows pays 32 times
    "products": (PRODUCTS,),
    "products+context": (PRODUCTS, "context_tokens"),
    "tokens": ("num_tokens",),
    "prefill+decode": ("prefill_tokens", "decode_rows"),
    "prefill+decode+context": ("prefill_tokens", "decode_rows", "context_tokens"),
    "prefill+decode+context+attention": ("prefill_tokens", "decode_rows", "context_tokens",
                                         "prefill_attention"),
    # a decode step's cost concave in its rows (a CPU's matmul: 5.1, 6.7, 7.8 ms at 1, 2, 4 rows and 8.8 at
    # 8 for the tiny model on torch ops), which a linear term fitted on 1-4 rows prices at 11.5 ms at 8
    "prefill+log-decode": ("prefill_tokens", "log_decode_rows"),
    "prefill+log-decode+context": ("prefill_tokens", "log_decode_rows", "context_tokens"),
}
# a row count's factor counts this many steps at 1 beside its own: four recorded 2-row steps of a vLLM
# recording at max_num_seqs=4 gave factors of 0.75 to 1.24 from round to round, each carried into every
# 2-row step of a what-if at max_num_seqs=2
ROWS_PRIOR_STEPS = 20
# a row count the recording ran only at a few moments is timed by those moments' load: a recording at 4
# rows under a queue runs 1 to 3 rows only as it fills and drains (the serve check's: 21-25 steps of 2
# rows, all in the drain's last half second, a slow moment in two rounds of three); a row count whose
# steps lie in fewer than ROWS_MIN_PARTS of the run's RUN_PARTS equal parts of its time is flagged, as
# one of fewer than ROWS_PRIOR_STEPS steps is
RUN_PARTS = 20
ROWS_MIN_PARTS = 3
LOAD_SMOOTH_STEPS = 25           # the machine's load at a step: the mean ratio of this many steps either side
EXTRAPOLATION_MARGIN = 1.1        # a feature up to 10% beyond the recorded maximum still counts as seen
NUM_FOLDS = 5
# laws whose held-out MAPE is within this share of the lowest (or within its standard error) fit the
# recording alike: on the serve check's recordings (4 rows, AVX2) the laws' held-out errors lay within
# 0.8-1.9% of each other, and their forward times at 16 rows 20-45% apart
ALIKE_MAPE_SHARE = 0.05
OVERHEAD_PHASES = ("schedule_s", "prepare_s", "sample_s", "update_s")   # fitted linear in the rows
MIN_STEPS = 10


def _num_tokens(shape: StepShape) -> int:
    return shape.prefill_tokens + shape.decode_rows


def tiled(n: int, tile_rows: int | None) -> int:
    """`n` rows rounded up to whole tiles of `tile_rows` (None: `n`)."""
    return -(-n // tile_rows) * tile_rows if tile_rows else n


def feature_getter(name: str, tile_rows: int | None = None) -> Callable[[StepShape], float]:
    """The feature `name` as a function of the shape (looked up once: a step's hot path calls it); a
    name ending in IN_TILES (num_tokens_in_tiles, head_rows_in_tiles) is its rows in whole tiles of
    `tile_rows`."""
    base = name.removesuffix(IN_TILES)
    get = _num_tokens if base == "num_tokens" else operator.attrgetter(base)
    if base != name:
        return lambda shape: tiled(get(shape), tile_rows)
    return get


def head_share(weight_macs: tuple[int, int]) -> float:
    """A row through the LM head in tokens through the layers: the head's multiply-adds over a token's."""
    per_token, per_head_row = weight_macs
    return per_head_row / per_token


def products_getter(weight_macs: tuple[int, int], in_tiles: str = "",
                    tile_rows: int | None = None) -> Callable[[StepShape], float]:
    """The step's weight products in tokens: every token through the layers, and each head row through
    the LM head at `head_share`; `in_tiles` (IN_TILES): each product's rows in whole tiles of `tile_rows`."""
    share = head_share(weight_macs)
    tokens = feature_getter("num_tokens" + in_tiles, tile_rows)
    head_rows = feature_getter("head_rows" + in_tiles, tile_rows)
    return lambda shape: tokens(shape) + share * head_rows(shape)


def products_in_tiles(name: str) -> str | None:
    """For a law's PRODUCTS feature, "" (rows as they are) or IN_TILES (rows in whole tiles); None for any
    other feature."""
    if name.removesuffix(IN_TILES) != PRODUCTS:
        return None
    return name.removeprefix(PRODUCTS)


def design(shapes: list[StepShape], names: tuple[str, ...], weight_macs: tuple[int, int] | None = None,
           tile_rows: int | None = None) -> np.ndarray:
    x = np.ones((len(shapes), len(names) + 1))
    for j, name in enumerate(names):
        if (in_tiles := products_in_tiles(name)) is not None:
            get = products_getter(weight_macs, in_tiles, tile_rows)
        else:
            get = feature_getter(name, tile_rows)
        x[:, j + 1] = [get(s) for s in shapes]
    return x


def priced_per_feature(names: tuple[str, ...], coef: np.ndarray,
                       weight_macs: tuple[int, int] | None) -> tuple:
    """A fitted law's features and coefficients (the intercept first) with PRODUCTS (and PRODUCTS in
    tiles) priced as its two StepShape features: a price per token and one per head row."""
    names_out, coef_out = [], [float(coef[0])]
    for name, c in zip(names, coef[1:]):
        if (in_tiles := products_in_tiles(name)) is not None:
            names_out += ["num_tokens" + in_tiles, "head_rows" + in_tiles]
            coef_out += [float(c), float(c) * head_share(weight_macs)]
        else:
            names_out.append(name)
            coef_out.append(float(c))
    return tuple(names_out), tuple(coef_out)


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: features whose coefficient comes out negative are
    dropped one at a time (a step cannot get faster with more work)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda j: coef[j]))


def relative_l1_fit(x: np.ndarray, y: np.ndarray, iterations: int = 30) -> np.ndarray:
    """Non-negative coefficients that minimise the mean relative error (the MAPE itself), by iteratively
    reweighted least squares: a recording made beside other work has steps slowed many-fold, and a
    squared-error fit would chase them."""
    keep = y > 0
    x, y = x[keep], y[keep]
    coef = nonnegative_lstsq(x / y[:, None], np.ones(len(y)))
    for _ in range(iterations):
        residual = np.abs(x @ coef - y) / y
        weight = 1.0 / np.sqrt(np.maximum(residual, 1e-6) * 1.0)
        coef = nonnegative_lstsq(x / y[:, None] * weight[:, None], weight)
    return coef


def mape(predicted: np.ndarray, actual: np.ndarray) -> float:
    keep = actual > 0
    return float(np.mean(np.abs(predicted[keep] - actual[keep]) / actual[keep]))


@dataclass(frozen=True)
class Law:
    name: str
    names: tuple[str, ...]
    coef: tuple[float, ...]
    heldout_mape: float
    tile_rows: int | None = None       # the rows of a tile, for the features IN_TILES

    def predict(self, shape: StepShape) -> float:
        # the terms summed left to right from 0, then the intercept: the same sum, term for term, as
        # `coef[0] + sum(c * get(shape) ...)` (a prediction must not move by a rounding)
        total = 0
        for c, get in self._terms:
            total += c * get(shape)
        return self.coef[0] + total

    @functools.cached_property
    def _terms(self) -> tuple:
        return tuple((c, feature_getter(n, self.tile_rows)) for c, n in zip(self.coef[1:], self.names))

    def describe(self) -> str:
        in_tiles = f" in tiles of {self.tile_rows}"
        terms = [f"{c * 1e6:.3g} us x {name.replace(IN_TILES, in_tiles)}"
                 for c, name in zip(self.coef[1:], self.names) if c]
        return " + ".join([f"{self.coef[0] * 1e3:.3g} ms", *terms])


def fit_law(shapes: list[StepShape], times: list[float], laws: dict[str, tuple[str, ...]] = LAWS,
            weight_macs: tuple[int, int] | None = None, tile_rows: int | None = None) -> Law:
    """The simplest law (fewest features; of those alike in size, the first) whose held-out MAPE is within
    one standard error (over the folds) or ALIKE_MAPE_SHARE of the lowest, refitted on every step. Laws
    the recording cannot tell apart may still part where a what-if takes them: a recording at 4 rows on
    an AVX2 host fitted "tokens" at 12.8% and "prefill+log-decode" at 12.7%, and the real runs' forward
    times at 16 rows came out 19% and 44% above them. `weight_macs`: the model's (multiply-adds per
    token, per LM head row), for the laws with PRODUCTS (none without); `tile_rows`: the rows of the
    engine's product tiles, where its recording names them: a law with PRODUCTS is then fitted a second
    time with a price per tile (the tile's pass over its panel of the weights, whatever rows it holds)
    beside the price per row (their multiply-adds), and the one of the two with the lower held-out MAPE
    stands for it."""
    if len(shapes) < MIN_STEPS:
        raise ValueError(f"the recording has {len(shapes)} timed steps; fitting step times needs {MIN_STEPS}")
    y = np.asarray(times, dtype=float)
    fitted: list[tuple[Law, float, int]] = []     # each law, its held-out MAPE's standard error, its size
    for name, names in laws.items():
        if PRODUCTS not in names:
            fitted.append((*_fit(shapes, y, name, names), len(names)))
        elif weight_macs is not None:
            variants = [_fit(shapes, y, name, names, weight_macs)]
            if tile_rows:
                variants.append(_fit(shapes, y, f"{name} per tile of {tile_rows} and per row",
                                     (PRODUCTS + IN_TILES, *names), weight_macs, tile_rows))
            fitted.append((*min(variants, key=lambda v: v[0].heldout_mape), len(names)))
    lowest, standard_error, _ = min(fitted, key=lambda f: f[0].heldout_mape)
    tolerance = max(standard_error, ALIKE_MAPE_SHARE * lowest.heldout_mape)
    within = [(size, law) for law, _, size in fitted
              if law.heldout_mape <= lowest.heldout_mape + tolerance + 1e-9]
    return min(within, key=operator.itemgetter(0))[1]


def _fit(shapes: list[StepShape], y: np.ndarray, name: str, names: tuple[str, ...],
         weight_macs: tuple[int, int] | None = None, tile_rows: int | None = None) -> tuple[Law, float]:
    """One law fitted on every step, its held-out MAPE over NUM_FOLDS interleaved folds, and that MAPE's
    standard error."""
    x = design(shapes, names, weight_macs, tile_rows)
    fold = np.arange(len(shapes)) % NUM_FOLDS
    errors = []
    for k in range(NUM_FOLDS):
        train, test = fold != k, fold == k
        coef = relative_l1_fit(x[train], y[train])
        errors.append(mape(x[test] @ coef, y[test]))
    priced = priced_per_feature(names, relative_l1_fit(x, y), weight_macs)
    law = Law(name, *priced, float(np.mean(errors)), tile_rows)
    return law, float(np.std(errors, ddof=1) / math.sqrt(NUM_FOLDS))


@dataclass(frozen=True)
class GapSample:
    """One recorded gap between back-to-back steps and what the loop did in it."""
    gap_s: float
    num_arrived: int             # requests taken in before the next step
    num_retired: int             # requests the step before it finished


@dataclass(frozen=True)
class GapLaw:
    coef: tuple[float, float, float]     # intercept, per arrival, per retirement (seconds)
    mean_s: float                        # the recorded gaps' mean

    def __call__(self, num_arrived: int, num_retired: int) -> float:
        a, per_arrival, per_retirement = self.coef
        return a + per_arrival * num_arrived + per_retirement * num_retired

    def describe(self) -> str:
        a, per_arrival, per_retirement = self.coef
        return (f"{a * 1e6:.3g} us + {per_arrival * 1e6:.3g} us x arrivals + "
                f"{per_retirement * 1e6:.3g} us x retirements")


def fit_gap(samples: list[GapSample]) -> GapLaw:
    """The gap law of the recorded gaps (none recorded: no gap)."""
    if not samples:
        return GapLaw((0.0, 0.0, 0.0), 0.0)
    x = np.asarray([(1.0, s.num_arrived, s.num_retired) for s in samples])
    y = np.asarray([max(s.gap_s, 0.0) for s in samples])
    a, per_arrival, per_retirement = nonnegative_lstsq(x, y)
    return GapLaw((float(a), float(per_arrival), float(per_retirement)), float(y.mean()))


def fit_slowdown(shapes: list[StepShape], measured: list[float], law: Law) -> Slowdown:
    """The machine's load first (the mean ratio of the steps around each, whatever their rows), then each
    number of rows' factor on top of it: an overloaded recording runs few rows only at its quiet
    moments, and their ratio is the moment's, not the rows'. A row count's factor is the mean of its
    steps' and of ROWS_PRIOR_STEPS steps at 1 (the law itself): a count the recording ran a handful of
    times stays near the law instead of following a handful of noisy steps."""
    steps = sorted((shape.start_s, shape.num_rows, m / f) for shape, m in zip(shapes, measured)
                   if m > 0 and (f := law.predict(shape)) > 0)
    if not steps:
        return Slowdown({}, (), (), 1.0)
    ratios = np.asarray([ratio for _, _, ratio in steps])
    width = 2 * LOAD_SMOOTH_STEPS + 1
    padded = np.pad(ratios, LOAD_SMOOTH_STEPS, mode="edge")
    around = np.convolve(padded, np.ones(width) / width, mode="valid")
    by_rows: dict[int, list[float]] = {}
    for (_, rows, _), ratio, local in zip(steps, ratios, around):
        by_rows.setdefault(rows, []).append(ratio / local)
    factors = {rows: (sum(values) + ROWS_PRIOR_STEPS) / (len(values) + ROWS_PRIOR_STEPS)
               for rows, values in by_rows.items()}
    return Slowdown(factors, tuple(t for t, _, _ in steps),
                    tuple(ratio / factors[rows] for _, rows, ratio in steps), float(ratios.mean()))


@dataclass
class StepTimeModel:
    """Predicted phases of a step; counts the steps it had to extrapolate."""
    forward: Law
    overhead: dict[str, tuple[float, float]]    # phase: (intercept, per row)
    gap: GapLaw                                  # the loop's time between two steps
    slowdown: Slowdown                           # recorded forward time / the law's
    seen: dict[str, float]                       # the recorded maximum of each feature
    seed: int = 0
    rows_recorded: dict[int, int] = field(default_factory=dict)  # recorded steps of each row count
    rows_parts: dict[int, int] = field(default_factory=dict)     # of the run's RUN_PARTS, those it ran in
    num_predicted: int = 0
    num_extrapolated: int = 0
    max_beyond: dict[str, float] = field(default_factory=dict)   # feature: the largest ratio to `seen`
    num_rare_rows: int = 0                       # steps at a row count recorded seldom or at few moments
    rare_rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # such a row count: (steps, parts)
    forward_scale: float = 1.0                   # the forward times priced at this multiple of the fit's
    _rng: random.Random = field(init=False, repr=False)
    _overheads: tuple = field(init=False, repr=False)          # OVERHEAD_PHASES' (intercept, per row)
    _limits: tuple = field(init=False, repr=False)             # per seen feature: its getter and limit

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self._overheads = tuple(self.overhead[phase] for phase in OVERHEAD_PHASES)
        self._limits = tuple((name, feature_getter(name), high * EXTRAPOLATION_MARGIN, high)
                             for name, high in self.seen.items())

    @property
    def gap_s(self) -> float:
        return self.gap.mean_s

    @property
    def mean_slowdown(self) -> float:
        return self.slowdown.mean

    def __call__(self, shape: StepShape) -> PhaseTimes:
        self.count(shape)
        rows = shape.num_rows
        (a1, b1), (a2, b2), (a3, b3), (a4, b4) = self._overheads
        forward = (max(self.forward.predict(shape), 0.0) * self.slowdown.draw(self._rng, rows, shape.start_s)
                   * self.forward_scale)
        return PhaseTimes(a1 + b1 * rows, a2 + b2 * rows, forward, a3 + b3 * rows, a4 + b4 * rows)

    def count(self, shape: StepShape) -> None:
        """Count a predicted step, and whether (and how far) it lies beyond the recorded shapes."""
        self.num_predicted += 1
        beyond = False
        for name, get, limit, high in self._limits:
            value = get(shape)
            if value > limit:
                beyond = True
                ratio = value / high if high else math.inf
                self.max_beyond[name] = max(self.max_beyond.get(name, 0.0), ratio)
        self.num_extrapolated += beyond
        if not beyond and self.rows_recorded:
            rows = shape.num_rows
            recorded, parts = self.rows_recorded.get(rows, 0), self.rows_parts.get(rows, 0)
            if recorded < ROWS_PRIOR_STEPS or parts < ROWS_MIN_PARTS:
                self.num_rare_rows += 1
                self.rare_rows[rows] = (recorded, parts)

    def fresh(self, forward_scale: float = 1.0) -> StepTimeModel:
        """The same model with its counts at zero (one per what-if run), its forward times at
        `forward_scale` times the fit's (a machine that much slower; the other phases as fitted)."""
        return StepTimeModel(self.forward, self.overhead, self.gap, self.slowdown, self.seen, self.seed,
                             self.rows_recorded, self.rows_parts, forward_scale=forward_scale)

    def extrapolation(self) -> str | None:
        """None when every predicted step lay within the recording's shapes, at row counts it ran often
        enough to time them, at enough moments (a row count of a handful of recorded steps is timed by the
        law alone, one of a few moments by their load)."""
        parts = []
        if self.num_extrapolated:
            worst = ", ".join(f"{name} up to {ratio:.1f}x" for name, ratio in sorted(self.max_beyond.items()))
            parts.append(f"{self.num_extrapolated} of {self.num_predicted} steps beyond the recorded shapes "
                         f"({worst})")
        if self.num_rare_rows:
            rare = ", ".join(f"{rows} row{'s' * (rows != 1)}: {n} recorded, in {k} of {RUN_PARTS}"
                             for rows, (n, k) in sorted(self.rare_rows.items()))
            parts.append(f"{self.num_rare_rows} of {self.num_predicted} steps at row counts the recording "
                         f"ran fewer than {ROWS_PRIOR_STEPS} times or in fewer than {ROWS_MIN_PARTS} of "
                         f"{RUN_PARTS} equal parts of its time ({rare})")
        return "extrapolated: " + "; ".join(parts) if parts else None


def fit_model(shapes: list[StepShape], finished: list, gaps: list[GapSample],
              weight_macs: tuple[int, int] | None = None, tile_rows: int | None = None) -> StepTimeModel:
    """`shapes[i]` is what recorded step `finished[i]` (its StepFinished) computed; `gaps`: the recorded
    gaps between back-to-back steps; `weight_macs` and `tile_rows`: the model's and the engine's, where
    the recording names them."""
    forward = fit_law(shapes, [e.forward_s for e in finished], weight_macs=weight_macs, tile_rows=tile_rows)
    rows = design(shapes, ("num_rows",))
    overhead = {}
    for phase in OVERHEAD_PHASES:
        a, b = nonnegative_lstsq(rows, np.asarray([getattr(e, phase) for e in finished]))
        overhead[phase] = (float(a), float(b))
    seen = {name: float(max(map(feature_getter(name), shapes)))
            for name in ("num_rows", "prefill_tokens", "decode_rows", "context_tokens")}
    slowdown = fit_slowdown(shapes, [e.forward_s for e in finished], forward)
    return StepTimeModel(forward, overhead, fit_gap(gaps), slowdown, seen,
                         rows_recorded=dict(Counter(shape.num_rows for shape in shapes)),
                         rows_parts=parts_per_rows(shapes))


def parts_per_rows(shapes: list[StepShape]) -> dict[int, int]:
    """Per row count, in how many of RUN_PARTS equal parts of the recording's time (its first step's
    start to its last's) it ran a step."""
    first = min(shape.start_s for shape in shapes)
    length = max(shape.start_s for shape in shapes) - first
    parts: dict[int, set[int]] = {}
    for shape in shapes:
        part = min(int((shape.start_s - first) / length * RUN_PARTS), RUN_PARTS - 1) if length > 0 else 0
        parts.setdefault(shape.num_rows, set()).add(part)
    return {rows: len(seen) for rows, seen in parts.items()}
