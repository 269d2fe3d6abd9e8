"""The router's prompt token ids against real vLLM's, for completions and chat.

Every case is sent straight to an engine (``usage.prompt_tokens``, and its ``prompt_token_ids``
with ``return_token_ids``) and asked of two ``kvroute serve`` routers in front of the same engines,
one tokenizing locally (the model's tokenizer.json and chat template) and one with ``tokenizer:
remote`` (a pod's ``/tokenize``): ``/debug/route``'s ``prompt_tokens`` must equal the engine's count
in both, and the local renderer's ids the engine's ids. Then a tool-using conversation's follow-up:
the cached tokens the router credits the pod that served the first turn equal the engine's own
prefix-cache hits. Last, an engine of its own started with ``--chat-template`` (a file) and
``--chat-template-content-format openai``, and a router with the same two settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from indexer.tokens import HFTokenizer, chat_request_ids, tokenize_chat_body
from realvllm import engines as rv
from realvllm.engines import MODEL_NAME, router_pod
from tests.real_vllm.conftest import (
    cached_tokens,
    debug_route,
    engine_metric,
    running_router,
    wait_for,
    wait_indexed,
)

M = MODEL_NAME
SYSTEM = {"role": "system", "content": "You are a terse & careful assistant; answer in <one> line, 'no' fluff."}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather <b>now</b> & 'later' for a city — café ☀ (Zürich, Kraków, 東京)",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "a city, e.g. \"São Paulo\" <not an address>"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_docs", "description": "Search the manual & return <= 3 hits"}},
]
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": "{\"unit\": \"c\", \"city\": \"Zürich <HB>\"}"}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"☀ & clear\"}"}
EMPTY = {"type": "text", "text": ""}
TEXT = "the router sends each request to the pod whose prefix cache already holds most of its prompt"

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion-text": ("completion", {"prompt": TEXT}),
    "completion-no-special-tokens": ("completion", {"prompt": TEXT, "add_special_tokens": False}),
    "completion-token-ids": ("completion", {"prompt": [0, 11, 402, 77, 1200, 5, 5, 9, 2800, 64] * 4}),
    "chat-system-multi-turn": ("chat", {"messages": [
        SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello, how can I help?"},
        {"role": "user", "content": "what is a prefix cache?"}]}),
    "chat-tools": ("chat", {"messages": [SYSTEM, {"role": "user", "content": "weather in Zürich?"}],
                            "tools": TOOLS, "tool_choice": "none"}),
    "chat-tool-calls-and-results": ("chat", {"messages": [SYSTEM, {"role": "user", "content": "weather in Zürich?"},
                                                          CALL, RESULT], "tools": TOOLS, "tool_choice": "none"}),
    "chat-template-kwargs": ("chat", {"messages": [{"role": "user", "content": "quick answer"}],
                                      "chat_template_kwargs": {"enable_thinking": False}}),
    "chat-no-generation-prompt": ("chat", {"messages": [{"role": "user", "content": "just the turn"}],
                                           "add_generation_prompt": False}),
    "chat-continue-final-message": ("chat", {"messages": [{"role": "user", "content": "finish this"},
                                                          {"role": "assistant", "content": "The answer is "}],
                                             "add_generation_prompt": False, "continue_final_message": True}),
    "chat-documents": ("chat", {"messages": [{"role": "user", "content": "what do the documents say?"}],
                                "documents": [{"title": "Cache <1>", "text": "blocks & hashes"},
                                              {"title": "Über", "text": "prefix-aware routing"}]}),
    "chat-text-parts": ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]}),
    "chat-add-special-tokens": ("chat", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}),
    "chat-developer-role": ("chat", {"messages": [{"role": "developer", "content": "be brief"},
                                                  {"role": "user", "content": "hi"}]}),
    # an empty text part is dropped by vLLM in the "string" content format, not joined in as an empty
    # line: the router once rendered "\nweather..." here, a token more from the user's turn on
    "chat-empty-text-parts": ("chat", {"messages": [
        SYSTEM, {"role": "user", "content": [EMPTY, {"type": "text", "text": "weather in Zürich?"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": ""}, {"type": "text", "text": "checking"}],
         "tool_calls": CALL["tool_calls"]},
        {"role": "tool", "tool_call_id": "call_1", "content": [EMPTY, {"type": "text", "text": RESULT["content"]}]},
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}, EMPTY]}],
        "tools": TOOLS, "tool_choice": "none"}),
    "chat-tool-calls-names-reasoning-and-parts": ("chat", {"messages": [
        SYSTEM, {"role": "user", "name": "ana", "content": "weather in Zürich and 東京?"},
        {"role": "assistant", "content": "", "reasoning_content": "two cities: two calls", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": " {\"city\": \"Zürich\", \"unit\": \"c\"} "}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}},
            {"id": "c", "type": "function", "function": {"name": "search_docs", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "a", "name": "get_weather",
         "content": [{"type": "text", "text": "21 C"}, {"type": "text", "text": "sunny"}]},
        {"role": "tool", "tool_call_id": "b", "content": "12 C"}, {"role": "tool", "tool_call_id": "c", "content": ""},
        {"role": "assistant", "content": None, "reasoning": "done", "tool_calls": []},
        {"role": "user", "content": "thanks"}], "tools": TOOLS, "tool_choice": "none"}),
    "chat-system-in-the-middle-and-empty-contents": ("chat", {"messages": [
        SYSTEM, {"role": "user", "content": ""}, {"role": "assistant", "content": "?"},
        {"role": "system", "content": "now answer in French"}, {"role": "user", "content": [EMPTY]}]}),
    "chat-echo-reasoning-effort-none": ("chat", {"messages": [{"role": "user", "content": "quick"}], "echo": True,
                                                 "reasoning_effort": "none"}),
    "chat-continue-final-text-parts": ("chat", {"messages": [
        {"role": "user", "content": "finish this"},
        {"role": "assistant", "content": [{"type": "text", "text": "The answer"}, {"type": "text", "text": "is "}]}],
        "add_generation_prompt": False, "continue_final_message": True}),
}
# answered 400 by the engine, so by the router too (by both routers, or by the local one where the
# remote one leaves the refusal to the pod and routes on load alone)
BAD: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "continue-with-default-generation-prompt": ("chat", {"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "continue_final_message": True},
        ("local", "remote")),
    "empty-tools": ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none"},
                    ("local", "remote")),
    "messages-not-a-list": ("chat", {"messages": "hello"}, ("local", "remote")),
    "untrusted-request-template": ("chat", {"messages": [{"role": "user", "content": "x"}],
                                            "chat_template": "{{ messages[0].content }}"}, ("local",)),
}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@pytest.fixture(scope="module")
def routers(agg_engines, real_env, tmp_path_factory) -> Iterator[dict[str, str]]:
    """Two routers in front of the shared engines: the model's own tokenizer files, and remote."""
    pods = [router_pod(e) for e in agg_engines]
    folder = tmp_path_factory.mktemp("parity-routers")
    with contextlib.ExitStack() as stack:
        yield {
            "local": stack.enter_context(running_router(folder, pods, tokenizer=str(real_env.tokenizer),
                                                        speculative_ttl_s=0.05)),
            "remote": stack.enter_context(running_router(folder, pods, tokenizer="remote",
                                                         remote_tokenize_timeout_s=20, speculative_ttl_s=0.05)),
        }


@pytest.fixture(scope="module")
def local_tokenizer(real_env) -> HFTokenizer:
    return HFTokenizer(real_env.tokenizer)


@pytest.fixture(scope="module")
def twin_tokenizer(real_env) -> HFTokenizer:
    """The router's own path: the prefix token cache (every text through it) on tiktoken's twin of the
    model's tokenizer (indexer/fast_bpe.py)."""
    tok = HFTokenizer(real_env.tokenizer)
    cache = tok.cache_prefixes(min_chars=0)
    assert cache.twin, cache.twin_reason
    return tok


def engine_answer(url: str, kind: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + PATHS[kind], json={"model": M, **body, "max_tokens": 1, "return_token_ids": True},
                      timeout=60)


@pytest.mark.parametrize("case", list(CASES))
def test_router_counts_the_engines_prompt_tokens(case, agg_engines, routers, local_tokenizer, twin_tokenizer):
    kind, body = CASES[case]
    r = engine_answer(agg_engines[0].url, kind, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    engine_count = answer["usage"]["prompt_tokens"]
    engine_ids = answer["prompt_token_ids"] if kind == "chat" else answer["choices"][0]["prompt_token_ids"]
    assert len(engine_ids) == engine_count
    for tok in (local_tokenizer, twin_tokenizer):
        if kind == "chat":
            assert chat_request_ids({"model": M, **body}, tok) == engine_ids
        elif isinstance(body["prompt"], str):
            assert tok.encode(body["prompt"], body.get("add_special_tokens", True)) == engine_ids
    counts = {mode: debug_route(base, {"model": M, **body})["prompt_tokens"] for mode, base in routers.items()}
    print(f"{case}: engine {engine_count} prompt tokens, router {counts}")
    assert counts == {"local": engine_count, "remote": engine_count}


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0] == "chat"])
def test_tokenize_endpoint_renders_what_the_router_renders(case, agg_engines, local_tokenizer):
    """The engine's own ``POST /tokenize`` (chat form) for the body the remote tokenizer sends
    (``tokenize_chat_body``) gives the chat endpoint's prompt ids, and the router's rendering of that
    body as /tokenize renders it (``api="tokenize"``, the simulator's /tokenize) gives the same ids:
    /tokenize has no documents or reasoning_effort and keeps no ``reasoning_content``."""
    body = {"model": M, **CASES[case][1]}
    r = engine_answer(agg_engines[0].url, "chat", CASES[case][1])
    assert r.status_code == 200, r.text
    mapped = tokenize_chat_body(body, M)
    t = httpx.post(agg_engines[0].url + "/tokenize", json=mapped, timeout=60)
    assert t.status_code == 200, t.text
    assert t.json()["tokens"] == r.json()["prompt_token_ids"]
    assert chat_request_ids(mapped, local_tokenizer, api="tokenize") == t.json()["tokens"]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_chat_input_is_a_400_from_engine_and_router(case, agg_engines, routers):
    kind, body, modes = BAD[case]
    assert engine_answer(agg_engines[0].url, kind, body).status_code == 400
    for mode in modes:
        r = httpx.post(routers[mode] + "/debug/route", json={"model": M, **body}, timeout=30)
        assert r.status_code == 400, (mode, r.text)
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"], (mode, error)


def test_tool_conversation_follow_up_credited_as_the_engine_hits_it(agg_engines, routers):
    base = routers["local"]
    system = {"role": "system", "content": "You route weather questions for the fleet. " + " ".join(
        f"Rule {i}: answer about city number {i} with its forecast & temperature <in celsius>." for i in range(40))}
    first = {"model": M, "messages": [system, {"role": "user", "content": "weather in Kraków today?"}],
             "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
    r = httpx.post(base + "/v1/chat/completions", json=first, timeout=60)
    assert r.status_code == 200, r.text
    pod = r.headers["x-kvroute-pod"]
    url = next(e.url for e in agg_engines if e.name == pod)
    call = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_9", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Kraków\"}"}}]}
    follow = {**first, "messages": first["messages"] + [
        call, {"role": "tool", "tool_call_id": "call_9", "content": "{\"temp\": 3, \"sky\": \"snow\"}"},
        {"role": "user", "content": "and tomorrow?"}]}
    wait_for(lambda: cached_tokens(base, follow, pod) > 0, 10, "the first turn's blocks indexed")
    predicted = cached_tokens(base, follow, pod)
    assert cached_tokens(routers["remote"], follow, pod) == predicted  # the remote-tokenizing router agrees
    before = engine_metric(url, "vllm:prefix_cache_hits_total")
    r = httpx.post(base + "/v1/chat/completions", json=follow, timeout=60)
    assert r.status_code == 200 and r.headers["x-kvroute-pod"] == pod, r.text
    observed = engine_metric(url, "vllm:prefix_cache_hits_total") - before
    print(f"follow-up prompt tokens {r.json()['usage']['prompt_tokens']}, router credited {predicted}, "
          f"engine hit {observed}")
    assert observed > 0
    assert predicted == observed


TRUNCATED: dict[str, tuple[str, dict[str, Any]]] = {
    "completion-tokenizer-side": ("completion", {"prompt": TEXT, "truncate_prompt_tokens": 7}),
    "completion-left": ("completion", {"prompt": TEXT, "truncate_prompt_tokens": 7, "truncation_side": "left"}),
    "completion-right": ("completion", {"prompt": TEXT, "truncate_prompt_tokens": 7, "truncation_side": "right"}),
    "completion-token-ids": ("completion", {"prompt": list(range(40, 80)), "truncate_prompt_tokens": 9}),
    "completion-longer-than-the-prompt": ("completion", {"prompt": "short one", "truncate_prompt_tokens": 500}),
    "chat": ("chat", {"messages": [SYSTEM, {"role": "user", "content": "what is a prefix cache?"}],
                      "truncate_prompt_tokens": 12}),
    "chat-with-special-tokens": ("chat", {"messages": [{"role": "user", "content": TEXT}],
                                          "add_special_tokens": True, "truncate_prompt_tokens": 10}),
}


@pytest.mark.parametrize("case", list(TRUNCATED))
def test_truncated_prompts_are_the_tokens_the_engine_keeps(case, agg_engines, routers, local_tokenizer):
    """``truncate_prompt_tokens`` (and ``truncation_side``): the router's ids are the engine's, so the
    blocks it keys are the ones the engine caches; both routers count them."""
    from router.prompts import prompt_tokens

    kind, body = TRUNCATED[case]
    r = engine_answer(agg_engines[0].url, kind, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    engine_ids = answer["prompt_token_ids"] if kind == "chat" else answer["choices"][0]["prompt_token_ids"]
    assert list(prompt_tokens(kind, {"model": M, **body}, local_tokenizer)) == engine_ids
    counts = {mode: debug_route(base, {"model": M, **body})["prompt_tokens"] for mode, base in routers.items()}
    assert counts == {"local": len(engine_ids), "remote": len(engine_ids)}, (engine_ids, counts)


# a template the model does not have, printing each message's content as it comes: with the content
# format forced to "openai" a string content is handed over as a list of parts (auto detects "string")
POD_TEMPLATE = ("{%- for message in messages %}[{{ message['role'] | upper }}] {{ message['content'] }}\n"
                "{% endfor %}\n{%- if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}\n"
                "{%- if add_generation_prompt %}[ASSISTANT] {% endif %}\n")


def test_a_pods_chat_template_and_content_format_are_rendered_and_credited_as_the_engine_does(
        real_env, real_scratch, tmp_path):
    """An engine started with ``--chat-template <file> --chat-template-content-format openai`` and a
    router with the settings ``chat_template`` (the same file) and ``chat_template_content_format``:
    the router's ids are the engine's (without the settings they are not: the tokenizer's own
    template, or the right template with its detected "string" format), the engine's ``/tokenize``
    (what ``tokenizer: remote`` asks) renders them too, and a conversation's follow-up is credited
    exactly the prefix-cache hits the engine then has (before the settings existed: none, as no key
    matched)."""
    from router.config import RouterSettings
    from router.prompts import serve_chat_flags

    path = tmp_path / "pods.jinja"
    path.write_text(POD_TEMPLATE)
    settings = {"chat_template": str(path), "chat_template_content_format": "openai"}
    flags = serve_chat_flags(RouterSettings(**settings))
    template_only = serve_chat_flags(RouterSettings(chat_template=str(path)))
    tok = HFTokenizer(real_env.tokenizer)
    engine = rv.Engine(real_env, "chat-template", real_scratch, core=0, extra_args=[
        "--chat-template", str(path), "--chat-template-content-format", "openai"])
    cases = ("chat-system-multi-turn", "chat-tools", "chat-text-parts", "chat-no-generation-prompt")
    with rv.running([engine]), running_router(tmp_path, [router_pod(engine)], tokenizer=str(real_env.tokenizer),
                                              speculative_ttl_s=0.05, **settings) as base:
        for case in cases:
            body = {"model": M, **CASES[case][1]}
            r = engine_answer(engine.url, "chat", CASES[case][1])
            assert r.status_code == 200, r.text
            ids = r.json()["prompt_token_ids"]
            assert chat_request_ids(body, tok, flags=flags) == ids, case
            assert chat_request_ids(body, tok) != ids and chat_request_ids(body, tok, flags=template_only) != ids
            t = httpx.post(engine.url + "/tokenize", json=tokenize_chat_body(body, M), timeout=60)
            assert t.status_code == 200 and t.json()["tokens"] == ids, t.text
            assert debug_route(base, body)["prompt_tokens"] == len(ids)
        system = {"role": "system", "content": " ".join(f"Rule {i}: route city number {i} to its own forecast."
                                                        for i in range(30))}
        first = {"model": M, "messages": [system, {"role": "user", "content": "weather in Kraków?"}], "max_tokens": 2}
        r = httpx.post(base + "/v1/chat/completions", json=first, timeout=60)
        assert r.status_code == 200, r.text
        stored = r.json()["usage"]["prompt_tokens"]
        follow = {**first, "messages": first["messages"] + [{"role": "assistant", "content": "snow"},
                                                            {"role": "user", "content": "and tomorrow?"}]}
        predicted = wait_indexed(base, follow, engine.name, stored)
        before = engine_metric(engine.url, "vllm:prefix_cache_hits_total")
        r = httpx.post(base + "/v1/chat/completions", json=follow, timeout=60)
        assert r.status_code == 200, r.text
        observed = engine_metric(engine.url, "vllm:prefix_cache_hits_total") - before
        print(f"chat-template follow-up: {r.json()['usage']['prompt_tokens']} prompt tokens, router credited "
              f"{predicted}, engine hit {observed}")
        assert observed > 0 and predicted == observed
