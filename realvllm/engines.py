"""Real vLLM engines (the CPU build) on loopback, for tests, benchmarks and ``kvroute demo --real``.

The engines run from the real-vLLM venv that ``realvllm/install.sh`` builds outside the clone (a
cache folder keyed by the pinned versions; ``make real-vllm``), serving the tiny model it writes.
Each engine is one ``vllm serve`` process group on free ports (HTTP, KV-event PUB and replay, the
NIXL side channel), bound to one core, with its scratch files in a folder of the caller's; it is
stopped by its process group. Start-up costs 25-55 s, so start several at once (``start_all``)
and share them across tests.

What each engine is told, and why (facts measured on this 2-core machine):

* ``--block-size 32``: the CPU attention backend wants multiples of 32;
* ``-O0``: no compilation, ready in about 23 s instead of about 50 s;
* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), ``VLLM_CPU_OMP_THREADS_BIND=<core>``: two engines, one core each;
* ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``: there is no hub to reach;
* KV events on ZeroMQ with a replay socket, topic ``kv@<name>@<model>``;
* for P/D, ``NixlConnector`` with ``kv_buffer_device: cpu`` and a side-channel port of its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.testing import ROOT, free_port, stop_process, wait_ready

INSTALL_SCRIPT = ROOT / "realvllm" / "install.sh"
MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 32


class RealVLLMUnavailable(RuntimeError):
    """The real-vLLM environment is not built (run ``make real-vllm``)."""


@dataclass(frozen=True)
class RealEnv:
    """Where the real-vLLM venv and the tiny model live."""

    home: Path
    python: Path
    vllm: Path
    model: Path

    @property
    def tokenizer(self) -> Path:
        return self.model / "tokenizer.json"


def install(quiet: bool = False) -> RealEnv:
    """Build the environment if it is not built yet (idempotent; about 3 minutes the first time)."""
    out = subprocess.run(["bash", str(INSTALL_SCRIPT)], check=False, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if quiet else None)
    if out.returncode != 0:
        raise RealVLLMUnavailable(f"realvllm/install.sh failed with exit code {out.returncode}")
    return _env_at(Path(out.stdout.strip().splitlines()[-1]))


def find() -> RealEnv:
    """The built environment (without building it); raises ``RealVLLMUnavailable`` when missing."""
    out = subprocess.run(["bash", str(INSTALL_SCRIPT), "--where"], check=False, text=True, stdout=subprocess.PIPE)
    home = Path(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None
    if home is None:
        raise RealVLLMUnavailable("cannot locate the real-vLLM folder")
    return _env_at(home)


def _env_at(home: Path) -> RealEnv:
    venv = home / "venv"
    models = sorted(home.glob("tiny-model-v*/.complete"))
    if not (venv / ".installed").is_file() or not models:
        raise RealVLLMUnavailable(f"the real-vLLM environment is not built under {home}: run `make real-vllm`")
    return RealEnv(home=home, python=venv / "bin" / "python", vllm=venv / "bin" / "vllm", model=models[-1].parent)


_handed_out: set[int] = set()


def listen_port(low: int = 20000, high: int = 32000, attempts: int = 500, count: int = 1) -> int:
    """A port for an engine to listen on: below the kernel's ephemeral range (32768+), where outgoing
    connections take their local ports, and free on every interface (vLLM binds its event sockets to
    ``*``), never handed out twice by this process. A port picked by binding port 0 comes from the
    ephemeral range and, on a busy machine, was taken by some connection in the half minute before
    the engine bound it (seen in CI: "Address already in use" for a replay socket). ``count``: the
    first of that many consecutive ports (a data-parallel engine's event sockets: port + rank)."""
    rng = random.Random()
    for _ in range(attempts):
        port = rng.randrange(low, high - count)
        ports = range(port, port + count)
        if any(p in _handed_out for p in ports):
            continue
        if not all(_bindable(p) for p in ports):
            continue
        _handed_out.update(ports)
        return port
    if count == 1:
        return free_port()
    raise RuntimeError(f"no {count} consecutive free ports in {low}..{high}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@dataclass
class Engine:
    """One ``vllm serve`` process (group) and the ports it owns; ``start``/``stop``/``kill`` by PID."""

    env: RealEnv
    name: str
    scratch: Path
    core: int | None = None
    nixl: bool = False
    num_gpu_blocks: int | None = None
    max_model_len: int = 4096
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: /reset_prefix_cache and the other dev endpoints
    responses_store: bool = False  # VLLM_ENABLE_RESPONSES_API_STORE: /v1/responses keeps what it answers
    data_parallel_size: int = 1  # engines behind the one API port; rank r publishes on the event ports + r
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)  # on top of ``environment``'s own
    host: str = "127.0.0.1"
    port: int = field(default_factory=lambda: listen_port())
    events_port: int = 0  # 0: picked (data_parallel_size consecutive ports)
    replay_port: int = 0
    nixl_port: int = field(default_factory=lambda: listen_port())
    proc: subprocess.Popen | None = None
    starts: int = 0
    stuck: list[subprocess.Popen] = field(default_factory=list)  # killed but not yet reaped (``kill``)

    def __post_init__(self) -> None:
        self.events_port = self.events_port or listen_port(count=self.data_parallel_size)
        self.replay_port = self.replay_port or listen_port(count=self.data_parallel_size)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.name}@{MODEL_NAME}"

    @property
    def log(self) -> Path:
        return self.scratch / f"{self.name}.log"

    def kv_events(self) -> list[dict[str, str]]:
        """The router's ``kv_events`` entries for this engine: one per data-parallel rank, as vLLM offsets
        both sockets' ports by the rank."""
        return [{"endpoint": f"tcp://{self.host}:{self.events_port + r}",
                 "replay": f"tcp://{self.host}:{self.replay_port + r}", "topic": self.topic}
                for r in range(self.data_parallel_size)]

    def command(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": self.topic}
        cmd = [str(self.env.vllm), "serve", str(self.env.model), "--served-model-name", MODEL_NAME,
               "--host", self.host, "--port", str(self.port), "--block-size", str(BLOCK_SIZE), "-O0",
               "--dtype", "bfloat16", "--seed", "0", "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", "32", "--kv-events-config", json.dumps(events), "--disable-uvicorn-access-log"]
        if self.num_gpu_blocks:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.data_parallel_size > 1:
            cmd += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.nixl:
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                                        "kv_buffer_device": "cpu"})]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        tmp = self.scratch / f"{self.name}-tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
        env.update({
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
            "VLLM_CONFIG_ROOT": str(tmp / "vllm-config"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
            "TMPDIR": str(tmp), "HF_HOME": str(tmp / "hf"), "PYTHONUNBUFFERED": "1",
            "PYTHONHASHSEED": "0",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
        })
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.responses_store:
            env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        if self.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
        if self.nixl:  # vLLM's AMX attention dies after a NIXL transfer: realvllm/no_amx/sitecustomize.py
            env["PYTHONPATH"] = str(Path(__file__).resolve().parent / "no_amx")
        env.update(self.extra_env)
        return env

    def start(self) -> Engine:
        """Start the process (not waiting for it to be ready: see ``wait``)."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is already running"
        self.scratch.mkdir(parents=True, exist_ok=True)
        if self.starts:  # a restart: a fresh NIXL side-channel port (see ``restart``)
            self.nixl_port = listen_port()
        self.starts += 1
        with open(self.log, "ab") as out:
            out.write(f"\n==== start {self.starts}: {' '.join(self.command())}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.command(), cwd=self.scratch, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.environment(), start_new_session=True)
        return self

    def wait(self, timeout: float = 240.0) -> Engine:
        assert self.proc is not None, f"{self.name} was never started"
        wait_ready(self.url + "/health", self.proc, timeout=timeout, log=self.log, interval=0.5)
        return self

    def stop(self) -> None:
        """SIGTERM the engine's process group, SIGKILL after a grace period (and reap any set aside)."""
        if self.proc is not None:
            stop_process(self.proc, grace=15.0)
        for proc in self.stuck:
            stop_process(proc, grace=1.0)
        self.stuck = []

    def kill(self, group_timeout: float = 300.0) -> None:
        """SIGKILL the whole process group at once (a crash, as far as the router can tell).

        Then it waits (up to ``group_timeout``) for the rest of the group to be gone, not just its
        leader: a killed NIXL worker spends a long time exiting in the kernel (measured here: 90 s in
        state R, its memory already gone, one core busy), and a new start beside it crawled; in CI
        twice it printed nothing in 240 s. A leader stuck in the kernel beyond 30 s is set aside, to
        be reaped by ``stop``, so that a new start is not held up by it."""
        if self.proc is not None and self.proc.poll() is None:
            pgid = self.proc.pid
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"{self.name}: process {self.proc.pid} not reaped 30 s after SIGKILL; set aside", flush=True)
                self.stuck.append(self.proc)
                self.proc = None
            started = time.monotonic()
            while time.monotonic() - started < group_timeout:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            else:
                print(f"{self.name}: process group {pgid} still alive {group_timeout:g} s after SIGKILL", flush=True)
            if time.monotonic() - started > 5:
                print(f"{self.name}: the killed process group took {time.monotonic() - started:.0f} s more to exit",
                      flush=True)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@contextmanager
def start_lock(env: RealEnv, timeout: float = 900.0) -> Iterator[None]:
    """One engine start-up at a time on this machine, across processes.

    Starting an engine is CPU-bound for tens of seconds (imports, weights, KV cache set-up); several
    test sessions or benchmarks starting engines at once on a 2-core machine each take minutes
    instead. Running engines do not hold the lock."""
    with open(env.home / ".start.lock", "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {env.home / '.start.lock'} for {timeout:g}s") from exc
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def start_all(engines: Sequence[Engine], timeout: float = 300.0) -> list[Engine]:
    """Start the engines together (one core each) and wait for all; on failure stop them all and raise
    with the log. Holds ``start_lock`` meanwhile."""
    if not engines:
        return []
    with start_lock(engines[0].env):
        for attempt in range(1, 4):
            marks = {e.name: e.log.stat().st_size if e.log.exists() else 0 for e in engines}
            for e in engines:
                e.start()
            deadline = time.monotonic() + timeout
            try:
                for e in engines:
                    e.wait(timeout=max(1.0, deadline - time.monotonic()))
                return list(engines)
            except RuntimeError:  # an engine exited: a port taken meanwhile is worth another try
                for e in engines:
                    e.stop()
                clash = [e for e in engines if "Address already in use" in
                         e.log.read_bytes()[marks[e.name]:].decode(errors="replace")]
                if not clash or attempt == 3:
                    raise
                print(f"engines {[e.name for e in clash]}: a port was taken before they bound it; new ports",
                      flush=True)
                for e in engines:
                    e.port, e.events_port, e.replay_port = listen_port(), listen_port(), listen_port()
                    e.nixl_port = listen_port()
            except BaseException:
                for e in engines:
                    e.stop()
                raise
    raise AssertionError("unreachable")


def restart(engine: Engine, timeout: float = 300.0, attempts: int = 2) -> Engine:
    """Start a stopped or killed engine again on the same HTTP and KV-event ports and wait until it is
    ready; a start that hangs is killed and tried again (up to ``attempts``), its log tail printed.

    Each start after the first takes a fresh NIXL side-channel port (``Engine.start``): nothing
    outside the engine is configured with it (a prefill engine names it in the
    ``kv_transfer_params`` it returns), and vLLM 0.32 waits forever,
    without a word in its log, when that port cannot be bound (the handshake listener's thread dies
    before it sets the event the worker waits on)."""
    with start_lock(engine.env):
        for attempt in range(1, attempts + 1):
            engine.start()
            try:
                return engine.wait(timeout)
            except TimeoutError as exc:
                engine.kill()
                if attempt == attempts:
                    raise
                print(f"{engine.name}: start {engine.starts} hung, trying again: {exc}", flush=True)
    raise AssertionError("unreachable")


def stop_all(engines: Sequence[Engine], remove_scratch: bool = False) -> None:
    for e in engines:
        e.stop()
    if remove_scratch:
        for e in engines:
            shutil.rmtree(e.scratch / f"{e.name}-tmp", ignore_errors=True)


@contextmanager
def running(engines: Sequence[Engine]) -> Iterator[list[Engine]]:
    """Start ``engines`` (``start_all``), yield them, and stop them however the block ends."""
    started = start_all(engines)
    try:
        yield started
    finally:
        stop_all(engines)


def router_pod(engine: Engine, role: str = "both", **extra: Any) -> dict[str, Any]:
    """A router ``pods`` entry for ``engine``."""
    return {"id": engine.name, "url": engine.url, "model": MODEL_NAME, "role": role,
            "kv_events": engine.kv_events(), **extra}
