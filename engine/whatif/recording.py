"""A recording read as what a what-if needs: the arrival trace, the engine it ran on, its steps.

The trace: per request its arrival time, prompt length, max_tokens, priority, the output length it
ended with and how it ended (an abort becomes a time after arrival). The engine: the KV pool, block
size, policy, layout and batch capacity from the header's `engine` entry (`batchtop record` writes
it), otherwise the pool from the steps and the engine's defaults for the rest, listed in `assumed`;
the model's weight products per token and per row through the LM head, where the entry has them
(the step-time law "products" needs them).
Times are seconds since the recording's first event. Anything unusable is a ValueError in one line.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.knobs import KNOBS
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import LogReader
from batchtop.telemetry.weights import weight_macs

QUEUE_EXITS = ("abort", "error")       # reasons a request retires between steps


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    priority: int
    num_output_tokens: int             # the output it ended with (max_tokens when it never retired)
    reason: str                        # stop | length | abort | error | unfinished
    abort_after_s: float | None        # abort / error: seconds after arrival
    input_s: float = 0.0               # a server's input path: from arrival until the engine could have it
    prompt_blocks: tuple[str, ...] = ()   # its full prompt blocks by prefix-cache hash (where recorded)

    @property
    def entry_s(self) -> float:
        """When the engine could first take it in: its arrival plus the server's input path."""
        return self.arrival_s + self.input_s

    def full_blocks(self, block_size: int) -> tuple[str, ...]:
        """The names of its prompt's full blocks (as many as its length holds)."""
        return self.prompt_blocks[: self.num_prompt_tokens // block_size]

    @property
    def stops(self) -> bool:
        """It ended on a stop token: a replay samples one at its recorded length."""
        return self.reason == "stop"


class PromptTokens:
    """Made-up token ids that share what the recorded prompts shared: each recorded full prompt block is
    one id repeated over the block (equal hashes, equal ids: a replay's prefix cache hits where the
    recorded one could), the rest of a prompt and its output an id of its request's own (shared with
    nothing), except the blocks after a prompt that later prompts name (`continued`, request id ->
    those names: Recording.continued_blocks), whose prompt tail and output tokens are those names' ids.
    Ids count from `first`, wrapping below `end` where given."""

    def __init__(self, block_size: int, first: int, end: int | None = None,
                 continued: dict[str, tuple[str, ...]] | None = None):
        self.block_size = block_size
        self._first, self._end = first, end
        self._ids: dict[str, int] = {}           # block name or request id -> its token id
        self.continued = continued or {}

    def _id(self, name: str) -> int:
        token = self._ids.get(name)
        if token is None:
            n = len(self._ids) if self._end is None else len(self._ids) % (self._end - self._first)
            token = self._ids[name] = self._first + n
        return token

    def own(self, request_id: str) -> int:
        """The request's own id: its prompt's tail, and its output where the caller wants one."""
        return self._id("request " + request_id)

    def block(self, name: str) -> list[int]:
        """The made-up tokens of the prompt block named `name`."""
        return [self._id(name)] * self.block_size

    def prompt(self, item: TraceRequest) -> list[int]:
        tokens = [token for name in item.full_blocks(self.block_size) for token in self.block(name)]
        tail = self.output(item.request_id, item.num_prompt_tokens, 0)
        return tokens + [tail] * (item.num_prompt_tokens - len(tokens))

    def output(self, request_id: str, num_prompt_tokens: int, index: int) -> int:
        """The request's output token `index` (from 0): in a block a later prompt names, that name's id."""
        names = self.continued.get(request_id)
        if names:
            block = (num_prompt_tokens + index) // self.block_size - num_prompt_tokens // self.block_size
            if block < len(names):
                return self._id(names[block])
        return self.own(request_id)

    def outputs_named(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        """Its output tokens up to the end of the last block a later prompt names (none: [])."""
        names = self.continued.get(request_id, ())
        end = (num_prompt_tokens // self.block_size + len(names)) * self.block_size - num_prompt_tokens
        return [self.output(request_id, num_prompt_tokens, index) for index in range(max(end, 0))]


@dataclass(frozen=True)
class InFlight:
    """A request already in the engine when the recording began, as the first snapshot that lists it had
    it: its request's arrival is known from its first token where the recording has that (else it is
    the recording's start); its priority where the snapshot says (schema 6), else 0."""
    request: TraceRequest
    status: str                        # running | padding (a static batch's finished row) | waiting |
                                       # preempted
    slot: int                          # its row of the batch (-1: not in it)
    num_output_tokens: int             # generated before the recording began
    num_computed_tokens: int
    num_blocks: int                    # KV blocks it held
    num_preemptions: int               # before the recording began (a preempted one computes again)
    num_hit_blocks: int | None = None  # leading blocks the prefix cache gave it at its last admission
    num_in_flight_tokens: int = 0      # of its computed tokens, those of a step in flight (vLLM async)


@dataclass(frozen=True)
class EngineSetup:
    num_kv_blocks: int
    block_size: int
    policy: str
    layout: str
    batch_capacity: int
    max_model_len: int
    knobs: dict                        # the knobs at the recording's start
    assumed: tuple[str, ...] = ()      # setup fields the recording did not carry
    vllm: dict | None = None           # made inside vLLM: the harness's Limits, and `version` ("0.32")
    weight_macs: tuple[int, int] | None = None   # multiply-adds per token, per head row (weights.py)
    product_tile_rows: int | None = None         # rows of the engine's product tiles (kernels/cpu.py)
    enable_prefix_caching: bool = False          # whether the engine cached prefixes

    def to_dict(self) -> dict:
        if self.vllm is not None:
            entry = {key: value for key, value in self.vllm.items() if key != "version"}
        else:
            entry = {"num_kv_blocks": self.num_kv_blocks, "block_size": self.block_size,
                     "policy": self.policy, "layout": self.layout, "batch_capacity": self.batch_capacity,
                     "max_model_len": self.max_model_len, "enable_prefix_caching": self.enable_prefix_caching}
        return (entry | ({"weight_macs": list(self.weight_macs)} if self.weight_macs else {})
                | ({"product_tile_rows": self.product_tile_rows} if self.product_tile_rows else {}))


@dataclass
class Recording:
    path: str
    header: dict
    events: list[ev.Event]
    t0: float
    requests: list[TraceRequest]
    setup: EngineSetup
    knob_changes: list[tuple[float, str, object]] = field(default_factory=list)   # (t, name, new)
    in_flight: tuple[InFlight, ...] = ()   # requests in its first snapshots that arrived before it began
    unseen: tuple[str, ...] = ()           # others its events name without an arrival, in no snapshot
    start_new_token_ratio: float | None = None   # retraction's estimate in a snapshot before its first step
    start_free_blocks: tuple[str, ...] | None = None   # the pool's free queue in that snapshot (names)
    num_before_snapshot: int = 0           # events before its joining snapshot: left out

    @property
    def model(self) -> str | None:
        return self.header.get("model")

    def replay_words(self) -> list[str]:
        """Where a what-if's runs start or run from less than the recording holds, a sentence each: a
        recording joined mid-run, prefix-cache hits it cannot replay."""
        return [words for words in (self._in_flight_words(), self._prefix_words(), self._output_hit_words())
                if words]

    def _output_hit_words(self) -> str | None:
        _, num_admissions, num_tokens = self._continuations
        if not num_tokens:
            return None
        return (f"{num_admissions} admissions took {num_tokens} tokens from cached blocks that no earlier "
                "prompt names nor continues (an output of a request the recording does not hold): a "
                "replay makes those up for no one, so every run computes them again")

    @property
    def continued_blocks(self) -> dict[str, tuple[str, ...]]:
        """Request id -> the names of the blocks after its prompt's full blocks that later prompts name
        and took from the cache at admission: its prompt's tail and its output, sent back (a chat's
        next turn takes the last answer). A replay gives those tokens the names' ids (PromptTokens)."""
        return self._continuations[0]

    @functools.cached_property
    def _continuations(self) -> tuple[dict[str, tuple[str, ...]], int, int]:
        """`continued_blocks`, and the admissions and tokens of hits on blocks that no earlier prompt
        names nor continues. An admission's hit blocks that no earlier arrival named continue the
        prompt of the latest earlier request whose full prompt blocks are exactly the blocks before
        them (a request in flight at the start too)."""
        continued: dict[str, tuple[str, ...]] = {}
        if not self.setup.enable_prefix_caching:
            return continued, 0, 0
        size = self.setup.block_size
        prompts = {r.request_id: r for r in self.requests}
        # each block's name -> the arrival that named it first (-1: named at the recording's start)
        first_named = dict.fromkeys(self.start_free_blocks or (), -1)
        by_prompt: dict[tuple[str, ...], str] = {}   # full prompt blocks -> the latest request with them
        for item in self.in_flight:
            names = item.request.full_blocks(size)
            first_named.update(dict.fromkeys(names, -1))
            by_prompt[names] = item.request.request_id
        order: dict[str, int] = {}
        num_admissions = num_tokens = 0
        for e in self.events:
            kind = type(e)
            if kind is ev.RequestArrived and e.request_id in prompts:
                k = order[e.request_id] = len(order)
                names = prompts[e.request_id].full_blocks(size)
                for name in names:
                    first_named.setdefault(name, k)
                by_prompt[names] = e.request_id
            elif kind is ev.RequestAdmitted and e.num_cached_tokens and e.request_id in order:
                if e.resumed:
                    continue
                k = order[e.request_id]
                hit = prompts[e.request_id].full_blocks(size)[: e.num_cached_tokens // size]
                first = next((i for i, name in enumerate(hit) if first_named[name] == k), None)
                if first is None:
                    continue
                source, tail = by_prompt.get(hit[:first]), hit[first:]
                known = continued.get(source, ())
                if source is None or known[:len(tail)] != tail[:len(known)]:
                    num_admissions += 1
                    num_tokens += len(tail) * size
                    continue
                continued[source] = max(known, tail, key=len)
        return continued, num_admissions, num_tokens

    def _prefix_words(self) -> str | None:
        if self.setup.enable_prefix_caching:
            return None
        cached = sum(e.num_cached_tokens for e in self.events if isinstance(e, ev.RequestAdmitted))
        if not cached:
            return None
        return (f"its requests took {cached} tokens from the prefix cache at admission, but its arrivals "
                "name no prompt blocks (recorded before schema 7): every run computes those tokens again, "
                "a heavier load than the recorded one")

    def _in_flight_words(self) -> str | None:
        joined, left_out = self.in_flight, self.unseen
        words = []
        if joined:
            words.append(f"{len(joined)} requests were in flight when the recording began (it holds no "
                         "arrival for them): every run starts from them as the recording's first snapshot "
                         "had them (a running one in its row of the batch with its KV blocks, the others "
                         "queued in its order); they have no end-to-end time")
            num_rows = sum(item.num_in_flight_tokens > 0 for item in joined)
            if num_rows:
                words.append(f"a step of {num_rows} rows was in flight at its start (vLLM's async "
                             "scheduling): every run schedules it again first and samples it")
        if left_out:
            words.append(f"{len(left_out)} requests were in flight when the recording began and are left out "
                         "(it holds no arrival for them), so every run starts with less load than the "
                         "recorded one and the identity replay differs while they run")
        if self.num_before_snapshot:
            words.append(f"its first {self.num_before_snapshot} events, before the snapshot it starts from, "
                         "are left out")
        return "; ".join(words) or None

    def block_parents(self) -> dict[str, str | None]:
        """Every prompt block its requests name (those in flight at its start too), each with the name of
        the block before it in its prompt (None: a first block); a parent comes before its children."""
        parents: dict[str, str | None] = {}
        for item in [*self.requests, *(joined.request for joined in self.in_flight)]:
            parent = None
            for name in item.full_blocks(self.setup.block_size):
                parents.setdefault(name, parent)
                parent = name
        return parents

    @property
    def num_in_flight(self) -> int:
        """Requests in flight when the recording began: those its snapshot lists and those it does not."""
        return len(self.in_flight) + len(self.unseen)

    @property
    def steps(self) -> list[ev.StepFinished]:
        return [e for e in self.events if isinstance(e, ev.StepFinished)]

    @property
    def wall_s(self) -> float:
        return self.events[-1].t - self.t0 if self.events else 0.0


def engine_header(engine) -> dict:
    """The header's `engine` entry of a running Engine: what a replay of it needs beyond its knobs, and
    for the step-time law its model's weight products (multiply-adds per token, per LM head row) and,
    where its products run on the packed CPU kernels, the rows of their tiles."""
    config = engine.config
    entry = {"num_kv_blocks": engine.kv.num_blocks, "block_size": config.block_size, "policy": config.policy,
             "layout": config.layout, "batch_capacity": config.batch_capacity,
             "max_model_len": engine.max_model_len, "enable_prefix_caching": config.enable_prefix_caching,
             "weight_macs": list(weight_macs(engine.loaded.model.config))}
    flat = engine.runner.flat_forward
    tile_rows = flat.product_tile_rows if flat is not None else None
    return entry | ({"product_tile_rows": tile_rows} if tile_rows else {})


def made_inside_vllm(header: dict) -> bool:
    """The dashboard records a server's engine as its `device`: "vllm 0.32.1" for batchtop inside vLLM."""
    return str(header.get("device") or "").startswith("vllm")


def vllm_version(header: dict) -> str:
    """"0.32" of a header's "vllm 0.32.1"."""
    release = str(header.get("device")).split()[-1]
    return ".".join(release.split(".")[:2])


def read_recording(path: str, engine: str | None = None) -> Recording:
    """The recording at `path` (of one engine of a fleet recording: `engine`); ValueError (one line)
    when it cannot be replayed."""
    with LogReader(path, engine) as log:
        header = log.header
        events = list(log)
        if log.truncated:
            raise ValueError(f"{path}: the recording is truncated (its last line is cut off): "
                             "a what-if needs a whole recording")
    return recording_from(header, events, path)


def recording_from(header: dict, events: list[ev.Event], path: str = "<events>") -> Recording:
    """A recording of events already read (a log, or an engine's sink in a test)."""
    whole, events = len(events), _from_its_snapshot(events)
    steps = [e for e in events if isinstance(e, ev.StepFinished)]
    if not steps:
        raise ValueError(f"{path}: no StepFinished events: nothing to fit step times on")
    if not any(e.forward_s > 0 for e in steps):
        raise ValueError(f"{path}: its StepFinished events carry no timings (forward_s is 0 throughout)")
    t0 = events[0].t
    requests = _trace(path, events, t0)
    in_flight, unseen = _in_flight(events, requests, t0)
    setup = (_vllm_setup if made_inside_vllm(header) else _setup)(
        header, events, requests + [item.request for item in in_flight])
    changes = [(e.t - t0, e.name, e.new) for e in events if isinstance(e, ev.KnobChanged)]
    joining = _joining_snapshot(events)
    return Recording(path, header, events, t0, requests, setup, changes, in_flight, unseen,
                     joining.new_token_ratio if joining else None, joining.free_blocks if joining else None,
                     whole - len(events))


def _joining_snapshot(events: list[ev.Event]) -> ev.EngineSnapshot | None:
    """The snapshot a recorder that joined a running engine starts with (before the first step it
    holds): retraction's admission estimate then, the pool's free queue."""
    for e in events:
        if isinstance(e, ev.EngineSnapshot):
            return e
        if isinstance(e, ev.StepPlanned):
            return None
    return None


def _from_its_snapshot(events: list[ev.Event]) -> list[ev.Event]:
    """A recording joined mid-run from the snapshot its recorder asked for on: the events before it (the
    end of a step under way as the recorder joined) name requests it holds no arrival for, and the
    snapshot has the state after them."""
    arrived: set[str] = set()
    nameless = False
    for k, e in enumerate(events):
        kind = type(e)
        if kind is ev.EngineSnapshot:
            return events[k:] if nameless else events
        if kind is ev.RequestArrived:
            arrived.add(e.request_id)
        elif kind is ev.StepFinished:
            nameless = nameless or not arrived.issuperset(e.sampled_request_ids)
        else:
            request_id = getattr(e, "request_id", None)
            nameless = nameless or (request_id is not None and request_id not in arrived)
    return events


def _in_flight(events: list[ev.Event], requests: list[TraceRequest],
               t0: float) -> tuple[tuple[InFlight, ...], tuple[str, ...]]:
    """The requests the events name without their arrival (in flight when the recording began): those a
    snapshot lists (a recorder that joins a running engine starts with one), in its order (running,
    then waiting), with what they had; and the ids of the rest."""
    arrived = {r.request_id for r in requests}
    named: dict[str, None] = {}
    listed: dict[str, tuple] = {}      # what the first snapshot listing it says, by EngineSnapshot field
    first_token: dict[str, float] = {}
    retired: dict[str, ev.RequestRetired] = {}
    for e in events:
        kind = type(e)
        if kind is ev.EngineSnapshot:
            for i, request_id in enumerate(e.request_ids):
                if request_id not in arrived and request_id not in listed:
                    preempted = int(e.statuses[i] == "preempted")       # a schema-5 snapshot: at least once
                    listed[request_id] = (e.statuses[i], e.slots[i], e.num_prompt_tokens[i],
                                          e.num_output_tokens[i], e.num_computed_tokens[i], e.num_blocks[i],
                                          e.max_tokens[i], e.priorities[i] if e.priorities else 0,
                                          e.num_preemptions[i] if e.num_preemptions else preempted,
                                          e.prompt_blocks[i] if e.prompt_blocks else (),
                                          e.num_hit_blocks[i] if e.num_hit_blocks else None)
        elif kind is ev.FirstToken:
            first_token[e.request_id] = e.t - e.ttft_s - t0
        elif kind is ev.RequestRetired:
            retired[e.request_id] = e
        if (request_id := getattr(e, "request_id", None)) is not None and request_id not in arrived:
            named[request_id] = None
    in_flight = []
    step_rows = _step_in_flight(events)
    for request_id, (status, slot, prompt, output, computed, blocks, max_tokens, priority,
                     preemptions, prompt_blocks, hit_blocks) in listed.items():
        arrival_s = min(first_token.get(request_id, 0.0), 0.0)
        r = retired.get(request_id)
        reason = r.reason if r is not None else "unfinished"
        aborted = reason in QUEUE_EXITS
        ended_with = max_tokens if r is None or aborted else max(1, r.num_output_tokens)
        trace = TraceRequest(request_id, arrival_s, prompt, max_tokens, priority, ended_with, reason,
                             r.t - t0 - arrival_s if aborted else None, prompt_blocks=prompt_blocks)
        in_flight.append(InFlight(trace, status, slot, output, computed, blocks, preemptions, hit_blocks,
                                  step_rows.get(request_id, 0) if status == "running" else 0))
    return tuple(in_flight), tuple(r for r in named if r not in listed)


def _step_in_flight(events: list[ev.Event]) -> dict[str, int]:
    """Under vLLM's async scheduling a recorder can join while a step is in flight: its plan came before
    the joining snapshot (the recording's first event), its outcome after (the first StepFinished,
    with no StepPlanned of its step). Its rows the outcome names, request id -> tokens: a prefill
    chunk's tokens, 1 for a row that only sampled; {} where no step was in flight. (Rows of requests
    that finished in the step before it are named nowhere: they ran to no purpose, left no state.)"""
    if not events or not isinstance(events[0], ev.EngineSnapshot):
        return {}
    planned: set[int] = set()
    chunks: dict[int, dict[str, int]] = {}
    for e in events:
        kind = type(e)
        if kind is ev.StepPlanned:
            planned.add(e.step)
        elif kind is ev.PrefillChunk:
            chunks.setdefault(e.step, {})[e.request_id] = e.num_tokens
        elif kind is ev.StepFinished:
            if e.step in planned:
                return {}
            return dict.fromkeys(e.sampled_request_ids, 1) | chunks.get(e.step, {})
    return {}


def _trace(path: str, events: list[ev.Event], t0: float) -> list[TraceRequest]:
    arrived: dict[str, ev.RequestArrived] = {}
    retired: dict[str, ev.RequestRetired] = {}
    for e in events:
        if isinstance(e, ev.RequestArrived):
            arrived[e.request_id] = e
        elif isinstance(e, ev.RequestRetired):
            retired[e.request_id] = e
    if not arrived:
        raise ValueError(f"{path}: no RequestArrived events: the recording has no arrival trace")
    requests = []
    for request_id, a in arrived.items():
        r = retired.get(request_id)
        if r is None:
            requests.append(TraceRequest(request_id, a.arrival_t - t0, a.num_prompt_tokens, a.max_tokens,
                                         a.priority, a.max_tokens, "unfinished", None, a.input_s,
                                         a.prompt_blocks))
            continue
        aborted = r.reason in QUEUE_EXITS
        requests.append(TraceRequest(request_id, a.arrival_t - t0, a.num_prompt_tokens, a.max_tokens,
                                     a.priority, a.max_tokens if aborted else max(1, r.num_output_tokens),
                                     r.reason, r.t - a.arrival_t if aborted else None, a.input_s,
                                     a.prompt_blocks))
    return requests


def _weight_macs(engine: dict) -> tuple[int, int] | None:
    """The header's `engine` entry's weight_macs (None in a recording made before it was written)."""
    macs = engine.get("weight_macs")
    return tuple(macs) if macs else None


def knobs_at_start(header: dict, events: list[ev.Event]) -> dict:
    """The knobs in force when the recording began: the header's, each knob the recording changes as its
    first change found it (a batching mode set before a recorder joined takes effect at the static
    batch's end; the header has the value set)."""
    knobs = dict(header.get("knobs") or {})
    changed = set()
    for e in events:
        if isinstance(e, ev.KnobChanged) and e.name not in changed:
            changed.add(e.name)
            knobs[e.name] = e.old
    return knobs


def _setup(header: dict, events: list[ev.Event], requests: list[TraceRequest]) -> EngineSetup:
    engine = dict(header.get("engine") or {})
    defaults = EngineConfig()
    assumed = []
    total = next((e.kv_blocks_total for e in events if isinstance(e, ev.StepFinished)), None)
    values = {}
    for name, fallback in (("num_kv_blocks", total), ("block_size", defaults.block_size),
                           ("policy", header.get("policy") or defaults.policy),
                           ("layout", header.get("layout") or defaults.layout),
                           ("batch_capacity", defaults.batch_capacity),
                           ("enable_prefix_caching", _names_prompt_blocks(requests))):
        if name in engine:
            values[name] = engine[name]
        else:
            values[name] = fallback
            if name != "num_kv_blocks":
                assumed.append(name)
    # The persistent batch only has to hold the longest request of the trace.
    max_model_len = max(r.num_prompt_tokens + r.max_tokens for r in requests)
    knobs = {name: value for name, value in knobs_at_start(header, events).items() if name in KNOBS}
    missing = [name for name in KNOBS if name not in knobs]
    if "max_num_seqs" in missing or "max_num_batched_tokens" in missing:
        raise ValueError("the recording's header lacks the knobs max_num_seqs and max_num_batched_tokens")
    for name in missing:
        knobs[name] = getattr(defaults, name)
        assumed.append(name)
    return EngineSetup(values["num_kv_blocks"], values["block_size"], values["policy"], values["layout"],
                       values["batch_capacity"], max_model_len, knobs, tuple(assumed),
                       weight_macs=_weight_macs(engine), product_tile_rows=engine.get("product_tile_rows"),
                       enable_prefix_caching=values["enable_prefix_caching"])


def _names_prompt_blocks(requests: list[TraceRequest]) -> bool:
    """Whether the engine cached prefixes, where the header does not say: its requests' arrivals name
    their prompt blocks only where it did."""
    return any(r.prompt_blocks for r in requests)


# vLLM's scheduler knobs that batchtop's class turns live (engine/vllm/control.py), and the
# harness's defaults for the set-up a live recording does not carry (prefix caching: on where its
# arrivals name prompt blocks).
VLLM_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold")
VLLM_DEFAULTS = {"block_size": 16, "policy": "fcfs", "async_scheduling": False}


def _vllm_setup(header: dict, events: list[ev.Event], requests: list[TraceRequest]) -> EngineSetup:
    """The harness's Limits: the header's `engine` entry (a harness run writes it), else the pool from
    the steps (plus vLLM's null block) and the harness's defaults, listed in `assumed`."""
    engine = dict(header.get("engine") or {})
    knobs = {name: value for name, value in knobs_at_start(header, events).items() if name in VLLM_KNOBS}
    if "max_num_seqs" not in knobs or "max_num_batched_tokens" not in knobs:
        raise ValueError("the recording's header lacks the knobs max_num_seqs and max_num_batched_tokens")
    knobs.setdefault("long_prefill_token_threshold", 0)
    total = next(e.kv_blocks_total for e in events if isinstance(e, ev.StepFinished))
    limits = {"num_blocks": engine.get("num_blocks", total + 1),
              "max_model_len": engine.get("max_model_len",
                                          max(r.num_prompt_tokens + r.max_tokens for r in requests))}
    assumed = []
    defaults = VLLM_DEFAULTS | {"enable_prefix_caching": _names_prompt_blocks(requests)}
    for name, default in defaults.items():
        if name not in engine:
            assumed.append(name)
        limits[name] = engine.get(name, default)
    limits.update(knobs)
    return EngineSetup(limits["num_blocks"] - 1, limits["block_size"], limits["policy"], "vllm",
                       knobs["max_num_seqs"], limits["max_model_len"], knobs, tuple(assumed),
                       {**limits, "version": vllm_version(header)}, _weight_macs(engine),
                       enable_prefix_caching=limits["enable_prefix_caching"])
