"""What the protocol tests share: the hosts' settings and a handle on a running host."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass

import httpx

API_KEY = "protocol-test-key"
ALLOWED_HOST = "batchtop.test"
ALLOWED_ORIGIN = "https://dashboard.example"
MAX_BODY_BYTES = 4096
START_TIMEOUT_S = 400


@dataclass
class Host:
    kind: str
    url: str
    max_num_seqs: int                 # the start value (vLLM: the knob's upper limit)
    process: subprocess.Popen | None = None
    server: object = None             # serve only: the BatchtopServer

    def add(self, n: int) -> None:
        """n requests of 16 prompt tokens and 24 output tokens."""
        if self.process is not None:
            assert self.tell(f"add {n}").startswith("ok")
            return
        from batchtop.engine.core.sampling import SamplingParams
        for _ in range(n):
            self.server.loop.add_request(list(range(1, 17)), SamplingParams(max_tokens=24, ignore_eos=True))

    def client(self, key: str | None = API_KEY, **headers) -> httpx.Client:
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def tell(self, line: str) -> str:
        """guest only: a command to guest_host.py, its answer."""
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        while True:                      # skip anything else the process prints (vLLM's log lines)
            answer = self.process.stdout.readline()
            if not answer or answer.startswith("ok "):
                return answer.strip()
