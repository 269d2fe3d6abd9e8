"""tiktoken's twin of a byte-level BPE tokenizer (indexer/fast_bpe.py) gives the tokenizers library's
ids, is refused where it could not, and is dropped at run time on the first difference."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.fast_bpe import MORE_PROBE, twin
from indexer.prefix_tokens import PROBE, CachedTokens, PrefixTokenCache
from tests.test_prefix_tokens import LLAMA3, TOKENIZERS, WORDS, byte_bpe

BYTE_LEVEL = {k: v for k, v in TOKENIZERS.items() if "byte-level" in k}

PIECES = WORDS.split() + ["<s>", "</s>", "<s></s>", "\n\n", "   ", "\r\n", "'s", "'LL"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(min_size=1, max_size=12)), min_size=0, max_size=80) \
    .map(lambda parts: "".join(p + (" " if i % 3 else "") for i, p in enumerate(parts)))


@pytest.mark.parametrize("name", list(BYTE_LEVEL))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_the_twin_gives_the_tokenizers_ids(name, text):
    """Any text (words, special tokens written out, whitespace runs, any unicode): the same ids."""
    hf = BYTE_LEVEL[name]
    encode, why = _twins[name]
    assert encode is not None, why
    assert encode(text) == hf.encode(text, add_special_tokens=False).ids


_twins = {name: twin(hf) for name, hf in BYTE_LEVEL.items()}


def test_the_probes_reach_what_a_twin_could_get_wrong():
    """The start-up check's texts hold special tokens, every script the tokenizers' regexes treat
    apart, contractions, digits and every kind of whitespace run."""
    for needed in ("'s", "'re", "\r\n", "\t", "  ", "\n\n", "東", "Привет", "🙂", "3.14159", "0x1F"):
        assert needed in PROBE + MORE_PROBE, needed


def _bpe(vocab_extra: list[str], merges: list[tuple[str, str]], added: list[str] | None = None):
    """A byte-level BPE from an explicit vocabulary: the 256 byte symbols, then ``vocab_extra``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for t in vocab_extra:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if added:
        tok.add_special_tokens([AddedToken(a, special=True) for a in added])
    return tok


def test_a_vocabulary_tiktoken_would_merge_another_way_gets_no_twin():
    """Merges b+c, then a+b, then ab+c: the tokenizers library makes "abc" into a, bc (no rule joins
    a and bc), where tiktoken joins any two pieces whose bytes are a token and makes abc. The start-up
    check tokenizes every entry's own text, so it finds this and makes no twin."""
    hf = _bpe(["bc", "ab", "abc"], [("b", "c"), ("a", "b"), ("ab", "c")])
    assert [hf.id_to_token(i) for i in hf.encode("abc").ids] == ["a", "bc"]
    encode, why = twin(hf)
    assert encode is None and "otherwise" in why
    # a consistent one of the same size does get a twin, and agrees
    ok = _bpe(["ab", "abc"], [("a", "b"), ("ab", "c")], added=["<|x|>"])
    encode, why = twin(ok)
    assert encode is not None, why
    for text in ("abc abcabc cab", "ab<|x|>c", "<|x|><|x|>", ""):
        assert encode(text) == ok.encode(text, add_special_tokens=False).ids


def test_what_the_twin_cannot_stand_in_for_is_refused_with_the_reason():
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    assert twin(TOKENIZERS["WordPiece"]) == (None, "its model is WordPiece, not BPE")
    assert twin(TOKENIZERS["Unigram (Metaspace)"]) == (None, "its model is Unigram, not BPE")
    prefix = byte_bpe()
    prefix.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert twin(prefix)[1] == "its ByteLevel pre-tokenizer adds a prefix space"
    normal = byte_bpe(LLAMA3)
    normal.normalizer = normalizers.NFC()
    assert twin(normal)[1] == "it has a normalizer"
    strip = byte_bpe()
    strip.add_special_tokens([AddedToken("<pad>", lstrip=True, special=True)])
    assert "strips spaces" in twin(strip)[1]
    nested = byte_bpe()
    nested.add_special_tokens(["<|a|>", "<|a|>b"])
    assert twin(nested)[1] == "its added token '<|a|>' is a prefix of '<|a|>b'"
    backwards = _bpe(["bc", "ab"], [("a", "b"), ("b", "c")])  # ab's merge first, but ab has the larger id
    assert twin(backwards)[1] == "its merges' results do not rise in id with the merges' order"


@pytest.mark.parametrize("long", [False, True])
def test_a_difference_found_at_run_time_drops_the_twin_and_keeps_the_cache(long):
    """A twin that passed its start-up check but parts from the tokenizer later (here: made to lose a
    text's last token) is found by the sampled checks, dropped, and the cache goes on with the
    tokenizers library's own ids; a short text and a cached long one alike."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=16, min_chars=64, verify_every=1, verify_share=None)
    assert cache.twin
    right = cache._twin
    cache._twin = lambda text: right(text)[:-1] if "fox" in text else right(text)
    base = "the quick brown dog jumps over the lazy cat " * 4
    first = cache.encode_cached(base if long else "hello")
    cache.wait_checked()
    assert cache.twin and cache.stats.mismatches == 0  # no fox: nothing differs
    text = base + "and the fox too " + "more words after it " * 3 if long else "the fox"
    got = cache.encode_cached(text)
    assert isinstance(got, CachedTokens) == long and isinstance(first, CachedTokens) == long
    cache.wait_checked()
    assert not cache.twin and "differ" in cache.twin_reason and cache.stats.mismatches == 1
    assert not cache.disabled  # the cache itself was right
    assert cache.held_tokens == 0  # the chunks the twin tokenized (a wrong one among them) are gone
    for again in (text, text + " and on"):
        assert cache.encode(again) == hf.encode(again).ids


def test_a_short_texts_check_runs_on_the_callers_thread_and_a_long_ones_in_the_check_thread():
    """A short text (skipping the cache) is checked on the spot, so no GIL handoff to the check
    thread stalls the event loop for it; a cached long text's check still goes to that thread."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    cache = PrefixTokenCache(hf, chunk_chars=16, min_chars=64, verify_every=1, verify_share=None)
    assert cache.twin
    cache.encode_cached("warm")  # learns the special tokens around a text, through the reference
    reference, threads = cache._reference, []

    def watched(text, add_special_tokens=True):
        threads.append(threading.get_ident())
        return reference(text, add_special_tokens)

    cache._reference = watched
    assert cache.encode_cached("hello there") == hf.encode("hello there").ids
    assert threads == [threading.get_ident()] and cache.stats.verified == 2  # done before the call returned
    long = "the quick brown dog jumps over the lazy cat " * 4
    cache.encode_cached(long)
    cache.encode_cached(long + "and again")  # a hit: checked
    cache.wait_checked()
    assert cache.stats.verified == 3 and len(threads) == 2 and threads[1] != threading.get_ident()
    assert cache.stats.mismatches == 0


def test_the_twin_can_be_turned_off():
    """``tokenize_tiktoken: false`` (the router's setting) keeps the tokenizers library."""
    hf = TOKENIZERS["byte-level BPE (GPT-2)"]
    off = PrefixTokenCache(hf, tiktoken=False)
    assert not off.twin and off.twin_reason == "turned off (tokenize_tiktoken)"
    assert off.encode("hello world") == hf.encode("hello world").ids
