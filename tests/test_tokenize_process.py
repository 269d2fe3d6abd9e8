"""The tokenize process (router/tokenize_proc.py): the same answer as tokenizing in the router, the
same 400 for a bad chat request, and a tokenize thread whenever the child cannot answer (starting,
dead, too slow), with the child started again."""

from __future__ import annotations

import asyncio
import time

import pytest

from indexer.keys import key_seed
from indexer.tokens import HFTokenizer
from router.costs import batch_rest_tokens
from router.errors import APIError
from router.prompts import prompt_block_keys, prompt_tokens
from router.tokenize_proc import PromptLength, TokenizeProcess
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
    assert await proc.run("chat", {"messages": conversation(1)}, 16, 1, None, None, 4.0) is None  # not started
    try:
        await until_ready(proc)
        seed = key_seed("m")
        cases = [("chat", {"model": "m", "messages": conversation(t)}, None, None) for t in range(1, 5)]
        cases += [("chat", {"model": "m", "messages": conversation(4)}, "lora-a", "tenant-b"),
                  ("completion", {"model": "m", "prompt": [" ".join(corpus(40, seed=3)), "two", "three"]}, None, None),
                  ("completion", {"model": "m", "prompt": "tiny"}, None, None)]  # no full block: the tokens come back
        for kind, body, adapter, salt in cases:
            got = await proc.run(kind, body, 16, seed, adapter, salt, 4.0)
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
    proc.start()
    try:
        await until_ready(proc)
        with pytest.raises(APIError) as there:
            await proc.run("chat", body, 16, 1, None, None, 4.0)
        assert (there.value.status, there.value.message, there.value.param) == \
            (here.value.status, here.value.message, here.value.param) and there.value.status == 400
        assert proc.jobs["bad-request"] == 1
    finally:
        proc.stop()


async def test_a_dead_or_slow_child_sends_prompts_to_the_threads_and_is_started_again(tokenizer_file):
    body = {"model": "m", "messages": conversation(3)}
    proc = TokenizeProcess(tokenizer_file, cache_tokens=0, timeout_s=30, restart_after_s=0.0)
    proc.start()
    try:
        await until_ready(proc)
        for child in list(proc._pool._processes.values()):  # type: ignore[union-attr]
            child.kill()
            child.join(10)
        assert await proc.run("chat", body, 16, 1, None, None, 4.0) is None
        assert proc.jobs["failed"] == 1 and not proc.ready
        assert await proc.run("chat", body, 16, 1, None, None, 4.0) is None  # started again, not up yet
        assert proc.starts == 2 and proc.jobs["unavailable"] >= 1
        await until_ready(proc)
        assert await proc.run("chat", body, 16, 1, None, None, 4.0) is not None

        proc.timeout_s = 1e-4  # no prompt is tokenized that fast: the job is given up, the child restarted
        assert await proc.run("chat", body, 16, 1, None, None, 4.0) is None
        assert proc.jobs["timeout"] == 1 and proc.starts == 2 and not proc.ready
        proc.timeout_s = 30
        assert await proc.run("chat", body, 16, 1, None, None, 4.0) is None
        assert proc.starts == 3
        await until_ready(proc)
        assert await proc.run("chat", body, 16, 1, None, None, 4.0) is not None
    finally:
        proc.stop()
