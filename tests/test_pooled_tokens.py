"""router/passthrough.py ``pooled_tokens``: what a pooling answer says the model ran over, read off
its bytes (the charge of a pooling request is settled to it: tests/test_passthrough.py)."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.passthrough import pooled_tokens

USAGE = {"prompt_tokens": 37, "total_tokens": 37, "completion_tokens": 0, "prompt_tokens_details": None}


@pytest.mark.parametrize("answer, ran", [
    # vLLM 0.32's embeddings answer, floats and base64 (EmbeddingResponse: usage last)
    ({"id": "embd-1", "object": "list", "created": 1, "model": "m",
      "data": [{"index": 0, "object": "embedding", "embedding": [0.5] * 300}], "usage": USAGE}, 37),
    ({"id": "embd-1", "object": "list", "created": 1, "model": "m",
      "data": [{"index": 0, "object": "embedding", "embedding": "AAAAPw=="}], "usage": USAGE}, 37),
    # a rerank answer: its usage before the results, which echo the client's documents; a document
    # that reads like a usage object is a JSON string, and is not taken for one
    ({"id": "rerank-1", "model": "m", "usage": {"prompt_tokens": 12, "total_tokens": 12},
      "results": [{"index": 0, "relevance_score": 0.5, "document": {"text": 'usage":{"prompt_tokens":999999'}},
                  {"index": 1, "relevance_score": 0.1, "document": {"text": "usage"}}]}, 12),
    # the Cohere embed route's billed units: input and image tokens
    ({"id": "e", "embeddings": {"float": [[0.5]]}, "texts": ["a"],
      "meta": {"billed_units": {"input_tokens": 20, "image_tokens": 5}}}, 25),
    ({"id": "e", "embeddings": {"float": [[0.5]]}, "meta": {"billed_units": {"input_tokens": 9}}}, 9),
    # no count: nothing to settle to
    ({"object": "list", "data": []}, None),
    ({"id": "rerank-1", "results": [{"document": {"text": '"usage": {"prompt_tokens": 4}'}}]}, None),
])
def test_a_pooling_answer_s_count_is_read_off_its_bytes(answer, ran):
    assert pooled_tokens(orjson.dumps(answer)) == ran
    # with spaces after the separators, as json.dumps writes them: the same
    assert pooled_tokens(json.dumps(answer).encode()) == ran


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=5), st.integers(0, 10**9))
def test_no_echoed_text_changes_the_count(documents, n):
    answer = {"id": "r", "model": "m", "usage": {"prompt_tokens": n, "total_tokens": n},
              "results": [{"index": i, "document": {"text": d}} for i, d in enumerate(documents)]}
    assert pooled_tokens(orjson.dumps(answer)) == n
