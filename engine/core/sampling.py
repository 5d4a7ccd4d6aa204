"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchtop.kernels import cpu

GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-6           # a smaller top_p keeps only the most likely token, as this does


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 means no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        # below this the softmax overflows in float32; the answer is the argmax anyway
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Picks one token per row from `[num_rows, vocab]` logits.

    Greedy rows take the argmax together. Random rows share the temperature / top-k /
    top-p arithmetic and then draw with their own generator, so a seeded request
    samples the same tokens whatever else is in the batch.
    """

    def __init__(self):
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> list[int]:
        tokens = _argmax(logits)
        random_rows = [i for i, (_, params) in enumerate(rows) if not params.greedy]
        if random_rows:
            index = torch.tensor(random_rows)
            # on the CPU, where the per-request generators live (a few rows of logits to copy off a GPU)
            probs = _filtered_probs(logits[index.to(logits.device)].float().cpu(),
                                    [rows[i][1] for i in random_rows])
            for k, i in enumerate(random_rows):
                request_id, params = rows[i]
                tokens[i] = torch.multinomial(probs[k], 1, generator=self._generator(request_id, params))[0]
        return tokens.tolist()

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
            self._generators[request_id] = generator
        return generator


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu.available():
        return cpu.argmax_rows(logits)          # torch's CPU argmax is 3-5x slower at a vocabulary's width
    return logits.argmax(dim=-1)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    if any(top_k):
        vocab = logits.shape[-1]
        k = torch.tensor([min(k, vocab) if k else vocab for k in top_k])
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([max(p.top_p, MIN_TOP_P) for p in params]).unsqueeze(1)
    if (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)
