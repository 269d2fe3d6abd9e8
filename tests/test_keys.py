"""Router-side block keys: chained, full blocks only, seeded per model and adapter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from indexer.keys import KEY_MASK, block_keys, key_seed, prompt_keys
from tests.helpers import ROOT


def test_only_full_blocks_get_keys():
    assert len(block_keys(list(range(47)), 16, 1)) == 2
    assert len(block_keys(list(range(48)), 16, 1)) == 3
    assert block_keys(list(range(15)), 16, 1) == []


def test_keys_are_chained_prefix_identities():
    a = block_keys([1] * 16 + [2] * 16, 16, 7)
    b = block_keys([9] * 16 + [2] * 16, 16, 7)
    assert a[1] != b[1]  # same second block, different prefix
    assert block_keys([1] * 16 + [2] * 16 + [3] * 16, 16, 7)[:2] == a  # a prefix keeps its keys


def test_continuing_a_chain_from_a_parent_key_equals_the_whole_prompt():
    toks = list(range(64))
    whole = block_keys(toks, 16, 5)
    assert block_keys(toks[32:], 16, whole[1]) == whole[2:]


def test_models_and_adapters_never_share_keys():
    toks = list(range(32))
    seeds = {key_seed("m1"), key_seed("m2"), key_seed("m1", "lora-a"), key_seed("m1", "lora-b")}
    assert len(seeds) == 4
    assert prompt_keys(toks, 16, "m1") != prompt_keys(toks, 16, "m2")
    assert prompt_keys(toks, 16, "m1", "lora-a") != prompt_keys(toks, 16, "m1")


def test_keys_are_60_bit_non_negative():
    for k in block_keys(list(range(1600)), 16, key_seed("m")):
        assert 0 <= k <= KEY_MASK


def test_extra_keys_change_only_their_block_and_the_chain_after():
    toks = list(range(48))
    plain = block_keys(toks, 16, 3)
    salted = block_keys(toks, 16, 3, extra_keys=[None, ["salt"], None])
    assert salted[0] == plain[0] and salted[1] != plain[1] and salted[2] != plain[2]
    assert block_keys(toks, 16, 3, extra_keys=[None, None, None]) == plain


def test_keys_are_stable_across_processes():
    code = "from indexer.keys import prompt_keys; print(prompt_keys(list(range(64)), 16, 'm', 'x'))"
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(out) == 1 and str(prompt_keys(list(range(64)), 16, "m", "x")) + "\n" in out


def test_bad_block_size():
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, 1)
