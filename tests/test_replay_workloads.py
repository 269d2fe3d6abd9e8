"""Workload generators: determinism, the ceil rule, shared hash ids -> shared prefixes, multiturn growth."""

from __future__ import annotations

import math

import orjson
import pytest

from replay import workloads
from replay.payload import encode_body
from replay.workloads import TokenBank, TraceError
from tests.helpers import ROOT

TRACE = ROOT / "data" / "conversation_trace.jsonl"
AZURE = ROOT / "data" / "AzureLLMInferenceTrace_conv.csv"


def _write(tmp_path, rows):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else orjson.dumps(r).decode() for r in rows) + "\n")
    return p


def test_mooncake_ceil_rule_and_lengths(tmp_path):
    p = _write(tmp_path, [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1024, "output_length": 6, "hash_ids": [1, 3]},
        {"timestamp": 20, "input_length": 1, "output_length": 7, "hash_ids": [9]},
    ])
    specs = workloads.mooncake(p)
    assert [s.input_len for s in specs] == [1000, 1024, 1]
    assert [len(s.token_ids) for s in specs] == [1000, 1024, 1]
    assert [s.output_len for s in specs] == [5, 6, 7]
    assert [s.timestamp for s in specs] == [0.0, 0.01, 0.02]
    # last block of the first request is 1000 - 512 = 488 tokens
    assert specs[0].segments[-1][1] == 488


def test_mooncake_shared_ids_share_prefixes_and_partial_block_is_prefix(tmp_path):
    p = _write(tmp_path, [
        {"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 5]},
        {"timestamp": 2, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 3, "input_length": 1024, "output_length": 1, "hash_ids": [7, 1]},
    ])
    a, b, c, d = (s.token_ids for s in workloads.mooncake(p))
    assert a[:1024] == b[:1024]
    assert a[1024:1100] != b[1024:1100]
    # hash id 1 used partially (88 tokens) in c is the prefix of its full block in a
    assert c == a[:600]
    # a block is the same wherever it appears (position independent), different ids differ
    assert d[512:] == a[512:1024]
    assert d[:512] != a[:512]
    assert all(0 <= t < 256 for t in a + d)


def test_mooncake_deterministic_per_seed_and_vocab_flag(tmp_path):
    p = _write(tmp_path, [{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [3, 4]}])
    one = workloads.mooncake(p, seed=1)[0].token_ids
    assert one == workloads.mooncake(p, seed=1)[0].token_ids
    assert one != workloads.mooncake(p, seed=2)[0].token_ids
    small = workloads.mooncake(p, vocab_size=10)[0].token_ids
    assert max(small) < 10 and len(set(small)) == 10


def test_mooncake_block_size_flag(tmp_path):
    p = _write(tmp_path, [{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [1, 2, 3]}])
    assert workloads.mooncake(p, block_size=16)[0].input_len == 40
    with pytest.raises(TraceError, match=r"trace.jsonl:1: 3 hash_ids for input_length 40, expected ceil\(40/512\) = 1"):
        workloads.mooncake(p)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}', "input_length must be an integer"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}',
     "hash_ids must be a list of integers"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_trace_line_names_the_line(tmp_path, bad, message):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    p = _write(tmp_path, [good, "", bad])
    with pytest.raises(TraceError) as exc:
        workloads.mooncake(p)
    assert f"{p}:3:" in str(exc.value)
    assert message in str(exc.value)


def test_missing_trace_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        workloads.mooncake(tmp_path / "nope.jsonl")


def test_real_mooncake_trace_loads_and_shares_block_zero():
    specs = workloads.mooncake(TRACE)
    assert len(specs) == 12031
    assert all(len(s.segments) == math.ceil(s.input_len / 512) for s in specs[:200])
    first = [s.token_ids[:512] for s in specs[:3]]
    assert first[0] == first[1] == first[2]  # every request starts with hash id 0


def test_azure_trace(tmp_path):
    specs = workloads.azure(AZURE)
    assert len(specs) == 19366
    assert specs[0].timestamp == 0.0 and specs[0].input_len == 374 and specs[0].output_len == 44
    assert abs(specs[1].timestamp - (50.9951690 - 46.6805900)) < 1e-6
    assert specs[0].token_ids[:16] != specs[1].token_ids[:16]  # no prefix sharing
    bad = tmp_path / "a.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,10,1\n2023-11-16 18:15:47,ten,1\n")
    with pytest.raises(TraceError, match=r"a.csv:3: ContextTokens"):
        workloads.azure(bad)


def test_multiturn_growth_and_system_prompt_binding():
    specs = workloads.multiturn(system_prompts=3, system_prompt_len=64, sessions=5, turns=4, turn_tokens=10,
                                output_len=7, seed=3)
    assert len(specs) == 20
    by_session: dict[int, list] = {}
    for s in specs:
        by_session.setdefault(s.session, []).append(s)
    for turns in by_session.values():
        assert [t.turn for t in turns] == [0, 1, 2, 3]  # turn order kept within the session
        assert [t.input_len for t in turns] == [74, 84, 94, 104]
        for prev, cur in zip(turns, turns[1:]):
            assert cur.token_ids[:prev.input_len] == prev.token_ids  # whole earlier context resent
    # sessions 0 and 3 share system prompt 0; sessions 0 and 1 do not
    assert by_session[0][0].token_ids[:64] == by_session[3][0].token_ids[:64]
    assert by_session[0][0].token_ids[:64] != by_session[1][0].token_ids[:64]
    assert by_session[0][0].token_ids[64:74] != by_session[3][0].token_ids[64:74]
    again = workloads.multiturn(system_prompts=3, system_prompt_len=64, sessions=5, turns=4, turn_tokens=10,
                                output_len=7, seed=3)
    assert [(s.session, s.turn, s.token_ids) for s in again] == [(s.session, s.turn, s.token_ids) for s in specs]
    other = workloads.multiturn(system_prompts=3, system_prompt_len=64, sessions=5, turns=4, turn_tokens=10,
                                output_len=7, seed=4)
    assert [s.session for s in other] != [s.session for s in specs]


def test_multiturn_defaults_match_the_seed_workload():
    specs = workloads.multiturn()
    assert len(specs) == 400 * 5
    assert len({s.group for s in specs}) == 20
    assert min(s.input_len for s in specs) == 2048 + 300
    assert max(s.input_len for s in specs) == 2048 + 5 * 300


def test_shared_prefix_shape():
    specs = workloads.shared_prefix(num_groups=4, prompts_per_group=3, system_prompt_len=32, question_len=8,
                                    output_len=5)
    assert len(specs) == 12 and all(s.input_len == 40 for s in specs)
    groups: dict[int, list] = {}
    for s in specs:
        groups.setdefault(s.group, []).append(s.token_ids)
    assert len(groups) == 4
    for ids in groups.values():
        assert len({tuple(i[:32]) for i in ids}) == 1
        assert len({tuple(i[32:]) for i in ids}) == 3
    assert len({tuple(ids[0][:32]) for ids in groups.values()}) == 4


def test_max_input_len_truncate_and_skip():
    specs = workloads.shared_prefix(num_groups=1, prompts_per_group=2, system_prompt_len=100, question_len=50,
                                    output_len=1)
    cut = workloads.limit_input_len(specs, 120)
    assert [s.input_len for s in cut] == [120, 120]
    assert cut[0].token_ids == specs[0].token_ids[:120]
    assert workloads.limit_input_len(specs, 120, "skip") == []


def test_encoded_bodies_carry_the_prompt():
    specs = workloads.shared_prefix(num_groups=1, prompts_per_group=1, system_prompt_len=20, question_len=5,
                                    output_len=3)
    body = orjson.loads(encode_body(specs[0], endpoint="completions", model="m"))
    assert body["prompt"] == specs[0].token_ids
    assert body["max_tokens"] == 3 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    chat = orjson.loads(encode_body(specs[0], endpoint="chat", model="m", ignore_eos=False))
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    assert len(chat["messages"][0]["content"]) == 20 and len(chat["messages"][1]["content"]) == 5
    assert "ignore_eos" not in chat


def test_token_bank_blocks_independent_of_request_order():
    a, b = TokenBank(seed=5), TokenBank(seed=5)
    a.declare((1, 2), 8)
    b.declare((1, 9), 8)
    b.declare((1, 2), 8)
    b.ids((1, 9))
    assert a.ids((1, 2)).tolist() == b.ids((1, 2)).tolist()


def test_azure_rows_out_of_order_keep_their_spacing(tmp_path):
    """Times are counted from the trace's earliest row, not its first line (which clamped earlier rows to 0)."""
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.0,10,4\n"
                 "2023-11-16 18:15:46.0,11,4\n2023-11-16 18:15:48.0,12,4\n")
    specs = workloads.azure(p)
    assert [(s.timestamp, s.input_len) for s in specs] == [(0.0, 11), (2.0, 12), (4.0, 10)]


@pytest.mark.parametrize("row, message", [
    ({"timestamp": 0, "input_length": 10, "output_length": 2 ** 40, "hash_ids": [1]}, "output_length must be at most"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1e300, "hash_ids": [1]}, "output_length must be at most"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}, "hash_ids must be a list of"),
])
def test_huge_lengths_and_negative_hash_ids_are_trace_errors(tmp_path, row, message):
    p = _write(tmp_path, [row])
    with pytest.raises(TraceError, match=message) as exc:
        workloads.mooncake(p)
    assert f"{p}:1:" in str(exc.value)


def test_huge_azure_counts_bad_block_size_and_seed_are_clear_errors(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,100000000000,4\n")
    with pytest.raises(TraceError, match=r"a.csv:2: token counts must be at most"):
        workloads.azure(p)  # before: minutes building 200 million blocks
    with pytest.raises(TraceError, match="--block-size must be > 0"):
        workloads.mooncake(TRACE, block_size=0)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        TokenBank(seed=-1)
    with pytest.raises(TraceError, match="at most"):
        workloads.multiturn(sessions=1, turns=10 ** 6)
    with pytest.raises(TraceError, match="at most"):
        workloads.shared_prefix(num_groups=10 ** 6, prompts_per_group=10 ** 6)
