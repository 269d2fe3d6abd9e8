"""The tokenize process (router/tokenize_proc.py): the same answer as tokenizing in the router, the
same 400 for a bad chat request, and a tokenize thread whenever the child cannot answer (starting,
dead, too slow, silent at its start, answering garbage), with the child started again."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import msgspec
import orjson
import pytest

from indexer.keys import key_seed
from indexer.tokens import HFTokenizer
from router import tokenize_proc
from router.costs import batch_rest_tokens
from router.errors import APIError
from router.prompts import prompt_block_keys, prompt_tokens
from router.tokenize_proc import RESTART_AFTER_S, PromptLength, TokenizeProcess
from simulator.testing import free_port, process_tree
from tests.helpers import ROOT, kvroute_process
from tests.test_prefix_tokens import TOKENIZERS, corpus


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    TOKENIZERS["byte-level BPE (GPT-2)"].save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


async def until_ready(proc: TokenizeProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not proc.ready:
        assert time.monotonic() < deadline, "the tokenize process never came up"
        await asyncio.sleep(0.05)


def conversation(turns: int) -> list[dict]:
    history = [{"role": "system", "content": " ".join(corpus(60, seed=9))}]
    for t in range(turns):
        history += [{"role": "user", "content": " ".join(corpus(4, seed=t))},
                    {"role": "assistant", "content": " ".join(corpus(2, seed=50 + t))}]
    return history[:-1]


async def test_the_child_answers_as_the_router_would_tokenize(tokenizer_file):
    plain = HFTokenizer(tokenizer_file)
    proc = TokenizeProcess(tokenizer_file, cache_tokens=1_000_000, timeout_s=30)
    raw = orjson.dumps({"messages": conversation(1)})
    assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is None  # not started: it starts now
    try:
        await until_ready(proc)
        seed = key_seed("m")
        cases = [("chat", {"model": "m", "messages": conversation(t)}, None, None) for t in range(1, 5)]
        cases += [("chat", {"model": "m", "messages": conversation(4)}, "lora-a", "tenant-b"),
                  ("completion", {"model": "m", "prompt": [" ".join(corpus(40, seed=3)), "two", "three"]}, None, None),
                  ("completion", {"model": "m", "prompt": "tiny"}, None, None)]  # no full block: the tokens come back
        for kind, body, adapter, salt in cases:
            got = await proc.run(kind, orjson.dumps(body), 16, seed, adapter, salt, 4.0)
            assert got is not None
            tokens, rest, keys = got
            want = list(prompt_tokens(kind, body, plain))
            assert len(tokens) == len(want)
            assert keys == prompt_block_keys(want, 16, seed, adapter, salt)
            assert rest == (batch_rest_tokens(body, plain.encode, 4.0) if kind == "completion" else 0)
            if keys:
                assert isinstance(tokens, PromptLength)
            else:
                assert list(tokens) == want
        assert proc.jobs["done"] == len(cases)
        assert proc.cache is not None and proc.cache.reused > 0  # the follow-ups came from its prefix cache
    finally:
        proc.stop()


async def test_a_bad_chat_request_is_the_same_400_as_in_the_router(tokenizer_file):
    plain = HFTokenizer(tokenizer_file)
    body = {"model": "m", "messages": conversation(1), "chat_template": "{{ messages }}"}
    with pytest.raises(APIError) as here:
        prompt_tokens("chat", body, plain)
    proc = TokenizeProcess(tokenizer_file, cache_tokens=0, timeout_s=30)
    await proc.start()
    try:
        await until_ready(proc)
        with pytest.raises(APIError) as there:
            await proc.run("chat", orjson.dumps(body), 16, 1, None, None, 4.0)
        assert (there.value.status, there.value.message, there.value.param) == \
            (here.value.status, here.value.message, here.value.param) and there.value.status == 400
        assert proc.jobs["bad-request"] == 1
    finally:
        proc.stop()


async def test_a_dead_or_slow_child_sends_prompts_to_the_threads_and_is_started_again(tokenizer_file):
    raw = orjson.dumps({"model": "m", "messages": conversation(3)})
    proc = TokenizeProcess(tokenizer_file, cache_tokens=0, timeout_s=30, restart_after_s=0.0)
    await proc.start()
    try:
        await until_ready(proc)
        first = proc.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.ready:  # the router's end sees the socket close
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert proc.pid is None
        assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is None  # started again, not up yet
        assert proc.starts == 2 and proc.jobs["unavailable"] == 1 and proc.pid != first
        await until_ready(proc)
        assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is not None

        second = proc.pid
        proc.timeout_s = 1e-4  # no prompt is tokenized that fast: the job is given up, the child killed
        assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is None
        assert proc.jobs["timeout"] == 1 and proc.pid is None and not proc.ready
        with pytest.raises(ProcessLookupError):
            os.kill(second, 0)
        proc.timeout_s = 30
        assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is None
        assert proc.starts == 3
        await until_ready(proc)
        assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is not None
        assert proc.jobs["done"] == 2
    finally:
        proc.stop()


# a stand-in for the child that speaks its protocol badly on purpose (its last argument says how)
FAKE_CHILD = """
import socket, struct, sys, time
import msgspec
fd, mode = int(sys.argv[sys.argv.index("--fd") + 1]), sys.argv[-1]
sock = socket.socket(fileno=fd)
LEN = struct.Struct(">I")
def send(msg):
    payload = msgspec.msgpack.encode(msg)
    sock.sendall(LEN.pack(len(payload)) + payload)
def read(n):
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            sys.exit(0)
        buf += got
    return buf
if mode == "silent":
    time.sleep(120)
    sys.exit(0)
send(["ready", None])
while True:
    msg = msgspec.msgpack.decode(read(LEN.unpack(read(4))[0]))
    if msg[0] != "t":
        continue
    if mode == "hang":
        time.sleep(120)
    elif mode == "short":
        send(["r", msg[1]])
    elif mode == "none-length":
        send(["r", msg[1], None, 0, [], None, None, None, None])
    elif mode == "misfit":  # 100 tokens, yet neither their keys nor the tokens
        send(["r", msg[1], 100, 0, [], None, None, None, None])
"""


class FakeChild(TokenizeProcess):
    def __init__(self, script: str, mode: str, **kwargs):
        super().__init__("unused", 0, **kwargs)
        self.script, self.mode = script, mode

    def _command(self, fd: int) -> list[str]:
        return [sys.executable, self.script, "--fd", str(fd), self.mode]


@pytest.fixture
def fake_child(tmp_path):
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    return str(script)


RAW = orjson.dumps({"model": "m", "prompt": "hello world"})


async def test_a_child_that_never_says_it_is_ready_is_killed_and_started_again(fake_child):
    proc = FakeChild(fake_child, "silent", timeout_s=30, restart_after_s=0.0, start_timeout_s=1.0)
    await proc.start()
    try:
        first = proc.pid
        assert await proc.run("completion", RAW, 16, 1, None, None, 4.0) is None  # still starting
        assert proc.pid == first
        await asyncio.sleep(1.1)
        assert await proc.run("completion", RAW, 16, 1, None, None, 4.0) is None
        assert proc.pid is None and proc.jobs == Counter(unavailable=2)  # killed: the threads meanwhile
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        assert proc._wait_s == RESTART_AFTER_S  # as after a start that died before it was ready
        proc._started_at -= RESTART_AFTER_S  # as if those seconds had passed
        assert await proc.run("completion", RAW, 16, 1, None, None, 4.0) is None
        assert proc.starts == 2 and proc.pid not in (None, first)
    finally:
        proc.stop()


async def test_a_job_waiting_for_a_slot_when_the_child_is_killed_goes_to_the_threads_at_once(fake_child,
                                                                                            monkeypatch):
    """The first job holds the only slot until the child, stuck on it, is killed at its timeout; the
    second, waiting for the slot meanwhile, gives up then, not at its own timeout."""
    monkeypatch.setattr(tokenize_proc, "MAX_JOBS", 1)
    proc = FakeChild(fake_child, "hang", timeout_s=3.0)
    await proc.start()
    try:
        await until_ready(proc, timeout=30)

        async def second() -> tuple[object, float]:
            await asyncio.sleep(2.5)
            began = time.monotonic()
            got = await proc.run("completion", RAW, 16, 1, None, None, 4.0)
            return got, time.monotonic() - began

        first, (got, waited) = await asyncio.gather(proc.run("completion", RAW, 16, 1, None, None, 4.0), second())
        assert first is None and got is None
        assert proc.jobs == Counter(timeout=1, unavailable=1)
        assert waited < 2.0  # about 0.5 s: the first job's timeout, not its own 3 s
    finally:
        proc.stop()


@pytest.mark.parametrize("mode", ["short", "none-length", "misfit"])
async def test_a_malformed_answer_goes_to_the_threads_and_the_child_is_started_again(fake_child, mode):
    proc = FakeChild(fake_child, mode, timeout_s=30, restart_after_s=0.0)
    await proc.start()
    try:
        await until_ready(proc, timeout=30)
        first = proc.pid
        assert await proc.run("completion", RAW, 16, 1, None, None, 4.0) is None
        assert proc.jobs == Counter(failed=1) and proc.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        assert await proc.run("completion", RAW, 16, 1, None, None, 4.0) is None  # started again at once
        assert proc.starts == 2 and proc.pid not in (None, first)
    finally:
        proc.stop()


def test_the_child_exits_when_the_router_goes(tokenizer_file):
    """The child serves its socket until the router's end closes (as when the router's process
    ends, however it ends), then exits by itself."""
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-m", "router.tokenize_proc", "--fd", str(theirs.fileno()),
                              "--tokenizer", tokenizer_file], pass_fds=[theirs.fileno()], cwd=ROOT)
    theirs.close()
    try:
        ours.settimeout(60)
        size = int.from_bytes(ours.recv(4, socket.MSG_WAITALL), "big")
        assert msgspec.msgpack.decode(ours.recv(size, socket.MSG_WAITALL))[0] == "ready"
        ours.close()
        assert child.wait(10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_childs_crash_is_logged_in_the_routers_format(tmp_path, log_format):
    """A child that cannot load its tokenizer dies with an uncaught exception: with ``log_format:
    json`` its traceback is one JSON line on the router's stderr (it printed as bare text before)."""
    ours, theirs = socket.socketpair()
    proc = TokenizeProcess(str(tmp_path / "missing.json"), 0, 5.0, log_format=log_format)
    child = subprocess.run(proc._command(theirs.fileno()), pass_fds=[theirs.fileno()], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    theirs.close()
    ours.close()
    lines = [line for line in child.stderr.splitlines() if line.strip()]
    assert child.returncode != 0 and lines
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        assert records[-1]["level"] == "CRITICAL" and "missing.json" in records[-1]["exc"], records
    else:
        assert lines[0].startswith("Traceback") and "missing.json" in child.stderr


def test_a_ctrl_c_to_the_routers_process_group_stops_it_without_a_trace(tokenizer_file):
    """A terminal's Ctrl-C signals the whole foreground process group. The child runs in a group of
    its own, so only the router takes the SIGINT: no KeyboardInterrupt trace from the child, no
    warning that it went away, and the child still exits once the router has. It stays in the
    router's session, which the kernel's autogroup schedules as one."""
    port = free_port()
    pods = orjson.dumps([{"id": "p0", "url": "http://127.0.0.1:9", "model": "m"}]).decode()
    with kvroute_process(["serve", "--pods", pods, "--tokenizer", tokenizer_file, "--port", str(port),
                          "--log-level", "info"], ready_url=f"http://127.0.0.1:{port}/health", timeout=60) as proc:
        deadline = time.monotonic() + 60
        child = None
        while child is None:
            assert time.monotonic() < deadline, "the router never started its tokenize process"
            for pid in process_tree([proc.pid]):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"router.tokenize_proc" in f.read():
                            child = pid
                except OSError:
                    pass
            time.sleep(0.05)
        assert os.getpgid(child) == child != os.getpgid(proc.pid) and os.getsid(child) == os.getsid(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        assert proc.stdout is not None
        log = proc.stdout.read().decode(errors="replace")
    assert "Shutting down" in log  # the router took the signal and stopped as it should
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "tokenize process" not in log, log  # no warning that the child went away
    deadline = time.monotonic() + 10
    while True:  # the router's end of the socket closed with it: the child follows
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the tokenize process outlived the router"
        time.sleep(0.05)


async def test_a_child_that_never_comes_up_is_started_again_less_and_less_often(tmp_path):
    proc = TokenizeProcess(str(tmp_path / "missing" / "tokenizer.json"), cache_tokens=0, timeout_s=30,
                           restart_after_s=0.0)
    await proc.start()
    deadline = time.monotonic() + 60
    while proc.pid is not None:  # it cannot load its tokenizer, and exits
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert not proc.ready and proc._wait_s == RESTART_AFTER_S
    raw = orjson.dumps({"model": "m", "messages": conversation(1)})
    assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is None
    assert proc.starts == 1 and proc.jobs["unavailable"] == 1  # not started again yet
    proc._started_at -= RESTART_AFTER_S  # as if those seconds had passed
    assert await proc.run("chat", raw, 16, 1, None, None, 4.0) is None
    assert proc.starts == 2
    while proc.pid is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert proc._wait_s == 2 * RESTART_AFTER_S
    proc.stop()


def test_the_loop_is_crowded_when_busy_with_another_request_and_a_core_is_spare():
    """``LoopLoad``: crowded only with another request being handled, the loop's thread busy for at
    least the share of the last window (measured once a window), and a core for the tokenize process."""
    from router.prompts import LoopLoad

    now, spent = [100.0], [5.0]
    load = LoopLoad(0.5, window_s=1.0, clock=lambda: now[0], cpu=lambda: spent[0])
    load.active = 2
    now[0] += 1.0
    spent[0] += 0.75  # 75 % of the window
    assert load.crowded() and load.share == 0.75
    load.active = 1  # one client back to back: nothing waits behind its request
    assert not load.crowded()
    load.active = 5
    now[0] += 0.5
    spent[0] += 0.0  # within the window: the last window's share stands
    assert load.crowded() and load.share == 0.75
    now[0] += 0.5  # the window closes at 0.5 s of CPU in 1 s: half, the threshold
    spent[0] += 0.5
    assert load.crowded() and load.share == 0.5
    now[0] += 2.0
    spent[0] += 0.25  # many requests in flight on a loop with time to spare (1/8)
    assert not load.crowded() and load.share == 0.125
    spare = LoopLoad(0.0, spare_core=False, clock=lambda: now[0], cpu=lambda: spent[0])
    spare.active = 10
    assert not spare.crowded()  # no core for the tokenize process: never


def test_usable_cpus_are_capped_by_a_cgroup_quota(tmp_path):
    from router.prompts import usable_cpus

    mine = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    assert usable_cpus(str(tmp_path / "absent")) == mine
    for text, want in (("max 100000\n", mine), ("150000 100000\n", min(mine, 2)), ("50000 100000\n", 1),
                       ("garbage\n", mine)):
        cpu_max.write_text(text)
        assert usable_cpus(str(cpu_max)) == want


async def test_a_crowded_loop_sends_mid_size_prompts_to_the_tokenize_process(tokenizer_file):
    """Chat bodies of a few KB (at least ``tokenize_crowded_bytes``, under ``tokenize_offload_bytes``):
    one client's are tokenized on the event loop; with several in flight at once on a busy loop (here
    any share is busy) they go to the tokenize process; and never when the workers leave no core for
    it. Every answer is a 200 either way."""
    import httpx

    from router.prompts import usable_cpus
    from tests.test_router_api import pods_running, running_router, settings_for

    def crowded(metrics: str) -> float:
        return float(re.search(r"^kvroute_tokenize_crowded_total (\S+)$", metrics, re.M).group(1))

    def body(i: int) -> dict:
        return {"model": "m", "max_tokens": 2,
                "messages": conversation(3) + [{"role": "user", "content": f"question {i}"}]}

    assert 2048 <= len(orjson.dumps(body(0))) < 16384
    async with pods_running(1) as pods:
        for workers in (1, usable_cpus()):
            settings = settings_for(pods, tokenizer=str(tokenizer_file), tokenize_crowded_share=0.0,
                                    workers=workers)
            async with running_router(settings) as (base, services):
                proc = services.tokenize_process
                await until_ready(proc)
                async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                    for i in range(4):  # one client
                        assert (await c.post("/v1/chat/completions", json=body(i))).status_code == 200
                    assert crowded((await c.get("/metrics")).text) == 0 and proc.jobs["done"] == 0
                    for r in range(5):  # eight at once, until some overlap
                        answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=body(10 * r + i))
                                                         for i in range(8)))
                        assert all(a.status_code == 200 for a in answers)
                        sent = crowded((await c.get("/metrics")).text)
                        if sent:
                            break
                    if workers == 1:
                        assert sent > 0 and proc.jobs["done"] == sent
                    else:
                        assert sent == 0 and proc.jobs["done"] == 0


async def test_the_child_truncates_and_leaves_media_requests_unkeyed_as_the_router_does(tokenizer_file):
    """``truncate_prompt_tokens`` cuts the prompt in the child as in the router, and a chat request
    with an image part is an unkeyed length estimate there too (not a 400)."""
    plain = HFTokenizer(tokenizer_file)
    proc = TokenizeProcess(tokenizer_file, cache_tokens=1_000_000, timeout_s=30)
    await proc.start()
    try:
        await until_ready(proc)
        seed = key_seed("m")
        text = " ".join(corpus(80, seed=5))
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        cases = [("completion", {"model": "m", "prompt": text, "truncate_prompt_tokens": 40}),
                 ("chat", {"model": "m", "messages": conversation(2), "truncate_prompt_tokens": 50,
                           "truncation_side": "right"}),
                 ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                                                   image]}]})]
        for kind, body in cases:
            want = list(prompt_tokens(kind, body, plain))
            got = await proc.run(kind, orjson.dumps(body), 16, seed, None, None, 4.0)
            assert got is not None
            tokens, _, keys = got
            assert len(tokens) == len(want) and keys == prompt_block_keys(prompt_tokens(kind, body, plain), 16, seed,
                                                                           None, None)
        assert len(want) > 16 and keys == []  # the image request: its text's length, no keys
        assert proc.jobs["done"] == len(cases)
    finally:
        proc.stop()


async def test_a_media_request_the_child_tokenized_is_routed_not_a_500(tokenizer_file):
    """A chat request with an image and a long new text, over ``tokenize_offload_bytes``: too new for
    the loop's prefix token cache, so the child tokenizes it, and answers a length with no keys. The
    decision took that length for token ids (a TypeError, a 500, with the default settings); it is
    now the loop's own estimate of a media request, and the request reaches the pod."""
    import httpx

    from tests.test_router_api import pods_running, running_router, settings_for

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40_000}}
    question = " ".join(corpus(300, seed=17))
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": question}, image]}]}
    async with pods_running(1) as pods:
        async with running_router(settings_for(pods, tokenizer=str(tokenizer_file))) as (base, services):
            await until_ready(services.tokenize_process)
            assert len(question) > services.settings.tokenize_inline_chars
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert services.tokenize_process.jobs["done"] == 1 and len(pods[0].seen) == 1


async def test_the_child_renders_with_the_pods_chat_template_and_content_format(tokenizer_file):
    """The ``chat_template`` and ``chat_template_content_format`` settings reach the real child (its
    command line: the template's text, with newlines, quotes and a leading "-") and it answers the ids
    the router computes with them, not those of the tokenizer's own template."""
    from indexer.tokens import ServeChatFlags

    plain = HFTokenizer(tokenizer_file)
    flags = ServeChatFlags(None, False, "-{% for m in messages %}\n<{{ m.role }}> {{ m.content }} 'q' \"d\"\n"
                                        "{% endfor %}", "openai")
    proc = TokenizeProcess(tokenizer_file, cache_tokens=1_000_000, timeout_s=30, chat_flags=flags)
    await proc.start()
    try:
        await until_ready(proc)
        seed = key_seed("m")
        for turns in (1, 3):
            body = {"model": "m", "messages": conversation(turns)}
            want = list(prompt_tokens("chat", body, plain, None, flags))
            assert want != list(prompt_tokens("chat", body, plain))  # the setting changes the ids
            got = await proc.run("chat", orjson.dumps(body), 16, seed, None, None, 4.0)
            assert got is not None
            tokens, _, keys = got
            assert len(tokens) == len(want) and keys == prompt_block_keys(want, 16, seed, None, None)
        assert proc.jobs["done"] == 2
    finally:
        proc.stop()


def test_the_child_seeds_a_salted_jobs_chunks_by_the_salt_it_is_sent_as_the_router_does(tokenizer_file):
    """The child parses the client's bytes, where a key's derived salt is not (router/api.py): it seeds
    the job's chunks by the salt the job carries. Its chunks, adopted by the router's cache (as they
    come back with each answer, or over the booking bus), are found there by the same salt's follow-up
    and by no other's; another salt's job in the child finds none of them either."""
    child = tokenize_proc._Child(tokenizer_file, 1_000_000, share=True)
    here = HFTokenizer(tokenizer_file)
    cache = here.cache_prefixes(max_tokens=1_000_000)
    history = conversation(3)
    follow = history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    a, b = "a" * 64, "b" * 64  # derived salts, as the router passes them
    raw = orjson.dumps({"model": "m", "messages": history, "cache_salt": "the-clients-own"})
    seed = key_seed("m")

    def reused() -> int:
        counts = child.counts()
        assert counts is not None
        return counts[0]

    first = child.tokenize(1, "chat", raw, 16, seed, None, a, 4.0)
    assert first.stored and reused() == 0
    assert child.tokenize(2, "chat", raw, 16, seed, None, b, 4.0).stored and reused() == 0  # B: none of A's
    unsalted = orjson.dumps({"model": "m", "messages": history})
    assert child.tokenize(3, "chat", unsalted, 16, seed, None, None, 4.0).stored and reused() == 0
    assert child.tokenize(4, "chat", unsalted, 16, seed, None, None, 4.0).stored is None and reused() > 0
    # the router's cache, given the child's chunks of A's job, finds them for A's follow-up only
    cache.adopt(first.stored)
    for salt, found in ((b, False), ("the-clients-own", False), (None, False), (a, True)):
        body = {"model": "m", "messages": follow, **({"cache_salt": salt} if salt else {})}
        before = cache.stats.reused_tokens
        tokens = prompt_tokens("chat", body, here)
        assert (cache.stats.reused_tokens > before) is found, salt
        # and the child keys A's job as the router keys the same request
        if salt == a:
            got = child.tokenize(5, "chat", orjson.dumps({**body, "cache_salt": "x"}), 16, seed, None, a, 4.0)
            assert got.keys == prompt_block_keys(tokens, 16, seed, None, a)
