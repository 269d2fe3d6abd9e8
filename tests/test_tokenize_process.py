"""The tokenize process (router/tokenize_proc.py): the same answer as tokenizing in the router, the
same 400 for a bad chat request, and a tokenize thread whenever the child cannot answer (starting,
dead, too slow), with the child started again."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import msgspec
import orjson
import pytest

from indexer.keys import key_seed
from indexer.tokens import HFTokenizer
from router.costs import batch_rest_tokens
from router.errors import APIError
from router.prompts import prompt_block_keys, prompt_tokens
from router.tokenize_proc import RESTART_AFTER_S, PromptLength, TokenizeProcess
from tests.helpers import ROOT
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
