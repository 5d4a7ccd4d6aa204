"""The OpenAI wire format of the server: request schemas and text out of token ids (error bodies:
telemetry/protocol/errors.py).

Request bodies are pydantic models so that the OpenAPI schema describes them; a body
that breaks them is answered 400 (not FastAPI's 422) with an OpenAI error body.
Unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from batchtop.telemetry.protocol.errors import ApiError

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1       # torch.Generator.manual_seed's range


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1_000_000, description="vLLM extension; 0 or -1: no cut")
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    n: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    stop: str | list[str] | None = Field(None,
                                         description="up to 4 strings; generation stops when the text "
                                                     "contains one")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="vLLM extension: keep going past EOS (benchmarks)")
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="text, a list of texts, token ids, or a list of token-id lists (one choice each)")
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: what the context leaves")
    max_completion_tokens: int | None = Field(None, ge=1)


def message_text(content) -> str:
    """A chat message's content as plain text (text parts joined; other parts refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 4:
        raise ApiError(400, f"stop takes at most 4 strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return stops


class TextStream:
    """Token ids in, text deltas out: incremental detokenization with stop strings.

    Decoding a window from `prefix` keeps each token O(1) while multi-byte characters
    split over tokens come out whole (a trailing U+FFFD means "wait for the next token").
    With stop strings, the last len(longest stop) - 1 characters are held back until they
    cannot begin a stop string; a stop found trims the text before it.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.token_ids: list[int] = []
        self.num_tokens = 0           # every token generated, those after a stop string too (usage)
        self.text = ""                # decoded so far (stop trimmed away once found)
        self.sent = 0                 # characters of `text` handed out
        self.stopped = False
        self._prefix = self._read = 0

    def add(self, token_ids: list[int]) -> None:
        self.num_tokens += len(token_ids)
        if self.stopped:
            return
        self.token_ids.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.token_ids[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            searched_from = max(0, len(self.text) - self.hold)
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.token_ids)
            if self.stops:
                self._find_stop(searched_from)

    def _find_stop(self, start: int) -> None:
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True

    def delta(self, final: bool = False) -> str:
        """New text that can be sent: everything when final or stopped, else all but the held-back tail."""
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def finish(self) -> str:
        """Flush: text still held back, plus a trailing partial character decoded as it is."""
        if not self.stopped and self._read < len(self.token_ids):
            tail = self.tokenizer.decode(self.token_ids[self._prefix:], skip_special_tokens=True)
            head = self.tokenizer.decode(self.token_ids[self._prefix:self._read], skip_special_tokens=True)
            if len(tail) > len(head):
                searched_from = max(0, len(self.text) - self.hold)
                self.text += tail[len(head):]
                self._read = len(self.token_ids)
                if self.stops:
                    self._find_stop(searched_from)
        return self.delta(final=True)
