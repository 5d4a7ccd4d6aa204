"""Engine configuration: one frozen dataclass, validated when built."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from batchtop.engine.model import CUDA_GRAPH_MODES
from batchtop.kernels import BACKENDS

from .batch import LAYOUTS
from .knobs import KNOBS, POLICIES

DTYPES = ("float32", "bfloat16", "float16")
MAX_BATCH_CAPACITY = 1024
MIN_BATCH_CAPACITY = 256                      # the default capacity: room to raise max_num_seqs live


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 0     # 0: no per-request cap within the budget
    block_size: int = 16
    enable_prefix_caching: bool = True        # vLLM's default: full blocks cached and shared by prefix
    num_kv_blocks: int | None = None          # wins over kv_cache_mb when given
    kv_cache_mb: float = 1024.0
    max_model_len: int | None = None          # default: the model's context length
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    batching_mode: str = "continuous"
    static_batch_size: int = 8                # B of static and dynamic batching
    dynamic_timeout_s: float = 0.5            # dynamic: form a partial batch after this wait
    layout: str = "condense"
    attention_backend: str = "auto"
    # persistent-batch rows, the ceiling for max_num_seqs; None: max(MIN_BATCH_CAPACITY, max_num_seqs)
    batch_capacity: int | None = None
    num_threads: int | None = None
    device: str = "cpu"                       # cpu, cuda or cuda:N (the Triton kernels serve attention there)
    # on: decode steps replay CUDA graphs (CUDA only); off; eager (tests). Off until a GPU run validates
    # the graphs (docs/kernels.md, "CUDA graphs for decode steps").
    cuda_graphs: str = "off"
    snapshot_interval_steps: int = 1000       # an EngineSnapshot event every N steps (0: only when asked)
    flight_recorder_steps: int = 256          # steps of events kept for a crash log (0: none)

    def __post_init__(self):
        if self.batch_capacity is None:
            seqs = self.max_num_seqs
            room = seqs if isinstance(seqs, int) and not isinstance(seqs, bool) else 0
            object.__setattr__(self, "batch_capacity", min(MAX_BATCH_CAPACITY, max(MIN_BATCH_CAPACITY, room)))
        check_int("batch_capacity", self.batch_capacity, 1, MAX_BATCH_CAPACITY)
        for knob in KNOBS.values():                # the live knobs' start values, as set_knob checks them
            knob.check(getattr(self, knob.name), self.batch_capacity)
        check_int("block_size", self.block_size, 1, 1024)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, "
                             f"got {self.enable_prefix_caching!r}")
        check_int("snapshot_interval_steps", self.snapshot_interval_steps, 0, 10**9)
        check_int("flight_recorder_steps", self.flight_recorder_steps, 0, 1_000_000)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 1, 10**8)
        if not self.kv_cache_mb > 0:
            raise ValueError(f"kv_cache_mb must be > 0, got {self.kv_cache_mb!r}")
        check_choice("policy", self.policy, POLICIES)
        check_choice("layout", self.layout, LAYOUTS)
        check_choice("attention_backend", self.attention_backend, BACKENDS)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPH_MODES)
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")


def _knobs_of(cls, config: EngineConfig):
    return cls(**{name: getattr(config, name) for name in KNOBS})


# The live knobs' values, one field per row of KNOBS, each defaulting to EngineConfig's start value.
SchedulerKnobs = dataclasses.make_dataclass(
    "SchedulerKnobs",
    [(k.name, k.type, dataclasses.field(default=EngineConfig.__dataclass_fields__[k.name].default))
     for k in KNOBS.values()],
    namespace={"of": classmethod(_knobs_of)})
SchedulerKnobs.__module__ = __name__
SchedulerKnobs.__doc__ = ("The live knobs' values, one field per row of KNOBS (defaults: EngineConfig's); "
                          "the engine changes them between steps. `SchedulerKnobs.of(config)` takes them "
                          "from an EngineConfig.")


def check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
