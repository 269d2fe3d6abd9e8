"""Tokenizing only what is new (indexer/prefix_tokens.py) gives exactly the tokens of a full
tokenization, for random texts and chat histories, on byte-level BPE, WordPiece and Unigram tokenizers."""

from __future__ import annotations

import random
import re
import time
from array import array
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.keys import block_keys
from indexer.prefix_tokens import (
    PROBE,
    CachedTokens,
    NotCached,
    PrefixTokenCache,
    boundaries,
    cut_problem,
    salt_seed,
)
from tests.helpers import ROOT

WORDS = ("the quick brown fox jumps over lazy dog 42 1234567 hello, world! It's we're can't x3 "
         "naïve café 東京 数据 ok? yes: no; (a) [b] {c} \"q\" 'r' a-b a_b 3.14 1e10 -- ... ")


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Lines of words, some indented and with runs of spaces and newlines (as code and chat are), so
    the tokenizers learn tokens for whitespace runs: where a careless cut would go wrong."""
    rng = random.Random(seed)
    words = WORDS.split()
    seps = [" "] * 6 + ["  ", "   ", "    ", "\n", "\n    ", " \n"]
    return ["".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def byte_bpe(regex: str | None = None):
    """GPT-2 style byte-level BPE with a BOS post-processor; with ``regex``, Llama-3 style: the
    split regex first, then byte-level without its own regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")


def wordpiece():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                        show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return tok


def unigram():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


TOKENIZERS = {"byte-level BPE (GPT-2)": byte_bpe(), "byte-level BPE (Llama 3 regex)": byte_bpe(LLAMA3),
              "WordPiece": wordpiece(), "Unigram (Metaspace)": unigram()}

text_piece = st.text(alphabet=st.sampled_from(list("abcxyz AZ09 .,!?'\"\n\t-_éü東京   ")),
                     min_size=0, max_size=300)
words = st.lists(st.sampled_from(WORDS.split() + ["\n", "\n\n", "  ", "   ", " \n ", ".\n", "\t", "<s>", "a   b"]),
                 min_size=1, max_size=120)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=words, follow_ups=st.lists(st.tuples(st.floats(0.3, 1.0), words, text_piece), min_size=1, max_size=4),
       special=st.booleans())
def test_cached_prefixes_give_exactly_the_full_tokenization(name, prefix, follow_ups, special):
    """Each follow-up keeps a share of the text so far (all of it: the next turn; less: a branch
    of the conversation, cut anywhere) and adds words and odd characters."""
    hf = TOKENIZERS[name]
    cache = PrefixTokenCache(hf, chunk_chars=24, min_chars=0, verify_every=0)
    text = " ".join(prefix)
    assert cache.encode(text, special) == hf.encode(text, add_special_tokens=special).ids
    reusable = bool(boundaries(text, 24))
    for keep, more, noise in follow_ups:
        text = text[:int(len(text) * keep)] + " " + " ".join(more) + noise
        assert cache.encode(text, special) == hf.encode(text, add_special_tokens=special).ids, name
    assert not cache.disabled
    if reusable and follow_ups[0][0] == 1.0:
        assert cache.stats.hits >= 1  # the first text's chunks were reused


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_chat_history_reuses_its_prefix_and_stays_exact(name):
    hf = TOKENIZERS[name]
    cache = PrefixTokenCache(hf, chunk_chars=64, min_chars=0, verify_every=1, verify_share=None)
    rng = random.Random(3)
    history = "<|system|>\nYou are a helpful assistant. " + " ".join(corpus(20, seed=1)) + "\n"
    for turn in range(6):
        history += f"<|user|>\n{' '.join(rng.choice(corpus(50, seed=turn)) for _ in range(3))}\n<|assistant|>\n"
        assert cache.encode(history, True) == hf.encode(history, add_special_tokens=True).ids
        cache.wait_checked()
        history += " ".join(corpus(3, seed=100 + turn)) + "\n"
    cache.wait_checked()
    assert not cache.disabled and cache.stats.mismatches == 0 and cache.stats.verified >= 4
    assert cache.stats.hits >= 4 and cache.hit_rate() > 0.5, (cache.stats, cache.hit_rate())


def _extra_for(adapter, salt):
    """The router's per-block extra keys (router.routing.Router.keys_for): an adapter in every block,
    a salt in the first."""
    def extra_for(blocks, first):
        if adapter is not None:
            extra = [[adapter]] * blocks
            if salt is not None and first == 0 and extra:
                extra[0] = [adapter, salt]
            return extra
        return [[salt]] if salt is not None and first == 0 else None
    return extra_for


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=words, follow_ups=st.lists(st.tuples(st.floats(0.3, 1.0), words, text_piece), min_size=1, max_size=5),
       special=st.booleans(), block_size=st.sampled_from([1, 3, 16]),
       tag=st.sampled_from([(None, None), (None, "salt-a"), ("lora-1", None), ("lora-1", "salt-a")]))
def test_block_keys_from_cached_tokens_are_the_full_tokenizations_keys(name, prefix, follow_ups, special,
                                                                       block_size, tag):
    """A follow-up's keys come from the remembered keys of its prefix plus the new blocks: always
    equal to ``block_keys`` of the whole token list, for next turns and branches, any block size,
    with or without a salt or adapter."""
    hf = TOKENIZERS[name]
    cache = PrefixTokenCache(hf, chunk_chars=24, min_chars=0, verify_every=0)
    extra_for = _extra_for(*tag)
    text = " ".join(prefix)
    for keep, more, noise in [(1.0, [], "")] + follow_ups:
        text = text[:int(len(text) * keep)] + " " + " ".join(more) + noise
        full = hf.encode(text, add_special_tokens=special).ids
        got = cache.encode_cached(text, special)
        if not isinstance(got, CachedTokens):
            continue
        assert len(got) == len(full)
        want = block_keys(full, block_size, 12345, extra_for(len(full) // block_size, 0))
        assert got.block_keys(block_size, 12345, tag, extra_for) == want, (name, block_size, tag)
        assert got == full
    if all(keep == 1.0 for keep, _, _ in follow_ups) and len(boundaries(" ".join(prefix), 24)) > 1:
        assert cache.stats.key_hits >= 1  # a next turn took its prefix's keys from the cache


def test_a_follow_up_takes_its_prefixs_keys_and_keys_memory_is_bounded():
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=32, min_chars=0, verify_every=0, max_tokens=3000)
    text = " ".join(corpus(15, seed=4))
    for turn in range(12):
        text += " " + " ".join(corpus(2, seed=20 + turn))
        got = cache.encode_cached(text, True)
        assert isinstance(got, CachedTokens)
        full = hf.encode(text, add_special_tokens=True).ids
        assert got.block_keys(16, 7) == block_keys(full, 16, 7)
        assert cache._keys_held <= 3000 // 4
    assert cache.stats.key_hits >= 6 and cache.stats.key_misses == 0
    assert len(cache._keys) < 12  # the oldest turns' keys were let go
    # another seed or tag is another chain of keys: no hit, still exact
    hits = cache.stats.key_hits
    text += " more words"
    got = cache.encode_cached(text, True)
    full = hf.encode(text, add_special_tokens=True).ids
    assert got.block_keys(16, 8) == block_keys(full, 16, 8) and cache.stats.key_hits == hits


def test_the_key_memo_holds_a_digest_of_the_salt_not_the_salt():
    """A client's ``cache_salt`` may be megabytes long: the memo's key holds a fixed-size digest of it,
    and a follow-up with an equal salt (another string) still takes its prefix's keys, exactly."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=32, min_chars=0, verify_every=0)
    text = " ".join(corpus(15, seed=4))
    full = hf.encode(text, add_special_tokens=True).ids

    def keys(tokens, salt):
        extra_for = _extra_for(None, salt)
        got = tokens.block_keys(16, 7, (None, salt), extra_for)
        assert got == block_keys(full, 16, 7, extra_for(len(full) // 16, 0))
        return got

    distinct = set()
    for i in range(20):
        got = cache.encode_cached(text, True)
        assert isinstance(got, CachedTokens)
        distinct.add(tuple(keys(got, f"tenant-{i}-" + "s" * 100_000)))
    assert len(distinct) == 20 and cache.stats.key_hits == 0  # each salt its own keys
    assert len(cache._keys) == 20
    assert max(len(repr(memo)) for memo in cache._keys) < 200  # not the 100 kB salts
    salt = "".join(["tenant-5-", "s" * 100_000])  # equal to an earlier salt, not the same object
    text += " " + " ".join(corpus(2, seed=30))
    full = hf.encode(text, add_special_tokens=True).ids
    got = cache.encode_cached(text, True)
    assert isinstance(got, CachedTokens)
    keys(got, salt)
    assert cache.stats.key_hits == 1


def test_a_process_that_adopts_anothers_chunks_tokenizes_only_what_is_new():
    """What one process stores (``on_stored``) another adopts, and a follow-up there reuses it,
    exactly; a chunk it already holds is not taken twice, and adopting keeps the memory bound."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    a = PrefixTokenCache(hf, chunk_chars=64, min_chars=0, verify_every=0)
    b = PrefixTokenCache(hf, chunk_chars=64, min_chars=0, verify_every=0, max_tokens=2000)
    sent: list = []
    a.on_stored = sent.append
    text = " ".join(corpus(40, seed=3))
    a.encode(text, True)
    assert sent and sum(len(ids) for batch in sent for _, ids in batch) == 4 * a.held_tokens  # uint32 ids
    assert all(type(ids) is bytes for batch in sent for _, ids in batch)  # never tracked by the collector
    assert a.fingerprint == b.fingerprint and a.fingerprint != PrefixTokenCache(TOKENIZERS["WordPiece"]).fingerprint
    taken = sum(b.adopt(batch) for batch in sent)
    assert taken == len(a._chunks) and b.stats.adopted == taken
    assert sum(b.adopt(batch) for batch in sent) == 0  # already held
    follow_up = text + " " + " ".join(corpus(3, seed=30))
    got = b.encode_cached(follow_up, True)
    assert got == hf.encode(follow_up, add_special_tokens=True).ids
    assert b.stats.hits == 1 and b.stats.misses == 0 and b.stats.reused_tokens > 0.7 * len(got)
    assert b.held_tokens <= 2000
    a.on_stored = None


def test_cached_chunks_are_not_tracked_by_the_garbage_collector():
    """A full cache holds tens of thousands of chunks; as ``array`` objects (tracked on Python 3.11)
    every full collection walked them all. As bytes none is tracked, and they read back exactly."""
    import gc

    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=32, min_chars=0, verify_every=0)
    text = " ".join(corpus(400, seed=5))
    cache.encode(text, False)
    assert len(cache._chunks) > 50
    assert not any(gc.is_tracked(ids) for ids in cache._chunks.values())
    got = cache.encode_cached(text + " and more", False)
    assert isinstance(got, CachedTokens) and got.tolist() == hf.encode(text + " and more", add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["byte-level BPE (GPT-2)", "WordPiece"])
def test_a_bound_on_new_characters_refuses_before_tokenizing_anything(name):
    """``max_new_chars``: a text with more than that past its cached prefix raises ``NotCached`` and
    leaves the cache as it was; a follow-up within it is tokenized exactly, as without the bound."""
    import indexer.prefix_tokens as pt

    hf = TOKENIZERS[name]
    cache = PrefixTokenCache(hf, chunk_chars=64, min_chars=200, verify_every=0)
    text = " ".join(corpus(40, seed=5))
    whole_pass = pt.chain_keys
    pt.chain_keys = None  # a text whose first chunk is unknown is refused before the whole text is hashed
    try:
        with pytest.raises(NotCached):
            cache.encode_cached(text, True, max_new_chars=500)
    finally:
        pt.chain_keys = whole_pass
    assert cache.held_tokens == 0 and cache.stats.misses == 0 and cache.stats.tokenized_tokens == 0
    cache.encode_cached(text, True)  # the first turn, unbounded: stored
    held = cache.held_tokens
    added = " " + " ".join(corpus(2, seed=31))
    follow_up = text + added
    with pytest.raises(NotCached):  # a bound below what is new
        cache.encode_cached(follow_up, True, max_new_chars=len(added) // 2)
    assert cache.held_tokens == held and cache.stats.hits == 0
    got = cache.encode_cached(follow_up, True, max_new_chars=len(added) + 64)  # the new part and the last chunk's rest
    assert got == hf.encode(follow_up, add_special_tokens=True).ids
    assert cache.stats.hits == 1
    short = "a few words"  # too short for the cache: tokenized whole, if within the bound
    assert cache.encode_cached(short, True, max_new_chars=len(short)) == hf.encode(short).ids
    with pytest.raises(NotCached):
        cache.encode_cached(short, True, max_new_chars=len(short) - 1)


def test_a_bounded_prompt_refuses_a_batch_of_texts_and_a_text_with_too_much_new(tmp_path):
    """``prompt_tokens(..., max_new_chars)``: a batch of texts is refused (its other prompts would be
    tokenized whole), token ids are not (nothing to tokenize), a text within the bound is tokenized."""
    from indexer.tokens import HFTokenizer
    from router.prompts import prompt_tokens

    TOKENIZERS["byte-level BPE (GPT-2)"].save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    tok.cache_prefixes(verify_every=0)
    text = " ".join(corpus(40, seed=8))
    with pytest.raises(NotCached):
        prompt_tokens("completion", {"prompt": [text, "two"]}, tok, max_new_chars=10 * len(text))
    with pytest.raises(NotCached):
        prompt_tokens("completion", {"prompt": text}, tok, max_new_chars=100)
    assert list(prompt_tokens("completion", {"prompt": [[1, 2], [3]]}, tok, max_new_chars=1)) == [1, 2]
    assert list(prompt_tokens("completion", {"prompt": text}, tok, max_new_chars=len(text))) == tok.encode(text)
    with pytest.raises(NotCached):
        prompt_tokens("chat", {"messages": [{"role": "user", "content": text}]}, tok, max_new_chars=100)


def test_a_turn_after_one_another_process_served_hashes_only_the_blocks_after_its_own_last_turn(monkeypatch):
    """Turns of one conversation alternate between two processes that share chunks, not block keys:
    a turn whose prefix ends in chunks adopted from the other process takes the keys this process
    remembered for its own earlier turn and hashes only the blocks after it, exactly."""
    import indexer.prefix_tokens as pt

    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    a = PrefixTokenCache(hf, chunk_chars=48, min_chars=0, verify_every=0)
    b = PrefixTokenCache(hf, chunk_chars=48, min_chars=0, verify_every=0)
    a.on_stored, b.on_stored = b.adopt, a.adopt
    hashed: list[int] = []
    real = pt.block_keys
    monkeypatch.setattr(pt, "block_keys", lambda tokens, *rest: (hashed.append(len(tokens)), real(tokens, *rest))[1])
    text = " ".join(corpus(30, seed=5))
    for turn, cache in enumerate([b, a, b, a, b]):
        text += " " + " ".join(corpus(3, seed=40 + turn))
        got = cache.encode_cached(text, True)
        full = hf.encode(text, add_special_tokens=True).ids
        assert got == full and got.block_keys(16, 7) == block_keys(full, 16, 7)
    # the last turn on b: its prefix's last chunks came from a, but b remembered the turn before
    assert b.stats.key_misses == 0 and b.stats.key_hits == 2  # its first turn reused nothing
    assert hashed[-1] < 0.4 * len(full), (hashed, len(full))
    a.on_stored = b.on_stored = None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab9 _.\n\t-é東\u00a0 ")), max_size=400), st.integers(1, 40))
def test_chunk_ends_and_their_keys_are_what_their_definitions_say(text, chunk_chars):
    """``boundaries``: each end the first space at or after the last end + ``chunk_chars`` whose
    preceding character is a letter or digit; ``chain_keys``: ``chain_key`` chained over the chunks
    (ASCII texts take a faster path)."""
    from indexer.prefix_tokens import chain_key, chain_keys

    want, pos = [], chunk_chars
    while True:
        p = next((i for i in range(pos, len(text)) if text[i] == " " and text[i - 1].isalnum()), None)
        if p is None:
            break
        want.append(p)
        pos = p + chunk_chars
    assert boundaries(text, chunk_chars) == want
    keys, h, start = [], 0, 0
    for p in want:
        h = chain_key(h, text[start:p])
        keys.append(h)
        start = p
    assert chain_keys(text, want) == keys
    ascii_only = text.encode("ascii", "ignore").decode()
    ends = boundaries(ascii_only, chunk_chars)
    assert chain_keys(ascii_only, ends) == chain_keys(ascii_only + "é", ends)  # the same keys either path


edits = st.tuples(st.sampled_from(["extend", "change", "space", "cut"]), st.floats(0.0, 1.0),
                  st.text(alphabet=st.sampled_from(list("ab9 _.\n-é東 ")), min_size=1, max_size=60))


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab9 _.\n\t-é東\u00a0 ")), min_size=1, max_size=300),
       st.lists(edits, min_size=1, max_size=8), st.integers(1, 24), st.booleans())
def test_a_text_cut_from_a_noted_prefix_has_the_ends_and_keys_of_a_whole_cut(base, steps, chunk_chars, ascii_only):
    """``PrefixTokenCache._cut`` takes an earlier text's ends and keys where that text is a prefix of
    this one through its last chunk end, and cuts only the rest. Texts that extend one another, or
    differ from a noted one anywhere (also at the space after its last chunk end, or only inside
    it, where its tail still matches), or are shorter: always the ends and keys of the whole text."""
    from indexer.prefix_tokens import chain_keys

    cache = PrefixTokenCache(TOKENIZERS["byte-level BPE (GPT-2)"], chunk_chars=chunk_chars, min_chars=0)
    text = base.encode("ascii", "ignore").decode() or "x" if ascii_only else base
    texts = [text]
    for kind, where, piece in steps:
        if ascii_only:
            piece = piece.encode("ascii", "ignore").decode() or "y"
        at = int(where * len(text))
        if kind == "extend":
            text = text + piece
        elif kind == "change":  # the same length and tail: only the hash can tell
            text = text[:at] + ("Q" if text[at:at + 1] != "Q" else "R") + text[at + 1:] if text else piece
        elif kind == "space":  # the character after a noted text's last chunk end
            ends = boundaries(text, chunk_chars)
            if ends:
                text = text[:ends[-1]] + "Z" + text[ends[-1] + 1:] + piece
        else:
            text = text[:at] + piece
        texts.append(text)
    for t in texts + texts[::-1]:
        ends = boundaries(t, chunk_chars)
        assert cache._cut(t, cache._first_key(t)) == (ends, chain_keys(t, ends))
    assert cache._notes_held == sum(len(n.ends) for notes in cache._notes.values() for n in notes)


def test_notes_are_bounded_and_a_follow_up_takes_its_conversations_note():
    """At most ``NOTES_PER_HEAD`` per first chunk and ``max_tokens // 16`` chunk ends in all; a
    follow-up finds the note of its own conversation among others that share its first chunk."""
    from indexer.prefix_tokens import NOTES_PER_HEAD, chain_keys

    cache = PrefixTokenCache(TOKENIZERS["byte-level BPE (GPT-2)"], chunk_chars=16, min_chars=0)
    system = " ".join(corpus(20, seed=3))
    convs = [system + " " + " ".join(corpus(3, seed=10 + i)) for i in range(NOTES_PER_HEAD)]
    for c in convs:
        cache._cut(c, cache._first_key(c))
    assert len(cache._notes) == 1 and len(next(iter(cache._notes.values()))) == NOTES_PER_HEAD
    taken = []
    real = chain_keys
    import indexer.prefix_tokens as pt

    def counting(text, ends, start=0, key=0):
        taken.append(len(text) - start)  # the characters it hashes from
        return real(text, ends, start, key)

    pt.chain_keys = counting
    try:
        follow = convs[2] + " and more words " * 4
        ends = boundaries(follow, 16)
        assert cache._cut(follow, cache._first_key(follow)) == (ends, real(follow, ends))
        assert taken == [len(follow) - boundaries(convs[2], 16)[-1]]  # only past conversation 2's last end
        # the same length, first chunk and tail as conversation 3, one character changed between
        at = len(system) // 2
        changed = convs[3][:at] + ("Q" if convs[3][at] != "Q" else "R") + convs[3][at + 1:] + " more words"
        ends = boundaries(changed, 16)
        taken.clear()
        assert cache._cut(changed, cache._first_key(changed)) == (ends, real(changed, ends))
        assert taken == [len(changed)]
        # all of conversation 4 before its last chunk end, but not the space there: cut whole too
        end = boundaries(convs[4], 16)[-1]
        moved = convs[4][:end] + "_" + convs[4][end + 1:] + " and more words"
        ends = boundaries(moved, 16)
        taken.clear()
        assert cache._cut(moved, cache._first_key(moved)) == (ends, real(moved, ends))
        assert taken == [len(moved)]
    finally:
        pt.chain_keys = real
    small = PrefixTokenCache(TOKENIZERS["byte-level BPE (GPT-2)"], chunk_chars=16, min_chars=0, max_tokens=16 * 400)
    for i in range(200):  # conversations, each its own first chunk: the least recently used notes go
        text = f"conversation {i} " + " ".join(corpus(4, seed=100 + i))
        small._cut(text, small._first_key(text))
        assert small._notes_held == sum(len(n.ends) for notes in small._notes.values() for n in notes)
        assert small._notes_held <= 400 or len(small._notes) == 1
    assert 0 < small._notes_held <= 400 and len(small._notes) > 1
    for c in convs[:3]:  # one first chunk, texts longer than the bound together: its latest note stays
        small._cut(c, small._first_key(c))
    assert list(small._notes)[-1] == next(iter(cache._notes))
    assert small._notes_held <= 400 or len(small._notes) == 1


def test_a_follow_up_does_not_look_up_the_chunks_its_note_vouches_for_and_does_once_it_may_not():
    """A conversation's next turn takes its history's chunks on the word of its last turn's note (no
    lookup, no touch: ``PrefixTokenCache._vouches``) while too few tokens were stored since for any
    of them to be evicted; past that, it looks them up again. Its tokens stay exact either way."""
    from collections import OrderedDict

    hf = TOKENIZERS["byte-level BPE (GPT-2)"]

    class Counting(OrderedDict):
        gets = 0
        moves = 0

        def get(self, key, default=None):
            Counting.gets += 1
            return super().get(key, default)

        def move_to_end(self, key, last=True):
            Counting.moves += 1
            return super().move_to_end(key, last)

    history = " ".join(corpus(12, seed=5))
    cache = PrefixTokenCache(hf, chunk_chars=16, min_chars=0, verify_every=0)
    cache._chunks = Counting()
    cache.encode_cached(history).block_keys(4, 7)  # the history's keys remembered, as the router's are
    chunks = len(boundaries(history, 16))
    follow = history + " and then a new turn with more words"
    Counting.gets = Counting.moves = 0
    got = cache.encode_cached(follow)
    assert isinstance(got, CachedTokens) and got._reused > 0 and cache.stats.vouched == 1
    assert len(got) == len(hf.encode(follow).ids)
    assert Counting.moves == 0 and Counting.gets < 3  # only the chunk ends past the note were looked up
    assert got.block_keys(4, 7) == block_keys(hf.encode(follow).ids, 4, 7)
    assert Counting.gets < 5   # the keys were hashed from the tokens of the history's last chunks only
    assert got.tolist() == hf.encode(follow).ids
    assert Counting.gets >= chunks  # all of them, once the whole list was asked for
    # more stored since than the cache could hold beside the conversation: looked up (and touched) again
    small = PrefixTokenCache(hf, chunk_chars=16, min_chars=0, verify_every=0,
                             max_tokens=len(hf.encode(follow).ids) * 3)
    small._chunks = Counting()
    small.encode(history)
    small.encode(follow)
    assert small.stats.vouched == 1
    while small._inserted < small.max_tokens * 2:
        small.encode(" ".join(corpus(6, seed=small._inserted)))
    Counting.gets = Counting.moves = 0
    again = follow + " and one more turn"
    assert small.encode_cached(again).tolist() == hf.encode(again).ids
    assert small.stats.vouched == 1 and Counting.gets >= 1
    assert small.stats.vouched_missing == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.integers(0, 5), st.floats(0.2, 1.0), words), min_size=5, max_size=40),
       room=st.integers(60, 600))
def test_vouched_chunks_are_never_gone_in_a_small_cache_under_many_conversations(steps, room):
    """Six conversations take turns (a next turn, or a branch cut anywhere) in a cache of a few
    hundred tokens, evicting all the time: every text is tokenized exactly, and no chunk a note
    vouched for was ever found gone."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=16, min_chars=0, verify_every=0, max_tokens=room)
    convs = [f"conversation {i} opens here: " for i in range(6)]
    for i, keep, more in steps:
        convs[i] = convs[i][:max(int(len(convs[i]) * keep), 30)] + " " + " ".join(more)
        assert cache.encode(convs[i]) == hf.encode(convs[i]).ids
    assert cache.stats.vouched_missing == 0 and cache.held_tokens <= room


def test_chain_keys_are_the_same_in_every_process():
    """Workers and replicas share chunks by their keys: another interpreter (another string-hash seed)
    gives the same keys."""
    import subprocess
    import sys

    from indexer.prefix_tokens import chain_key

    text = "naïve café 東京 \ud800 " * 20  # a lone surrogate too: JSON can carry one
    here = [chain_key(0, text[:40]), chain_key(chain_key(0, text[:40]), text[40:])]
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", "import sys; from indexer.prefix_tokens import chain_key; "
                              "t = sys.argv[1].encode('utf-8', 'surrogatepass').decode('unicode_escape'); "
                              "k = chain_key(0, t[:40]); print(k, chain_key(k, t[40:]))",
                              text.encode("unicode_escape").decode()],
                             capture_output=True, text=True, env={"PYTHONHASHSEED": seed}, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        assert [int(x) for x in out.stdout.split()] == here


def test_boundaries_are_spaces_after_a_letter_or_digit_at_least_chunk_chars_apart():
    text = "aaaa bbbb. cccc  dddd 12 e"
    ends = boundaries(text, 4)
    assert ends == [4, 15, 21]
    assert all(text[p] == " " and text[p - 1].isalnum() for p in ends)


def check_starts(cache: PrefixTokenCache) -> list[tuple[float, float]]:
    """The CPU times spent checking and tokenizing when each of ``cache``'s checks started."""
    started: list[tuple[float, float]] = []
    submit = cache._submit_check

    def record(*args: Any) -> None:
        started.append((cache.stats.verify_seconds, cache.stats.tokenize_seconds))
        submit(*args)

    cache._submit_check = record  # type: ignore[method-assign]
    return started


def follow_ups(cache: PrefixTokenCache, hf: Any, turns: int, words: int, seed: int) -> None:
    """A 600-line history and ``turns`` follow-ups of ``words`` lines each, every text exact, each
    check waited for."""
    history = " ".join(corpus(600, seed=1))
    for turn in range(turns):
        history += " " + " ".join(corpus(words, seed=seed + turn))
        assert cache.encode(history, False) == hf.encode(history, add_special_tokens=False).ids
        cache.wait_checked()


def test_the_checks_take_at_most_their_share_of_the_tokenizers_work():
    """Follow-ups of a long history: each check re-tokenizes all of it, so with a check at every hit
    the checks would cost many times the new words; the share caps them and still checks some."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=64, min_chars=0, verify_every=1, verify_share=0.1)
    started = check_starts(cache)
    follow_ups(cache, hf, turns=40, words=6, seed=200)
    st = cache.stats
    assert st.hits == 39 and 1 <= st.verified < 10, st
    # the share is of CPU time, not tokens: a check starts only while the checks so far are within it
    assert len(started) == st.verified and st.tokenize_seconds > 0 and st.verify_seconds > 0, st
    assert all(checking <= 0.1 * tokenizing for checking, tokenizing in started), started


def test_the_share_is_of_cpu_time_so_a_costly_check_waits_for_more_tokenizing():
    """A check re-tokenizes the whole text with the tokenizers library, which costs several times
    what the cache's tokenizing of as many tokens costs (tiktoken's twin: 726 against 145 ns a token
    at 8k on the real tier's model). Counted in tokens, a share of 1 lets a second check start at
    the next hit; counted in CPU time, a check that costs 20 ms waits for 20 ms of tokenizing."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=64, min_chars=0, verify_every=1, verify_share=1.0)
    reference = cache._reference

    def costly(text: str, special: bool) -> list[int]:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return reference(text, special)

    cache._reference = costly  # type: ignore[method-assign]
    started = check_starts(cache)
    follow_ups(cache, hf, turns=12, words=30, seed=300)
    st = cache.stats
    assert st.hits == 11 and st.verified == len(started) >= 1 and st.mismatches == 0, st
    assert st.verify_seconds >= 0.02 * st.verified, st
    assert all(checking <= tokenizing for checking, tokenizing in started), started


def test_memory_is_bounded_and_a_mismatch_turns_the_cache_off():
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=16, min_chars=0, max_tokens=200, verify_every=0)
    for i in range(50):
        cache.encode(" ".join(corpus(5, seed=i)))
    assert 0 < cache.held_tokens <= 200
    # a tokenizer whose output depends on what precedes a chunk breaks the property: the check catches it
    seen = []
    cache = PrefixTokenCache(hf, chunk_chars=16, min_chars=0, verify_every=1, on_mismatch=lambda: seen.append(1))
    text = " ".join(corpus(5, seed=1))
    cache.encode(text)
    first_chunk = next(iter(cache._chunks))
    cache._chunks[first_chunk] = array("I", [7, 7, 7]).tobytes()  # a corrupted entry
    wrong = cache.encode(text + " more words")  # this one is answered from the cache, and checked aside
    assert wrong != hf.encode(text + " more words").ids
    cache.wait_checked()
    assert cache.disabled and seen == [1] and cache.stats.mismatches == 1
    assert cache.encode(text + " more words") == hf.encode(text + " more words").ids  # off: whole again


def test_a_tokenizer_whose_tokens_may_span_a_chunk_end_is_used_without_the_cache():
    """A token that holds a space after a letter ("x y" here) could span a chunk end, so the texts
    this tokenizer makes are not the sum of their chunks': the cache turns itself off when made and
    every text is tokenized whole, exactly."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "x y", "aa", "bb", "cc", "dd", " "])}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"x y|\S+|\s"), behavior="isolated")
    text = "aa bb x y cc dd aa bb"
    assert boundaries(text, 1)[:3] == [2, 5, 7]  # the third ends inside the token "x y"
    cache = PrefixTokenCache(hf, chunk_chars=1, min_chars=0, verify_every=0)
    assert cache.disabled and "token 1 ('x y')" in cache.disabled_reason
    for t in (text, text + " cc"):
        assert cache.encode(t, False) == hf.encode(t, add_special_tokens=False).ids
    assert not cache._chunks and cache.stats.hits == cache.stats.misses == 0


def test_a_normalizer_that_marks_each_texts_start_turns_the_cache_off():
    """Llama 2's tokenizer prepends "▁" to every text it is given: a chunk tokenized alone would get
    one more marker than inside the whole text. The probe text finds it; no vocabulary token does."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # no token spans a word start
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    hf.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                         show_progress=False))
    text = "alpha beta gamma delta"
    pieces = [text[:5], text[5:]]  # cut at a chunk end: "▁alpha" + "▁▁beta..." against "▁alpha▁beta..."
    assert [t for p in pieces for t in hf.encode(p).ids] != hf.encode(text).ids
    assert cut_problem(hf) == "a probe text tokenized chunk by chunk differs from it tokenized whole"
    cache = PrefixTokenCache(hf, chunk_chars=4, min_chars=0, verify_every=0)
    assert cache.disabled and cache.encode(text * 3, False) == hf.encode(text * 3, add_special_tokens=False).ids


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_tokenizers_the_cache_serves_pass_its_check(name):
    """The probe text has chunk ends of every kind (before words, digits, punctuation, runs of spaces,
    newlines), and the cache's own tokenizers keep them all."""
    hf = TOKENIZERS[name]
    assert cut_problem(hf) is None
    after = {PROBE[p + 1] for p in boundaries(PROBE, 1) if p + 1 < len(PROBE)}
    assert {" ", "\n", "\t", "1", "(", "#", "東", "\u00a0"} <= after and any(c.isalpha() for c in after)
    assert not PrefixTokenCache(hf).disabled


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_branches_that_differ_inside_a_run_of_spaces_stay_exact(name):
    """A cut inside a run of spaces is where a tokenizer's look-ahead can join what a shorter run
    split: conversations that share a prefix ending in spaces and then differ must not reuse it."""
    hf = TOKENIZERS[name]
    head = "alpha beta gamma delta "
    cases = []
    for a in range(1, 6):
        for b in range(1, 6):
            for tail in ("y z", "\nz", ". z", "1 2"):
                cases.append((head + "x" + " " * a + tail, head + "x" + " " * b + tail))
    for first, second in cases:
        cache = PrefixTokenCache(hf, chunk_chars=1, min_chars=0, verify_every=0)
        for text in (first, second, first):
            assert cache.encode(text, False) == hf.encode(text, add_special_tokens=False).ids, (name, text)


async def test_the_router_reuses_prefix_tokens_and_tokenizes_big_prompts_off_the_loop(tmp_path):
    """Through the router: chat follow-ups are tokenized from the cache (metrics say how much), and the
    prompt it routes on is the full tokenization's, whether tokenized inline or in a tokenize thread."""
    import httpx

    from indexer.tokens import HFTokenizer, chat_request_ids
    from tests.test_router_api import pods_running, running_router, settings_for

    folder = tmp_path / "tok"
    folder.mkdir()
    TOKENIZERS["byte-level BPE (GPT-2)"].save(str(folder / "tokenizer.json"))
    plain = HFTokenizer(folder / "tokenizer.json")
    messages = [{"role": "system", "content": " ".join(corpus(60, seed=9))}]
    async with pods_running(1) as pods:
        for offload in (0, 10**9):  # every body in the threads; none
            settings = settings_for(pods, tokenizer=str(folder / "tokenizer.json"), tokenize_offload_bytes=offload,
                                    tokenize_inline_chars=0)  # not on the loop when nothing else is: below
            async with running_router(settings) as (base, services):
                if offload == 0:  # bodies go to the tokenize process once it is up (before: the threads)
                    from tests.test_tokenize_process import until_ready

                    await until_ready(services.tokenize_process)
                async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                    history = list(messages)
                    for turn in range(4):
                        history.append({"role": "user", "content": " ".join(corpus(4, seed=turn))})
                        body = {"model": "m", "messages": history, "max_tokens": 2}
                        explained = (await c.post("/debug/route", json=body)).json()
                        assert explained["prompt_tokens"] == len(chat_request_ids(body, plain))
                        # the keys it routes on are the full tokenization's, salted or not
                        tokens, _ = services.router.prompt("chat", body)
                        assert turn == 0 or isinstance(tokens, CachedTokens)
                        for salt in (None, "tenant-a"):
                            assert services.router.keys_for("m", tokens, salt) == \
                                services.router.keys_for("m", chat_request_ids(body, plain), salt)
                        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
                        history.append({"role": "assistant", "content": " ".join(corpus(2, seed=50 + turn))})
                    metrics = (await c.get("/metrics")).text
                assert "kvroute_tokenize_cache_enabled 1.0" in metrics
                # tokenized by tiktoken's twin of the tokenizer, here and in the tokenize process
                assert "kvroute_tokenize_tiktoken 1.0" in metrics and services.prefix_tokens.twin
                assert offload != 0 or services.tokenize_process.cache.tiktoken
                rate = float(re.search(r"^kvroute_tokenize_cache_hit_rate (\S+)$", metrics, re.M).group(1))
                # the follow-ups took their history on their last turn's note, and none of it was gone
                child_counts = services.tokenize_process.cache if offload == 0 else None
                vouched = services.prefix_tokens.stats.vouched + (child_counts.vouched if child_counts else 0)
                assert vouched >= 1
                assert f"kvroute_tokenize_cache_vouched_texts {float(vouched)}" in metrics
                assert "kvroute_tokenize_cache_vouched_missing_chunks 0.0" in metrics
                if offload == 0:  # all eight went to the tokenize process, and its cache's counts are in the gauges
                    assert services.tokenize_process.jobs["done"] == 8
                    assert 'kvroute_tokenize_process_jobs_total{outcome="done"} 8.0' in metrics
                    child = services.tokenize_process.cache
                    mine = services.prefix_tokens.stats  # this test's own calls of router.prompt
                    assert child.reused > 0
                    reused = child.reused + mine.reused_tokens
                    seen = reused + child.tokenized + mine.tokenized_tokens
                    assert rate == pytest.approx(reused / seen) and rate > 0.5
                else:
                    cache = services.prefix_tokens
                    assert cache is not None and not cache.disabled and cache.stats.hits >= 6
                    assert rate == pytest.approx(cache.hit_rate()) and rate > 0.5


async def test_a_follow_up_is_tokenized_on_the_loop_from_chunks_the_tokenize_process_stored(tmp_path):
    """One connection, every body large: a conversation's first turn goes to the tokenize process (its
    new part is all of it), each follow-up is tokenized on the event loop from the chunks the process
    sent back, and the process gets the chunks the loop stored with its next job, so a follow-up it
    tokenizes later reuses them. The keys are the full tokenization's either way."""
    import httpx

    from indexer.keys import key_seed
    from indexer.tokens import HFTokenizer, chat_request_ids
    from tests.test_router_api import pods_running, running_router, settings_for
    from tests.test_tokenize_process import until_ready

    folder = tmp_path / "tok"
    folder.mkdir()
    TOKENIZERS["byte-level BPE (GPT-2)"].save(str(folder / "tokenizer.json"))
    plain = HFTokenizer(folder / "tokenizer.json")

    def inline(text: str, outcome: str) -> float:
        found = re.search(rf'^kvroute_tokenize_inline_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    async with pods_running(1) as pods:
        settings = settings_for(pods, tokenizer=str(folder / "tokenizer.json"), tokenize_offload_bytes=0,
                                tokenize_inline_chars=2000)
        async with running_router(settings) as (base, services):
            proc = services.tokenize_process
            await until_ready(proc)
            history = [{"role": "system", "content": " ".join(corpus(60, seed=21))}]
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                for turn in range(4):
                    history.append({"role": "user", "content": " ".join(corpus(3, seed=40 + turn))})
                    body = {"model": "m", "messages": history, "max_tokens": 2}
                    explained = (await c.post("/debug/route", json=body)).json()
                    assert explained["prompt_tokens"] == len(chat_request_ids(body, plain))
                    history.append({"role": "assistant", "content": " ".join(corpus(1, seed=60 + turn))})
                metrics = (await c.get("/metrics")).text
            # the first turn in the process (too new for the loop), the three follow-ups on the loop
            assert proc.jobs["done"] == 1 and inline(metrics, "too-new") == 1 and inline(metrics, "done") == 3
            assert services.prefix_tokens.stats.hits == 3  # from the chunks the process sent back
            # the process gets the loop's chunks ahead of its next job: a follow-up it tokenizes reuses them
            history.append({"role": "user", "content": " ".join(corpus(3, seed=44))})
            body = {"model": "m", "messages": history, "max_tokens": 2}
            before = proc.cache.reused
            got = await proc.run("chat", orjson.dumps(body), 16, key_seed("m"), None, None, 4.0)
            want = chat_request_ids(body, plain)
            assert got is not None and len(got[0]) == len(want)
            assert proc.cache.adopted > 0
            assert proc.cache.reused - before > 0.8 * len(want)  # it tokenized only the last turn


@pytest.mark.parametrize("offload", [None, 0])
async def test_replicas_share_the_chunks_they_tokenize(tmp_path, offload):
    """Two `kvroute serve` replicas on the booking bus: a conversation's first turn goes through A, its
    follow-up through B, and B tokenizes only the new part, from the chunks A sent it (exactly). With
    ``tokenize_offload_bytes: 0`` (and never on the event loop) both are tokenized in the replicas'
    tokenize processes."""
    import asyncio
    import contextlib

    import httpx
    import yaml

    from indexer.tokens import HFTokenizer, chat_request_ids
    from simulator.testing import running_sims
    from tests.helpers import free_ports, kvroute_process

    folder = tmp_path / "tok"
    folder.mkdir()
    TOKENIZERS["byte-level BPE (GPT-2)"].save(str(folder / "tokenizer.json"))
    plain = HFTokenizer(folder / "tokenizer.json")
    port_a, port_b, bus_a, bus_b = free_ports(4)

    def gauge(text: str, name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    with running_sims(1, ["--timing", "seed"]) as urls, contextlib.ExitStack() as stack:
        bases = []
        for name, port, mine, other in (("a", port_a, bus_a, bus_b), ("b", port_b, bus_b, bus_a)):
            cfg = tmp_path / f"router-{name}.yaml"
            cfg.write_text(yaml.safe_dump({
                "port": port, "pods": [{"id": "sim-0", "url": urls[0], "model": "sim-model"}],
                "tokenizer": str(folder / "tokenizer.json"), "booking_bus_bind": f"tcp://127.0.0.1:{mine}",
                "booking_bus_peers": [f"tcp://127.0.0.1:{other}"], "booking_bus_snapshot_s": 0.2,
                **({} if offload is None else {"tokenize_offload_bytes": offload, "tokenize_inline_chars": 0})}))
            stack.enter_context(kvroute_process(["serve", "--config", str(cfg)],
                                                ready_url=f"http://127.0.0.1:{port}/ready", timeout=40))
            bases.append(f"http://127.0.0.1:{port}")
        a, b = bases
        async with httpx.AsyncClient(timeout=30) as c:
            for _ in range(100):
                texts = [(await c.get(base + "/metrics")).text for base in bases]
                heard = [("kvroute_booking_peers 1.0" in t
                          and (offload is None or "kvroute_tokenize_process_up 1.0" in t)) for t in texts]
                if all(heard):
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("the replicas never heard each other")
            history = [{"role": "system", "content": " ".join(corpus(80, seed=11))},
                       {"role": "user", "content": " ".join(corpus(3, seed=12))}]
            first = {"model": "sim-model", "messages": history, "max_tokens": 2}
            assert (await c.post(a + "/v1/chat/completions", json=first)).status_code == 200
            for _ in range(100):
                metrics = (await c.get(b + "/metrics")).text
                if gauge(metrics, "kvroute_tokenize_cache_adopted_chunks") > 0:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("B never took A's chunks")
            assert gauge(metrics, "kvroute_tokenize_cache_reused_tokens") == 0  # B has tokenized nothing itself
            follow_up = {"model": "sim-model", "max_tokens": 2, "messages": history + [
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": " ".join(corpus(3, seed=13))}]}
            explained = (await c.post(b + "/debug/route", json=follow_up)).json()
            assert explained["prompt_tokens"] == len(chat_request_ids(follow_up, plain))
            assert (await c.post(b + "/v1/chat/completions", json=follow_up)).status_code == 200
            metrics = (await c.get(b + "/metrics")).text
            assert gauge(metrics, "kvroute_tokenize_cache_hit_rate") > 0.8, metrics
            assert gauge(metrics, "kvroute_tokenize_cache_enabled") == 1.0
            if offload == 0:
                assert 'kvroute_tokenize_process_jobs_total{outcome="done"} 2.0' in metrics


def test_the_router_says_why_its_prefix_token_cache_is_off(tmp_path, caplog):
    """An operator whose tokenizer fails the check learns it from the log, with the reason, as well as
    from ``kvroute_tokenize_cache_enabled 0``."""
    import logging

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from kvcommon.settings import build_settings
    from router.config import RouterSettings
    from router.service import Services

    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "x y": 1, "aa": 2, " ": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"x y|\S+|\s"), behavior="isolated")
    hf.save(str(tmp_path / "tokenizer.json"))
    settings = build_settings(RouterSettings, {
        "pods": [{"id": "p", "url": "http://127.0.0.1:9", "model": "m"}],
        "tokenizer": str(tmp_path / "tokenizer.json"), "tokenize_process": False})
    with caplog.at_level(logging.WARNING, logger="kvroute"):
        services = Services(settings)
    assert services.prefix_tokens is not None and services.prefix_tokens.disabled
    assert "prefix token cache off" in caplog.text and "token 1 ('x y')" in caplog.text


# ---- salted texts: chains seeded by the request's cache_salt (router/prompts.py) ----------------------
SEEDS = (0, salt_seed("tenant-a"), salt_seed("tenant-b"))


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=words, follow_ups=st.lists(st.tuples(st.floats(0.3, 1.0), words, text_piece, st.sampled_from(SEEDS)),
                                         min_size=1, max_size=5),
       special=st.booleans(), seed=st.sampled_from(SEEDS))
def test_seeded_texts_give_exactly_the_full_tokenization_and_its_keys_whatever_other_seeds_cached(
        name, prefix, follow_ups, special, seed):
    """Turns and branches of a conversation, each under one of three seeds (unsalted, two salts), in
    one cache: every text's tokens and block keys are those of a full tokenization, and a text
    reuses chunks only where an earlier text of its own seed covered them."""
    hf = TOKENIZERS[name]
    cache = PrefixTokenCache(hf, chunk_chars=24, min_chars=0, verify_every=0)
    text = " ".join(prefix)
    assert cache.encode(text, special, seed) == hf.encode(text, add_special_tokens=special).ids
    seen = {seed: [text]}
    for keep, more, noise, s in follow_ups:
        text = text[:int(len(text) * keep)] + " " + " ".join(more) + noise
        before = cache.stats.reused_tokens
        got = cache.encode_cached(text, special, None, s)
        full = hf.encode(text, add_special_tokens=special).ids
        assert list(got) == full, name
        if isinstance(got, CachedTokens):
            extra_for = _extra_for(None, "salt")
            want = block_keys(full, 16, 12345, extra_for(len(full) // 16, 0))
            assert got.block_keys(16, 12345, (None, "salt"), extra_for) == want
        ends = boundaries(text, 24)
        mine = seen.setdefault(s, [])
        if not any(e <= len(t) and text[:e] == t[:e] for t in mine for e in ends[:1]):
            assert cache.stats.reused_tokens == before  # no text of this seed shares its first chunk
        mine.append(text)
    assert not cache.disabled


def test_a_salted_texts_chunks_are_found_only_by_texts_of_its_salt():
    """What tenant A's request stores is found by A's follow-up, not by tenant B's identical text nor
    an unsalted one (each tokenized from nothing, and told new by its first chunk: ``NotCached``);
    unsalted texts find each other's chunks as before. Chunks another process stored (the tokenize
    process, the booking bus) are found by the same rule: the keys carry the seed."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=64, min_chars=0, verify_every=0)
    a, b = salt_seed("tenant-a"), salt_seed("tenant-b")
    assert 0 not in (a, b) and a != b and salt_seed("tenant-a") == a
    text = " ".join(corpus(80, seed=4))
    more = text + " " + " ".join(corpus(5, seed=5))

    def reused(t: str, seed: int, into: PrefixTokenCache = cache) -> int:
        before = into.stats.reused_tokens
        assert list(into.encode_cached(t, False, None, seed)) == hf.encode(t, add_special_tokens=False).ids
        return into.stats.reused_tokens - before

    stored: list[tuple[int, bytes]] = []
    cache.on_stored = stored.extend
    assert reused(text, a) == 0
    shared = stored[:]
    assert reused(text, b) == 0 and cache.stats.hits == 0 and cache.stats.misses == 2
    with pytest.raises(NotCached):  # a follow-up with little new text, but none of it this salt's
        cache.encode_cached(more, False, 200, salt_seed("tenant-c"))
    assert reused(more, 0) == 0
    held = cache.held_tokens
    assert reused(more, a) > 0 and reused(more, b) > 0 and reused(more + " again", 0) > 0
    assert cache.stats.hits == 3
    assert held >= 3 * len(hf.encode(text, add_special_tokens=False).ids) * 0.9  # three tenants, three copies
    # another process's chunks of A's text: A's follow-up finds them, B's and an unsalted one do not
    peer = PrefixTokenCache(hf, chunk_chars=64, min_chars=0, verify_every=0)
    assert peer.adopt(shared) == len(shared) > 0
    assert reused(more, b, peer) == 0 and reused(more, 0, peer) == 0 and reused(more, a, peer) > 0


def test_salted_texts_keep_the_caches_bounds():
    """The same text under many salts: distinct entries, as distinct texts would be, within the same
    caps (tokens, keys, notes)."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=32, min_chars=0, verify_every=0, max_tokens=2000)
    text = " ".join(corpus(40, seed=6))
    for i in range(60):
        got = cache.encode_cached(text, False, None, salt_seed(f"salt-{i}"))
        assert isinstance(got, CachedTokens)
        got.block_keys(16, 1, (None, f"salt-{i}"))
        assert cache.held_tokens <= 2000 and cache._keys_held <= 500 and cache._notes_held <= 2000 // 16 + 40
    assert cache.stats.reused_tokens == 0
