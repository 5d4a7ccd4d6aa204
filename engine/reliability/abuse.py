"""The API under abuse: oversized bodies, limits and beyond, floods, slow readers, bad bytes, keys.

    python -m batchtop.engine.reliability.abuse [--flood 2000]

Starts the tiny model behind the server with an API key and runs every case against it; each
case names what it sent and what it expected, and every answer's status is counted: the server
must answer none of them with 5xx, and must still serve afterwards. `run_cases(url, key)` is the
same against any batchtop server. Figures: docs/reliability.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from batchtop.engine.bench.figures import RELIABILITY, commit, cpu_name, publish
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.server.app import ServerThread, build_server

API_KEY = "abuse-key"
# Every route that controls the engine or reads what a web page must not: (method, path, JSON body).
CONTROL_ROUTES = [("POST", "/v1/knobs", {"name": "max_num_seqs", "value": 1}), ("POST", "/v1/pause", None),
                  ("POST", "/v1/resume", None), ("POST", "/v1/step", None),
                  ("POST", "/v1/requests/cmpl-0/abort", None), ("GET", "/v1/knobs", None),
                  ("GET", "/v1/events", None)]


@dataclass
class Case:
    name: str
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def expect(self, response: httpx.Response, *allowed: int) -> httpx.Response:
        self.statuses[response.status_code] += 1
        if response.status_code not in allowed:
            self.problems.append(f"got {response.status_code}, expected {allowed}: {response.text[:200]}")
        elif response.status_code >= 400 and "error" not in _json(response):
            body = response.text[:200]
            self.problems.append(f"{response.status_code} without an OpenAI error body: {body}")
        return response


@dataclass
class AbuseReport:
    cases: list[Case]
    elapsed_s: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(sum(c.statuses.values()) for c in self.cases)

    @property
    def num_5xx(self) -> int:
        return sum(n for c in self.cases for status, n in c.statuses.items() if status >= 500)

    @property
    def problems(self) -> list[str]:
        return [f"{c.name}: {p}" for c in self.cases for p in c.problems]

    def text(self) -> str:
        lines = ["| case | requests | statuses | ok |", "|---|---:|---|---|"]
        for c in self.cases:
            statuses = ", ".join(f"{s}x{n}" for s, n in sorted(c.statuses.items()))
            lines.append(f"| {c.name} | {sum(c.statuses.values())} | {statuses} | "
                         f"{'yes' if not c.problems else 'NO'} |")
        lines.append(f"\n{len(self.cases)} cases, {self.num_requests} requests, 5xx {self.num_5xx}, "
                     f"problems {len(self.problems)}, {self.elapsed_s:.1f} s")
        lines += [f"  {p}" for p in self.problems[:30]]
        return "\n".join(lines)


def _json(response: httpx.Response):
    try:
        return response.json()
    except ValueError:
        return {}


def run_cases(url: str, api_key: str | None, model: str, max_model_len: int, max_body_bytes: int,
              flood: int = 2000) -> AbuseReport:
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        cases = [
            _oversized_bodies(client, model, max_body_bytes),
            _context_limits(client, model, max_model_len),
            _odd_numbers(client, model),
            _bad_bytes(client, model),
            _deep_and_wide(client, model, max_body_bytes),
            _slow_reader(url, headers, client, model),
            _flood(url, headers, model, flood),
        ]
        if api_key:
            cases.append(_keys(url, api_key))
        cases.append(_origins_and_hosts(url, headers, model))
        still = Case("still serving afterwards")
        still.expect(client.post("/v1/completions",
                                 json={"model": model, "prompt": [1, 2], "max_tokens": 3}), 200)
        cases.append(still)
    return AbuseReport(cases, time.perf_counter() - started)


def _oversized_bodies(client, model, limit) -> Case:
    case = Case("bodies at and over the size limit (413)")
    pad = limit - 200
    just_under = json.dumps({"model": model, "prompt": [1], "max_tokens": 1, "pad": "x" * pad}).encode()
    case.expect(client.post("/v1/completions", content=just_under,
                            headers={"Content-Type": "application/json"}),
                200)
    over = json.dumps({"model": model, "prompt": [1], "max_tokens": 1, "pad": "x" * (limit + 10)}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/knobs"):
        case.expect(client.post(path, content=over, headers={"Content-Type": "application/json"}), 413)

    def chunked():                                # no Content-Length: counted as it arrives
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536
    case.expect(client.post("/v1/completions", content=chunked(),
                            headers={"Content-Type": "application/json"}),
                413)
    return case


def _context_limits(client, model, max_model_len) -> Case:
    case = Case("prompt and max_tokens at and beyond the context")
    post = lambda body: client.post("/v1/completions", json={"model": model, **body})  # noqa: E731
    case.expect(post({"prompt": [7] * (max_model_len - 1), "max_tokens": 1}), 200)
    case.expect(post({"prompt": [7] * max_model_len, "max_tokens": 1}), 400)
    case.expect(post({"prompt": [7] * (10 * max_model_len), "max_tokens": 1}), 400)
    case.expect(post({"prompt": [7] * 8, "max_tokens": max_model_len - 8, "ignore_eos": True}), 200)
    case.expect(post({"prompt": [7] * 8, "max_tokens": max_model_len - 7}), 400)
    case.expect(post({"prompt": "word " * (2 * max_model_len), "max_tokens": 1}), 400)
    case.expect(client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "word " * (2 * max_model_len)}]}), 400)
    for max_tokens in (10**9, 2**63, 2**80, 0, -1, 1.5, "many", None):
        case.expect(post({"prompt": [7], "max_tokens": max_tokens}), 200 if max_tokens is None else 400)
    return case


def _odd_numbers(client, model) -> Case:
    case = Case("odd numbers and shapes in sampling fields")
    raw = lambda text: client.post("/v1/completions", content=text.encode(),  # noqa: E731
                                   headers={"Content-Type": "application/json"})
    base = f'{{"model": "{model}", "prompt": [1, 2], "max_tokens": 2'
    for field_text in ('"temperature": NaN', '"temperature": Infinity', '"temperature": 1e400',
                       '"top_p": NaN', '"top_p": -Infinity', '"top_k": 100000000000000000000000',
                       '"seed": 100000000000000000000000', '"seed": -1', '"temperature": 1e308',
                       '"max_tokens": 1e400', '"n": 2', '"stop": [""]', '"stop": "' + "s" * 10_000 + '"',
                       '"prompt": [[]]', '"prompt": []', '"prompt": [[1], []]', '"prompt": [-1]',
                       '"prompt": [1e30]', '"stream_options": {"include_usage": "yes"}'):
        case.expect(raw(f"{base}, {field_text}}}"), 200, 400)
    return case


def _bad_bytes(client, model) -> Case:
    case = Case("invalid UTF-8 and unpaired surrogates")
    json_type = {"Content-Type": "application/json"}
    case.expect(client.post("/v1/completions",
                            content=b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe\xfd"}',
                            headers=json_type), 400)
    case.expect(client.post("/v1/chat/completions", content=b'{"model": "' + model.encode()
                            + b'", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
                            headers=json_type), 400)
    case.expect(client.post("/v1/knobs", content=b'{"name": "max_num_seqs\xff", "value": 4}',
                            headers=json_type), 400)
    for text in ('"\\ud800"', '"a\\udfffb"', '"\\u0000"'):
        case.expect(client.post("/v1/completions",
                                content=f'{{"model": "{model}", "prompt": {text}, "max_tokens": 1}}',
                                headers=json_type), 200, 400)
    case.expect(client.post("/v1/completions", content=b"\x00\x01\x02", headers=json_type), 400)
    case.expect(client.post("/v1/requests/%FF%FE/abort"), 404)
    case.expect(client.get("/v1/events", params={"from_step": "\u00ff"}), 400)
    return case


def _deep_and_wide(client, model, limit) -> Case:
    case = Case("deeply nested and very wide JSON")
    json_type = {"Content-Type": "application/json"}
    depth = min(limit // 2 - 100, 200_000)
    deep = b'{"model": "' + model.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    case.expect(client.post("/v1/completions", content=deep, headers=json_type), 400)
    case.expect(client.post("/v1/knobs",
                            content=b'{"name": "x", "value": ' + b"[" * depth + b"]" * depth + b"}",
                            headers=json_type), 400)
    for num_prompts, status in ((256, 200), (300, 400)):      # the server's default --max-prompts-per-request
        wide = json.dumps({"model": model, "prompt": [[1]] * num_prompts, "max_tokens": 1})
        case.expect(client.post("/v1/completions", content=wide, headers=json_type), status)
    return case


def _slow_reader(url, headers, client, model) -> Case:
    """A stream read one byte at a time through a tiny receive buffer, while others are served."""
    case = Case("a client reading its stream one byte at a time")
    host, port = urlsplit(url).hostname, urlsplit(url).port
    body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 64, "ignore_eos": True,
                       "stream": True})
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{head}"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.settimeout(60)
    sock.connect((host, port))
    sock.sendall(request)
    received = bytearray()
    try:
        for _ in range(400):                         # the first bytes slowly: the server must not wait on us
            received += sock.recv(1)
            time.sleep(0.001)
        started = time.monotonic()
        meanwhile = client.post("/v1/completions", json={"model": model, "prompt": [1], "max_tokens": 8,
                                                         "ignore_eos": True})
        case.expect(meanwhile, 200)
        if time.monotonic() - started > 20:
            case.problems.append("a request waited behind the slow reader")
        while chunk := sock.recv(1):
            received += chunk
    finally:
        sock.close()
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0
    case.statuses[status] += 1
    text = received.decode("utf-8", "replace")
    if status != 200 or "data: [DONE]" not in text or '"finish_reason":"length"' not in text.replace(" ", ""):
        case.problems.append(f"the slow stream did not end well: status {status}, {len(received)} bytes")
    return case


def _flood(url, headers, model, num_requests) -> Case:
    """`num_requests` tiny requests at once, each on its own connection."""
    case = Case(f"{num_requests} tiny requests at once")

    async def flood():
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=300) as aclient:
            body = {"model": model, "prompt": [3], "max_tokens": 1}
            return await asyncio.gather(*[aclient.post("/v1/completions",
                                                       json=body) for _ in range(num_requests)],
                                        return_exceptions=True)
    for response in asyncio.run(flood()):
        if isinstance(response, Exception):
            case.problems.append(f"{type(response).__name__}: {response}")
        elif case.expect(response, 200, 429).status_code == 429 and "retry-after" not in response.headers:
            case.problems.append("a 429 without Retry-After")           # --max-waiting refused it
    del case.problems[10:]
    return case


def _keys(url, api_key) -> Case:
    """Wrong keys of every shape are refused (compared in constant time), control included."""
    case = Case("API keys: wrong, partial, longer, non-ASCII; control without the key")
    wrong = [None, "", "Bearer", f"Bearer {api_key[:-1]}", f"Bearer {api_key}x", f"Bearer {api_key.upper()}",
             f"bearer {api_key}", api_key, f"Bearer  {api_key}", "Bearer " + "x" * 10_000]
    with httpx.Client(base_url=url, timeout=30) as client:
        for header in wrong:
            for method, path, body in CONTROL_ROUTES:
                headers = {} if header is None else {"Authorization": header}
                case.expect(client.request(method, path, headers=headers, json=body), 401)
        raw = httpx.Headers([(b"Authorization", b"Bearer \xff\xfe" + api_key.encode())])
        case.expect(client.post("/v1/pause", headers=raw), 401)
        knobs = case.expect(client.get("/v1/knobs", headers={"Authorization": f"Bearer {api_key}"}), 200)
        if _changed_by_control(_json(knobs)):
            case.problems.append("a refused control request changed the engine")
    return case


def _changed_by_control(state: dict) -> bool:
    """GET /v1/knobs's answer shows a control request of CONTROL_ROUTES took effect (paused, or the
    knob it sets at its value)."""
    return bool(state.get("paused")) or state.get("knobs", {}).get("max_num_seqs") == 1


def _origins_and_hosts(url, headers, model) -> Case:
    """What a web page in the operator's browser can send: a foreign Origin on every control route and
    on the reads it must not see (403); a DNS-rebinding page's own name as Host (421, every route). The
    server's own origin and IP-literal hosts pass; nothing refused changes the engine."""
    case = Case("browser origins and rebinding Host names")
    own = urlsplit(url).netloc
    completion = ("POST", "/v1/completions", {"model": model, "prompt": [1, 2], "max_tokens": 2})
    foreign = ["http://evil.example", "https://localhost.evil.example", "null", f"http://{own}.evil.example"]
    rebinding = ["evil.example", f"evil.example:{urlsplit(url).port}", "localhost.evil.example",
                 "127.0.0.1.nip.io"]
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for origin in foreign:
            for method, path, body in CONTROL_ROUTES + [completion]:
                case.expect(client.request(method, path, json=body, headers={"Origin": origin}), 403)
        for host in rebinding:
            for method, path, body in CONTROL_ROUTES + [completion, ("GET", "/health", None)]:
                case.expect(client.request(method, path, json=body, headers={"Host": host}), 421)
        method, path, body = completion
        case.expect(client.request(method, path, json=body, headers={"Origin": f"http://{own}"}), 200)
        case.expect(client.get("/v1/knobs", headers={"Host": own}), 200)
        if _changed_by_control(_json(case.expect(client.get("/v1/knobs"), 200))):
            case.problems.append("a refused request from a web page changed the engine")
    return case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchtop.engine.reliability.abuse",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=2000, help="tiny requests sent at once")
    parser.add_argument("--no-write", action="store_true", help="print; leave docs/reliability.md")
    args = parser.parse_args(argv)
    at = commit()                               # the code the figures come from: HEAD as the run starts
    config = EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=256, max_num_seqs=64, num_threads=1)
    server = build_server(config, api_key=API_KEY)
    with ServerThread(server) as thread:
        report = run_cases(thread.url, API_KEY, server.model_name, server.engine.max_model_len,
                           server.max_body_bytes, flood=args.flood)
    server.loop.stop()
    text = "\n".join([SECTION, "",
                      f"`python -m batchtop.engine.reliability.abuse --flood {args.flood}` (written by it), "
                      f"commit {at}, {time.strftime('%Y-%m-%d')}, {cpu_name()}, {os.cpu_count()} CPUs, load "
                      f"average {os.getloadavg()[0]:.1f} at the end:", "", report.text(), ""])
    publish(SECTION, text, write=not args.no_write, doc=RELIABILITY)
    return 1 if report.problems or report.num_5xx else 0


SECTION = "## The API under abuse: figures"


if __name__ == "__main__":
    sys.exit(main())
