"""The simulated pod's ``POST /v1/chat/completions/batch`` (vLLM 0.32's ``OpenAIServingChatBatch``),
checked against what vLLM 0.32's CPU engine answered on a tiny model: one whole ``chat.completion``
with a choice per conversation, usage summed over them, every conversation its own engine request,
and its pydantic-shaped and serving-code refusals."""

from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import pytest

from indexer.tokens import chat_request_ids, load_tokenizer
from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process, metric

MAX_MODEL_LEN = 4096
BLOCK = 16
PATH = "/v1/chat/completions/batch"

# vLLM 0.32's fields, in its order: the answer, each choice, each choice's message
ANSWER_FIELDS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                 "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
                 "metrics"]
CHOICE_FIELDS = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
MESSAGE_FIELDS = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}}]


def conversations(tag: str = "") -> list[list[dict]]:
    """The three conversations of the probe of vLLM (long, with a system message, one character),
    ``tag`` making them new to the pod's cache."""
    return [[{"role": "user", "content": tag + "hello there " * 40}],
            [{"role": "system", "content": tag + "be brief"},
             {"role": "user", "content": "what is two plus two " * 20}],
            [{"role": "user", "content": tag + "x"}]]


def prompt_len(conversation: list[dict]) -> int:
    """The prompt tokens of the conversation as a chat request (the byte tokenizer: no BOS to add)."""
    return len(chat_request_ids({"messages": conversation}, load_tokenizer("byte")))


def sized(room: int) -> list[dict]:
    """A one-message conversation whose prompt leaves ``room`` tokens of MAX_MODEL_LEN."""
    overhead = prompt_len([{"role": "user", "content": ""}])
    conversation = [{"role": "user", "content": "a" * (MAX_MODEL_LEN - room - overhead)}]
    assert prompt_len(conversation) == MAX_MODEL_LEN - room
    return conversation


def validation(loc: str, error: str) -> dict:
    """vLLM's body for a request its pydantic model refuses."""
    return {"error": {"message": f"1 validation error:\n  {error}", "type": "Bad Request", "param": loc, "code": 400}}


def bad_request(message: str, param: str) -> dict:
    """vLLM's body for a VLLMValidationError its handler gets as it is."""
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def start_pod(*extra: str):
    port = consecutive_free_ports(1)
    return port, kvroute_process(["sim", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), *extra],
                                 ready_url=f"http://127.0.0.1:{port}/health")


@pytest.fixture(scope="module")
def plain():
    port, proc = start_pod()
    with proc:
        yield f"http://127.0.0.1:{port}"


def post(base: str, body: dict, path: str = PATH, **kw) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30, **kw)


def single_prompt_tokens(base: str, conversation: list[dict], **extra) -> int:
    r = post(base, {"messages": conversation, "max_tokens": 2, **extra}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


@pytest.mark.e2e
def test_a_batch_answers_one_chat_completion_with_a_choice_per_conversation_in_order(plain):
    """Each conversation gets its own output budget (max_tokens clamped to its own room, as vLLM's
    get_max_tokens per prompt): output lengths 9, 20, 5 tell the choices apart, in conversation order."""
    convs = [sized(9), conversations()[1], sized(5)]
    r = post(plain, {"model": "sim-model", "messages": convs, "max_tokens": 20, "return_token_ids": True},
             headers={"x-request-id": "batch-1"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"] == "batch-1"
    body = r.json()
    assert list(body) == ANSWER_FIELDS
    assert body["id"] == "chatcmpl-batch-1" and body["object"] == "chat.completion" and body["model"] == "sim-model"
    assert body["system_fingerprint"].startswith("vllm-") and abs(body["created"] - time.time()) < 60
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c in body["choices"]:
        assert list(c) == CHOICE_FIELDS and list(c["message"]) == MESSAGE_FIELDS
        assert c["message"]["role"] == "assistant" and c["finish_reason"] == "length"
    assert [len(c["message"]["content"]) for c in body["choices"]] == [9, 20, 5]   # one byte per token
    assert [len(c["token_ids"]) for c in body["choices"]] == [9, 20, 5]
    n = sum(prompt_len(c) for c in convs)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n + 34, "completion_tokens": 34,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    assert body["prompt_token_ids"] is None and body["kv_transfer_params"] is None

    # no x-request-id: vLLM's random_uuid, 16 hex digits
    r = post(plain, {"messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 1})
    assert r.status_code == 200 and re.fullmatch(r"chatcmpl-[0-9a-f]{16}", r.json()["id"]), r.text
    assert len(r.json()["choices"]) == 1


@pytest.mark.e2e
def test_usage_sums_the_prompt_tokens_of_the_single_chats(plain):
    """As the probe of vLLM: the singles' prompt tokens (170, 181, 10 there) add up to the batch's."""
    convs = conversations()
    singles = [single_prompt_tokens(plain, c) for c in convs]
    assert singles == [prompt_len(c) for c in convs]
    r = post(plain, {"messages": convs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == sum(singles)
    assert r.json()["usage"]["completion_tokens"] == 6


@pytest.mark.e2e
def test_tools_are_carried_but_not_rendered(tmp_path):
    """The batch renders each conversation without its tools (vLLM passes tool_dicts=None), on a
    template that does render them: a single chat with tools has more prompt tokens, the batch with
    the same tools as many as the single chats without them. An empty tools list is still refused, by
    the chat request built for each conversation."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>", "tool", "user", "system", "assistant", "hello", "world", "brief"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% if tools %}{% for t in tools %}tool {% endfor %}{% endif %}"
                         "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}"}))
    convs = [[{"role": "user", "content": "hello world"}],
             [{"role": "system", "content": "brief"}, {"role": "user", "content": "hello"}]]
    port, proc = start_pod("--tokenizer", str(tmp_path / "tokenizer.json"))
    with proc:
        base = f"http://127.0.0.1:{port}"
        plain_singles = [single_prompt_tokens(base, c) for c in convs]
        assert plain_singles == [4, 5]
        assert [single_prompt_tokens(base, c, tools=TOOLS) for c in convs] == [6, 7]   # rendered: 2 more each
        r = post(base, {"messages": convs, "max_tokens": 2, "tools": TOOLS})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == sum(plain_singles) == 9
        empty = post(base, {"messages": convs, "max_tokens": 2, "tools": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "tools", empty.text


@pytest.mark.e2e
def test_stream_true_still_answers_the_whole_json(plain):
    """vLLM answers a batch whole whatever ``stream`` says (the probe: application/json); stream
    options need ``stream: true`` as for a chat request, refused with vLLM's words."""
    convs = conversations()
    for extra in ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}):
        r = post(plain, {"messages": convs, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json" and not r.text.startswith("data:")
        body = r.json()
        assert list(body) == ANSWER_FIELDS and [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 6
    r = post(plain, {"messages": convs, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert r.status_code == 400
    assert r.json() == bad_request("Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                                   "stream_options")


TOO_SHORT = ("{{'type': 'too_short', 'loc': '{}', 'msg': 'List should have at least 1 item after validation, not 0', "
             "'input': '<list of 0 items>', 'ctx': {{'field_type': 'List', 'min_length': 1, 'actual_length': 0}}}}")


@pytest.mark.e2e
@pytest.mark.parametrize("extra,expected", [
    # the probe of vLLM 0.32's answers, word for word
    ({"messages": []}, validation("body.messages", TOO_SHORT.format("body.messages"))),
    ({"messages": [[]]}, validation("body.messages.0", TOO_SHORT.format("body.messages.0"))),
    ({"messages": [{"role": "user", "content": "x"}]}, validation(
        "body.messages.0", "{'type': 'list_type', 'loc': 'body.messages.0', 'msg': 'Input should be a valid list', "
                           "'input': '<dict of 2 items>'}")),
    ({"messages": "x"}, validation(
        "body.messages", "{'type': 'list_type', 'loc': 'body.messages', 'msg': 'Input should be a valid list', "
                         "'input': 'x'}")),
    ({"messages": conversations(), "n": 2}, bad_request(
        "Batch chat completions do not support `n > 1`. Please set `n` to 1. (parameter=n, value=2)", "n")),
    # BatchChatCompletionRequest.check_batch_mode's other refusals, in its words
    ({"messages": conversations(), "use_beam_search": True}, bad_request(
        "Batch chat completions do not support beam search. Please set `use_beam_search` to False. "
        "(parameter=use_beam_search)", "use_beam_search")),
    ({"messages": conversations(), "logprob_token_ids": [1, 2]}, bad_request(
        "when using `logprob_token_ids`, `logprobs` must be set to true. (parameter=logprob_token_ids)",
        "logprob_token_ids")),
    # its "before" validator runs first: n is refused before the empty conversation list
    ({"messages": [], "n": 3}, bad_request(
        "Batch chat completions do not support `n > 1`. Please set `n` to 1. (parameter=n, value=3)", "n")),
    # tool_choice is Literal["none"] | None on the batch model
    ({"messages": conversations(), "tool_choice": "auto"}, validation(
        "body.tool_choice", "{'type': 'literal_error', 'loc': 'body.tool_choice', 'msg': \"Input should be 'none'\", "
                            "'input': 'auto', 'ctx': {'expected': \"'none'\"}}")),
])
def test_bad_batches_are_refused_as_vllm_refuses_them(plain, extra, expected):
    r = post(plain, {"model": "sim-model", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json() == expected


@pytest.mark.e2e
def test_every_bad_conversation_is_reported_as_pydantic_reports_them(plain):
    r = post(plain, {"messages": [[], {"role": "user"}, [{"role": "user", "content": "x"}]]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "body.messages.0" and err["type"] == "Bad Request"
    assert err["message"].startswith("2 validation errors:\n  " + TOO_SHORT.format("body.messages.0") + "\n  ")
    assert "'loc': 'body.messages.1'" in err["message"]
    r = post(plain, {"messages": [[{"role": "user", "content": "x"}]]}, headers={"x-data-parallel-rank": "1"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."


@pytest.mark.e2e
def test_each_conversation_is_an_engine_request_whose_blocks_are_cached(plain):
    """Each conversation runs as its own request: vllm:request_success_total rises by 3 for a batch of
    3 (as in the probe of vLLM), the prompt tokens by the batch's; each one's blocks are stored, so the
    same conversation sent alone afterwards hits every full block but the last token's."""
    convs = conversations(uuid.uuid4().hex)
    done = metric(plain, "vllm:request_success_total", finished_reason="length")
    prompts = metric(plain, "vllm:prompt_tokens_total")
    r = post(plain, {"messages": convs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    assert metric(plain, "vllm:request_success_total", finished_reason="length") == done + 3
    assert metric(plain, "vllm:prompt_tokens_total") == prompts + n
    for conversation in convs[:2]:
        again = post(plain, {"messages": conversation, "max_tokens": 1}, "/v1/chat/completions")
        assert again.status_code == 200, again.text
        expected = (prompt_len(conversation) - 1) // BLOCK * BLOCK
        assert expected >= 8 * BLOCK   # well past the template's first block, which any chat shares
        assert int(again.headers["x-sim-cached-tokens"]) == expected


@pytest.mark.e2e
def test_faults_apply_to_the_batch_as_a_whole(plain):
    convs = conversations()
    done = metric(plain, "vllm:request_success_total")
    r = post(plain, {"messages": convs, "max_tokens": 2}, headers={"x-sim-fault": "status=503", "x-request-id": "f1"})
    assert r.status_code == 503 and r.headers["x-request-id"] == "f1"
    assert r.json()["error"]["message"] == "simulated fault: status 503"
    assert metric(plain, "vllm:request_success_total") == done   # nothing ran
    r = post(plain, {"messages": convs, "max_tokens": 10}, headers={"x-sim-fault": "eos=3"})
    assert r.status_code == 200, r.text
    assert [(c["finish_reason"], len(c["message"]["content"])) for c in r.json()["choices"]] == [("stop", 3)] * 3
    started = time.monotonic()
    r = post(plain, {"messages": convs, "max_tokens": 1}, headers={"x-sim-fault": "delay=0.4"})
    assert r.status_code == 200 and time.monotonic() - started >= 0.4
    with pytest.raises(httpx.HTTPError):   # the whole answer cut halfway
        post(plain, {"messages": convs, "max_tokens": 1}, headers={"x-sim-fault": "drop=1"})
    assert post(plain, {"messages": convs, "max_tokens": 1}).status_code == 200


@pytest.mark.e2e
def test_a_client_that_leaves_aborts_every_conversation():
    """A slow pod (50 ms a token): the client gives up long before 100 tokens; all three requests are
    aborted and nothing stays running."""
    port, proc = start_pod("--timing", "seed", "--decode-s-per-token", "0.05")
    with proc:
        base = f"http://127.0.0.1:{port}"
        aborts = metric(base, "vllm:request_success_total", finished_reason="abort")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + PATH, json={"messages": conversations(), "max_tokens": 100}, timeout=0.5)
        deadline = time.monotonic() + 5
        while metric(base, "vllm:request_success_total", finished_reason="abort") < aborts + 3:
            assert time.monotonic() < deadline, "the conversations were not aborted"
            time.sleep(0.05)
        assert metric(base, "vllm:request_success_total", finished_reason="abort") == aborts + 3
        state = httpx.get(base + "/sim/state").json()
        assert state["running"] == 0 and state["waiting"] == 0
        assert metric(base, "vllm:request_success_total", finished_reason="length") == 0
