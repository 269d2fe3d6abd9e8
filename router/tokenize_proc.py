"""Big prompts tokenized in a child process, so their Python work never holds the router's GIL.

A request body of ``tokenize_offload_bytes`` or more is tokenized off the event loop, and one of
``tokenize_crowded_bytes`` or more when the loop is crowded (router/api.py). The tokenizer's
Rust encode lets go of the GIL, but the Python around it does not: rendering the chat template,
finding the chunk ends and hashing chunks and blocks for the prefix token cache, copying ids. For
a cold 32k-token prompt that is about 17 ms of Python, and while a tokenize *thread* runs it every
small request waits for the GIL at each of its awaits. On the build machine (2 cores, one
connection of small chat requests beside one of cold 32k-token prompts, six alternating rounds of
4 s) the small requests' p99 was 4.9-6.3 ms (median 5.7) with the thread and 3.1-4.5 ms (median
3.5) with the same work in a child process (a prototype); a thread that only slept as long gave
3.2-4.3 ms, so the process removes what the GIL cost (docs/router.md, "Overhead at real prompt sizes").

**The child.** One process, ``python -m router.tokenize_proc``, started with the router and owning
a tokenizer loaded from the same ``tokenizer`` setting and its own prefix token cache. It talks to
the router's event loop over a socket pair (length-prefixed msgpack frames), one job at a time, at
most ``MAX_JOBS`` admitted at once. A job sends the raw request body (the child parses it again)
and what keys the blocks (block size, the model's key seed, adapter, salt) and gets back the
prompt's length, the other prompts' tokens of a completion batch, the block keys (a msgpack list
of ints: half the time of packing them into an array and back, 12 against 24 µs for 550 keys),
the tokens themselves only when the prompt has no full block (the decision needs them then), and
the cache's counters. A prompt the child cannot tokenize (a bad chat request) comes back as the
same 400 the thread would raise. A first version used ``concurrent.futures.ProcessPoolExecutor``:
its hand-offs through two helper threads added about 1.5 ms to an 8k-token follow-up (7.1-7.3
against 5.3-5.9 ms in threads, ``bench/overhead.py --sizes 8000 --kinds chat``, two runs each),
and its ``spawn`` start re-imports the parent's main script, which breaks any script without a
``__main__`` guard. The router decodes each message into its type (``_Ready``, ``_Answer``:
msgspec checks every field as it decodes, 17.7 against 17.0 µs untyped for an answer of 560 keys
in a throwaway microbenchmark) and checks that an answer's keys and tokens fit its length; a
message that does not is the child's failure (below). Until 2026-12-06 an answer was unpacked as
it came: one too short raised out of ``run``, and one with None for the length failed later, in
planning: a 500 either way.

**When it cannot answer** the request is tokenized in a tokenize thread, as without the process:
while the child starts (the first second or two), after it died (it is started again, at most
once every ``RESTART_AFTER_S``, 5 s, and twice as long after each start that died before it was
ready, up to 5 minutes), when it has not said it is ready ``START_TIMEOUT_S`` (60 s) after it was
started (it is killed, and started again as if it had died before it was ready), when a job runs
past ``timeout_s`` (the child is killed and started again, since a job cannot be taken back from
it) and when it answers something malformed (killed and started again too). A job that waited for
a slot while the child was killed goes to the threads as soon as it has the slot; until 2026-12-06
it wrote to the closed socket and waited out its timeout. The child exits when the router's end of
the socket closes. It runs in a process group of its own, so a signal to the router's group (a
terminal's Ctrl-C, ``kill -- -PGID``) reaches the router alone, which then stops the child or, by
exiting, closes its end; until 2026-12-05 the child took the group's SIGINT too, printed a
``KeyboardInterrupt`` stack trace and left the router warning that it had gone, on every Ctrl-C of
``kvroute serve``. It stays in the router's session: where the kernel groups processes by session
for the scheduler (autogroup, on by default on many distributions), a session of its own would make
it a peer of the whole router for CPU time rather than of one process. ``kvroute_tokenize_process_jobs``
counts the outcomes.

**Chunk sharing.** The router and its child each keep a prefix token cache, and a conversation's
turns may be tokenized in either (a follow-up whose new part is short is tokenized on the event loop
when the loop is not crowded: router/api.py), so each keeps the other's chunks: those the
child stores come back with each answer and go into the router's cache, and those the router stores
go to the child ahead of its next job (``adopt``). With workers or replicas on the booking bus, both
are published as well, and chunks heard from the bus go to both caches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from indexer.tokens import ServeChatFlags
from router.costs import batch_rest_tokens
from router.errors import APIError
from router.prompts import Unkeyed, prompt_block_keys, prompt_tokens, text_encoder

log = logging.getLogger("kvroute")

MAX_JOBS = 16  # admitted at once; the rest wait their turn (each waits at most ``timeout_s`` in all)
RESTART_AFTER_S = 5.0  # the least time between two starts of the child
MAX_RESTART_AFTER_S = 300.0  # doubled up to this while the child dies before it is ever ready
START_TIMEOUT_S = 60.0  # a child not ready this long after its start is killed (it hangs loading its tokenizer?)
MAX_FRAME = 1 << 30  # the stream reader's limit
MAX_ADOPT_BUFFER = 16 << 20  # chunks for the child are dropped while this much waits to reach it
_LEN = struct.Struct(">I")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

# the child's prefix token cache's counters, as ``CacheCounts`` takes them
_Counts = tuple[int, int, int, int, int, int, bool, bool, int, int]


class _Ready(msgspec.Struct, array_like=True, tag="ready", forbid_unknown_fields=True):
    """The child's first message, once its tokenizer is loaded: ``["ready", counts]``."""

    counts: _Counts | None


class _Answer(msgspec.Struct, array_like=True, tag="r", forbid_unknown_fields=True):
    """The child's answer to job ``job_id``: ``["r", job_id, count, ...]``. ``tokens`` only where
    ``keys`` is empty (no full block); ``stored``: the chunks its cache newly stored; ``error``:
    (status, message, param, code) of a prompt it could not tokenize; ``unkeyed``: ``count`` only
    estimates a prompt the router cannot key (``router.prompts.Unkeyed``), with no keys or tokens."""

    job_id: int
    count: Annotated[int, msgspec.Meta(ge=0)]
    rest: Annotated[int, msgspec.Meta(ge=0)]
    keys: list[int]
    tokens: list[int] | None
    counts: _Counts | None
    stored: list[tuple[int, bytes]] | None
    error: tuple[int, str, str | None, str | None] | None
    unkeyed: bool = False


_decode_reply = msgspec.msgpack.Decoder(_Ready | _Answer).decode


@dataclass(frozen=True)
class CacheCounts:
    """The child's prefix token cache, as its last answer left it (for the router's gauges)."""

    reused: int = 0
    tokenized: int = 0
    held: int = 0
    key_hits: int = 0
    key_misses: int = 0
    adopted: int = 0
    disabled: bool = False
    tiktoken: bool = False
    vouched: int = 0
    vouched_missing: int = 0


class PromptLength(Sequence[int]):
    """Stands in for a prompt's tokens where only their number is needed (the decision, which keys
    the prompt by its block keys)."""

    __slots__ = ("_n",)

    def __init__(self, n: int):
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("a prompt tokenized in the tokenize process has only its length and block keys")


def _chunks_out(chunks: Sequence[tuple[int, bytes]]) -> list[list[Any]]:
    """Chunks (chain key, token ids as uint32 bytes: indexer/prefix_tokens.py) as msgpack items."""
    return [[key, ids] for key, ids in chunks]


def _chunks_in(items: list[list[Any]]) -> list[tuple[int, bytes]]:
    return [(key, raw) for key, raw in items]


# ---- the child ------------------------------------------------------------------------------------
class _Child:
    def __init__(self, spec: str, cache_tokens: int, share: bool, tiktoken: bool = True,
                 chat_flags: ServeChatFlags | None = None):
        from indexer.tokens import HFTokenizer, load_tokenizer

        self.tokenizer: Any = load_tokenizer(spec)
        self.chat_flags = chat_flags  # the pods' chat-rendering serve flags, as the router has them
        self.cache: Any = None
        self.stored: list[tuple[int, bytes]] = []
        if isinstance(self.tokenizer, HFTokenizer) and cache_tokens > 0:
            self.cache = self.tokenizer.cache_prefixes(max_tokens=cache_tokens, tiktoken=tiktoken)
            if share:
                self.cache.on_stored = self.stored.extend

    def counts(self) -> _Counts | None:
        c = self.cache
        if c is None:
            return None
        s = c.stats
        return (s.reused_tokens, s.tokenized_tokens, c.held_tokens, s.key_hits, s.key_misses, s.adopted, c.disabled,
                c.twin, s.vouched, s.vouched_missing)

    def tokenize(self, job_id: int, kind: str, raw: bytes, block_size: int, seed: int, adapter: str | None,
                 salt: str | None, chars_per_token: float) -> _Answer:
        try:
            body = orjson.loads(raw)
            if salt is not None and isinstance(body, dict):
                # the request's salt as the router has it: a key's derived salt is in the router's body,
                # not in the client's bytes (router/api.py), and it seeds the prefix token cache's chunks
                # here as there (router/prompts.py)
                body["cache_salt"] = salt
            tokens = prompt_tokens(kind, body, self.tokenizer, None, self.chat_flags)
            rest = batch_rest_tokens(body, text_encoder(self.tokenizer, body), chars_per_token) \
                if kind == "completion" else 0
        except APIError as exc:
            return _Answer(job_id, 0, 0, [], None, self.counts(), None, (exc.status, exc.message, exc.param, exc.code))
        keys = prompt_block_keys(tokens, block_size, seed, adapter, salt)
        stored = self.stored[:] if self.stored else None
        self.stored.clear()
        if isinstance(tokens, Unkeyed):  # a rendering the router cannot reproduce: its length alone
            return _Answer(job_id, len(tokens), rest, [], None, self.counts(), stored, None, unkeyed=True)
        return _Answer(job_id, len(tokens), rest, keys, None if keys else list(tokens), self.counts(), stored, None)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return bytes(buf)


def child_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, ServeChatFlags | None]:
    """The child's command line (``TokenizeProcess._command``) and the chat serve flags it carries."""
    ap = argparse.ArgumentParser(description="kvroute's tokenize process (started by the router)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--cache-tokens", type=int, default=0)
    ap.add_argument("--share", action="store_true")
    ap.add_argument("--no-tiktoken", action="store_true")
    ap.add_argument("--default-chat-template-kwargs", default=None, help="JSON object (the router's setting)")
    ap.add_argument("--exclude-tools-when-tool-choice-none", action="store_true")
    ap.add_argument("--chat-template", default=None, help="the template's text (as the router read its setting)")
    ap.add_argument("--chat-template-content-format", choices=("auto", "string", "openai"), default="auto")
    ap.add_argument("--log-format", choices=("text", "json"), default="text", help="the router's log_format")
    args = ap.parse_args(argv)
    flags = None
    if args.default_chat_template_kwargs is not None or args.exclude_tools_when_tool_choice_none \
            or args.chat_template is not None or args.chat_template_content_format != "auto":
        defaults = orjson.loads(args.default_chat_template_kwargs) if args.default_chat_template_kwargs else None
        flags = ServeChatFlags(defaults, args.exclude_tools_when_tool_choice_none, args.chat_template,
                               args.chat_template_content_format)
    return args, flags


def child_main(argv: list[str] | None = None) -> int:
    """``python -m router.tokenize_proc --fd N --tokenizer SPEC``: serve jobs on socket ``N`` until it closes."""
    args, flags = child_args(argv)
    if args.log_format == "json":  # its warnings and a crash's traceback as the router's JSON lines
        from kvcommon.logs import configure_logging

        configure_logging("warning", "json")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core for its batches (router/serve.py)
    sock = socket.socket(fileno=args.fd)
    child = _Child(args.tokenizer, args.cache_tokens, args.share, not args.no_tiktoken, flags)

    def send(msg: _Ready | _Answer) -> None:
        payload = _encode(msg)
        sock.sendall(_LEN.pack(len(payload)) + payload)

    try:
        send(_Ready(child.counts()))
        while True:
            head = _read_exactly(sock, _LEN.size)
            if head is None:
                return 0  # the router closed its end (or exited)
            payload = _read_exactly(sock, _LEN.unpack(head)[0])
            if payload is None:
                return 0
            msg = _decode(payload)
            if msg[0] == "t":
                try:
                    send(child.tokenize(*msg[1:]))
                except OSError:
                    raise
                except Exception as exc:  # a bug, not a bad request: the router uses a thread for this one
                    send(_Answer(msg[1], 0, 0, [], None, child.counts(), None,
                                 (500, f"{type(exc).__name__}: {exc}", None, "tokenize-process")))
            elif msg[0] == "a" and child.cache is not None:
                child.cache.adopt(_chunks_in(msg[1]))
    except OSError:  # the router went away in the middle of a job: nobody is left to answer
        return 0


# ---- the router's side ---------------------------------------------------------------------------
class TokenizeProcess:
    """The router's handle on the child. ``run`` answers ``(tokens, rest, keys)``, or None when the
    child cannot answer now (the caller tokenizes in a thread instead). Used from one event loop."""

    def __init__(self, spec: str, cache_tokens: int, timeout_s: float, share: bool = False,
                 on_stored: Callable[[list[tuple[int, bytes]]], None] | None = None,
                 restart_after_s: float = RESTART_AFTER_S, tiktoken: bool = True,
                 start_timeout_s: float = START_TIMEOUT_S, chat_flags: ServeChatFlags | None = None,
                 log_format: str = "text"):
        self.spec = spec
        self.log_format = log_format  # the router's: the child logs (and crashes) in the same format
        self.chat_flags = chat_flags  # the pods' chat-rendering serve flags (router.prompts.serve_chat_flags)
        self.tiktoken = tiktoken
        self.cache_tokens = cache_tokens
        self.timeout_s = timeout_s
        self.share = share
        self.on_stored = on_stored
        self.restart_after_s = restart_after_s
        self.start_timeout_s = start_timeout_s  # a child not ready this long after its start is killed
        self._wait_s = restart_after_s  # before the next start: doubles while starts fail
        self.jobs: Counter[str] = Counter()  # done, bad-request, unavailable, busy, failed, timeout
        self.starts = 0
        self.cache: CacheCounts | None = None
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._ready = False
        self._started_at = -restart_after_s
        self._slots: asyncio.Semaphore | None = None
        self._adopt: list[bytes] = []  # frames of chunks for the child, sent ahead of its next job
        self._adopt_bytes = 0

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Start the child (it loads its tokenizer meanwhile; ``run`` answers None until it says ready)."""
        self._started_at = time.monotonic()
        self.starts += 1
        ours, theirs = socket.socketpair()
        cmd = self._command(theirs.fileno())
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # so ``router`` imports as here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            # its own process group (not session: see the module's docstring): the router's group's
            # signals are for the router, which stops the child itself
            self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                          process_group=0)
        except OSError as exc:
            ours.close()
            log.warning("tokenize process could not start (%s): large prompts go to the tokenize threads", exc)
            return
        finally:
            theirs.close()
        reader, self._writer = await asyncio.open_connection(sock=ours, limit=MAX_FRAME)
        self._reader_task = asyncio.create_task(self._read(reader, self._proc))

    def _command(self, fd: int) -> list[str]:
        """The child's command line, its end of the socket pair being ``fd``."""
        return [sys.executable, "-m", "router.tokenize_proc", "--fd", str(fd), "--tokenizer", self.spec,
                "--cache-tokens", str(self.cache_tokens), *(["--share"] if self.share else []),
                *([] if self.tiktoken else ["--no-tiktoken"]), *self._flag_args(),
                *(["--log-format", "json"] if self.log_format == "json" else [])]

    def _flag_args(self) -> list[str]:
        flags = self.chat_flags
        if flags is None:
            return []
        out = []
        if flags.default_chat_template_kwargs:
            out += ["--default-chat-template-kwargs", orjson.dumps(flags.default_chat_template_kwargs).decode()]
        if flags.exclude_tools_when_tool_choice_none:
            out.append("--exclude-tools-when-tool-choice-none")
        # the text the router read, not the setting: the child renders what the router renders even if
        # the file changes; "=" so that a text starting with "-" is not taken for an option
        if flags.chat_template is not None:
            out.append(f"--chat-template={flags.chat_template}")
        if flags.chat_template_content_format != "auto":
            out.append(f"--chat-template-content-format={flags.chat_template_content_format}")
        return out

    async def _read(self, reader: asyncio.StreamReader, proc: subprocess.Popen) -> None:
        why = "broke its stream"
        try:
            while True:
                head = await reader.readexactly(_LEN.size)
                msg = _decode_reply(await reader.readexactly(_LEN.unpack(head)[0]))
                if isinstance(msg, _Ready):
                    self._ready = True
                    self._wait_s = self.restart_after_s
                    self._counts(msg.counts)
                else:
                    fut = self._pending.pop(msg.job_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except msgspec.ValidationError as exc:  # a message of the wrong shape or types: its jobs fail
            why = f"sent a malformed message ({exc})"
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass
        finally:
            if self._proc is proc:  # the child went away (or sent garbage) on its own
                self._gone("exited" if proc.poll() is not None else why)

    def _counts(self, raw: _Counts | None) -> None:
        if raw is not None:
            self.cache = CacheCounts(*raw)

    def _gone(self, why: str) -> None:
        if not self._ready:  # it never came up (a tokenizer it cannot load?): wait longer each time
            self._wait_s = min(max(2 * self._wait_s, RESTART_AFTER_S), MAX_RESTART_AFTER_S)
            why += " before it was ready"
        log.warning("tokenize process %s: large prompts go to the tokenize threads until it is started again "
                    "(in %.0f s at the earliest)", why, self._wait_s)
        self.stop()

    def stop(self) -> None:
        proc, self._proc, self._ready = self._proc, None, False
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the tokenize process went away"))
        self._pending.clear()
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)  # killed: it is gone at once

    async def run(self, kind: str, raw: bytes, block_size: int, seed: int, adapter: str | None,
                  salt: str | None, chars_per_token: float) -> tuple[Sequence[int], int, list[int]] | None:
        since = time.monotonic() - self._started_at
        if self._proc is not None and not self._ready and since >= self.start_timeout_s:
            self._gone(f"was silent for {self.start_timeout_s:g} s")  # hung while it started: killed
        if self._proc is None and since >= self._wait_s:
            await self.start()
        if self._writer is None or not self._ready:
            self.jobs["unavailable"] += 1
            return None
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_JOBS)
        writer: asyncio.StreamWriter | None = None
        submitted = False
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._slots:
                    # the child may have been stopped (or started again) while this job waited for the
                    # slot: a write to its closed socket would be dropped, and the job wait out its timeout
                    writer = self._writer
                    if writer is None or not self._ready:
                        self.jobs["unavailable"] += 1
                        return None
                    self._next_id += 1
                    job_id = self._next_id
                    fut: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
                    self._pending[job_id] = fut
                    payload = _encode(["t", job_id, kind, raw, block_size, seed, adapter, salt, chars_per_token])
                    frames, self._adopt, self._adopt_bytes = self._adopt, [], 0
                    frames += (_LEN.pack(len(payload)), payload)
                    try:
                        writer.write(b"".join(frames))
                        submitted = True
                        answer = await fut
                    finally:
                        self._pending.pop(job_id, None)
        except TimeoutError:
            if not submitted:  # waited that long for a slot: busy, not stuck
                self.jobs["busy"] += 1
                return None
            self.jobs["timeout"] += 1
            if self._writer is writer:
                self._gone(f"took over {self.timeout_s:g} s for a prompt")
            return None
        except (ConnectionError, RuntimeError) as exc:  # it died, or was stopped meanwhile
            self.jobs["failed"] += 1
            if self._writer is writer:
                self._gone(f"failed ({type(exc).__name__}: {exc})")
            return None
        unkeyed = answer.unkeyed and answer.tokens is None and not answer.keys  # a length, no prefix to look up
        if answer.error is None and not unkeyed and (
                len(answer.keys) != answer.count // block_size or (answer.tokens is None) != bool(answer.keys)
                or (answer.tokens is not None and len(answer.tokens) != answer.count)):
            self.jobs["failed"] += 1
            if self._writer is writer:
                self._gone("answered with keys or tokens that do not fit the prompt's length")
            return None
        self._counts(answer.counts)
        if answer.stored and self.on_stored is not None:
            self.on_stored(answer.stored)
        if answer.error is not None:
            status, message, param, code = answer.error
            if status != 400:  # the child's own failure: the thread will tokenize it (or fail the same way)
                self.jobs["failed"] += 1
                return None
            self.jobs["bad-request"] += 1
            raise APIError(status, message, param=param, code=code)
        self.jobs["done"] += 1
        if unkeyed:  # as the loop's estimate is (router.prompts.Unkeyed): the decision hashes a keyless prompt's ids
            return Unkeyed([0] * answer.count), answer.rest, []
        return (answer.tokens if answer.tokens is not None else PromptLength(answer.count)), answer.rest, answer.keys

    def adopt(self, chunks: list[tuple[int, bytes]]) -> None:
        """Chunks tokenized elsewhere (in the router itself, or by another router process on the
        booking bus): the child takes them before its next job, in the same write (a write of their
        own would wake it for nothing). Past ``MAX_ADOPT_BUFFER`` waiting, they are dropped: the
        child then tokenizes those texts again. Callable from a tokenize thread."""
        payload = _encode(["a", _chunks_out(chunks)])
        if self._adopt_bytes + len(payload) <= MAX_ADOPT_BUFFER:
            self._adopt.append(_LEN.pack(len(payload)) + payload)
            self._adopt_bytes += len(payload) + _LEN.size


class TokenizeProcessCollector(Collector):
    """``kvroute_tokenize_process_jobs{outcome}``, ``_starts`` and ``_up``, read at scrape time."""

    def __init__(self, process: TokenizeProcess):
        self.process = process

    def describe(self):
        return []

    def collect(self):
        p = self.process
        jobs = CounterMetricFamily("kvroute_tokenize_process_jobs", "Large prompts offered to the tokenize process "
                                   "by outcome: done, bad-request (answered 400), and those tokenized in a thread "
                                   "instead: unavailable (starting or restarting), busy, failed, timeout",
                                   labels=["outcome"])
        for outcome in ("done", "bad-request", "unavailable", "busy", "failed", "timeout"):
            jobs.add_metric([outcome], float(p.jobs[outcome]))
        yield jobs
        starts = CounterMetricFamily("kvroute_tokenize_process_starts", "Times the tokenize process was started")
        starts.add_metric([], float(p.starts))
        yield starts
        up = GaugeMetricFamily("kvroute_tokenize_process_up", "1 while the tokenize process answers")
        up.add_metric([], 1.0 if p.ready else 0.0)
        yield up


if __name__ == "__main__":
    sys.exit(child_main())
