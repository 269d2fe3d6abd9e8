"""A faster twin of a byte-level BPE tokenizer, for routing: tiktoken's BPE on the same vocabulary.

Routing needs a prompt's tokens only to count them and to hash its blocks as vLLM does; the pod
tokenizes the prompt itself. So the router may tokenize with any code that gives the same ids.
For byte-level BPE (GPT-2's family, Llama 3, Qwen 2, the real-vLLM tier's tiny model) tiktoken
gives them at a third of the cost of the ``tokenizers`` library: ~420 new tokens of an 8k-token
chat follow-up in 206 against 583 µs, and a 17-token prompt in a fraction of the library's
per-call overhead (``bench/prompt_stages.py``; docs/router.md, "tiktoken's BPE").

**When it is the same tokenizer.** ``twin(hf)`` builds one only for the shapes it can map one to one
and answers why not otherwise (``None, reason``):

- the model is BPE with no dropout, unknown token, subword prefix or word suffix, and no byte
  fallback; there is no normalizer;
- the pre-tokenizer is ``ByteLevel`` with its own regex (GPT-2's, written out below) or a ``Split`` by a
  regex, isolated, followed by ``ByteLevel`` without one (Llama 3's shape); no prefix space is added;
- every vocabulary entry decodes to distinct bytes, all 256 single bytes are tokens, and the merges'
  results have ids that rise with the merges' order. tiktoken merges the pair whose joined bytes have
  the lowest rank, so with the ids as ranks it applies the merges in the tokenizer's own order;
- added tokens match as written (no ``lstrip``, ``rstrip`` or ``single_word``) and none is a prefix of
  another (``tokenizers`` takes the longest match, tiktoken the first alternative).

BPE by merge rules and BPE by ranks can still differ: tiktoken joins any two adjacent pieces whose
bytes form a token, even where no merge rule joins those two, and it takes a whole piece that is a
token without merging. So the twin is also checked by running it: every vocabulary entry's own
text and a probe text must tokenize as ``tokenizers`` does, or no twin is made; and at run time
``PrefixTokenCache`` tokenizes one text in ``verify_every`` again with ``tokenizers`` in the
background and drops the twin on the first difference (``indexer/prefix_tokens.py``).

tiktoken's encode lets go of the GIL while Rust works, as ``encode_batch_fast`` does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from indexer.prefix_tokens import PROBE, batch_encoder

# the regex of tokenizers' ByteLevel pre-tokenizer when ``use_regex`` is on (GPT-2's)
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# more text for the run-time probe: code, numbers and other scripts
MORE_PROBE = ("def f(x):\n    return x**2 + 1  # ok\n\n\nclass A:\n\tpass\r\n"
              "Ünïcödé ÀÉÎ ñ ß Ω π λ Привет мир 你好，世界 こんにちは 안녕하세요 مرحبا שלום 🙂🚀 "
              "1234567890 3.14159 -42 +7 1e-9 0x1F #%&*@!?;:,./\\|<>=~`^ ''' \"\" ''s 't 're\n")


def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's map from bytes to printable characters (GPT-2's)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _pattern(pre: Any) -> tuple[str | None, str]:
    """The split regex of a pre-tokenizer tiktoken can stand in for, or (None, why not)."""
    if not isinstance(pre, dict):
        return None, "no pre-tokenizer"
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("add_prefix_space"):
            return None, "its ByteLevel pre-tokenizer adds a prefix space"
        if not pre.get("use_regex", True):
            return None, "its ByteLevel pre-tokenizer splits nothing"
        return BYTE_LEVEL_PATTERN, ""
    if kind == "Sequence" and len(pre.get("pretokenizers") or []) == 2:
        split, level = pre["pretokenizers"]
        if (split.get("type") == "Split" and isinstance(split.get("pattern"), dict)
                and "Regex" in split["pattern"] and split.get("behavior") == "Isolated"
                and not split.get("invert") and level.get("type") == "ByteLevel"
                and not level.get("add_prefix_space") and not level.get("use_regex", True)):
            return str(split["pattern"]["Regex"]), ""
    return None, f"its pre-tokenizer ({kind}) is not byte-level BPE's"


def twin(hf: Any) -> tuple[Callable[[str], list[int]] | None, str]:
    """``(encode, "")`` where ``encode(text)`` gives what ``hf.encode(text, add_special_tokens=False)``
    gives, through tiktoken; or ``(None, why not)``."""
    try:
        import tiktoken
    except ImportError:  # pragma: no cover - a dependency of the project
        return None, "tiktoken is not installed"
    spec = json.loads(hf.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"its model is {model.get('type')}, not BPE"
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return None, f"its BPE model sets {key}"
    if model.get("byte_fallback"):
        return None, "its BPE model falls back to bytes"
    if spec.get("normalizer"):
        return None, "it has a normalizer"
    pattern, why = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, why
    added = spec.get("added_tokens") or []
    for t in added:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return None, f"its added token {t['content']!r} strips spaces or matches whole words only"
    contents = sorted(t["content"] for t in added)
    for a, b in zip(contents, contents[1:]):
        if b.startswith(a):
            return None, f"its added token {a!r} is a prefix of {b!r}"
    special = {t["content"]: int(t["id"]) for t in added}
    added_ids = set(special.values())
    decode = _byte_decoder()
    ranks: dict[bytes, int] = {}
    for token, i in model.get("vocab", {}).items():
        if i in added_ids:
            continue
        try:
            raw = bytes(decode[ch] for ch in token)
        except KeyError:
            return None, f"its token {token!r} is not byte-level"
        if raw in ranks:
            return None, f"two of its tokens are the same bytes ({raw!r})"
        ranks[raw] = int(i)
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "not every byte is a token"
    last = -1
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = model["vocab"].get(a + b)
        if i is None or i in added_ids or i <= last:
            return None, "its merges' results do not rise in id with the merges' order"
        last = i
    try:
        enc = tiktoken.Encoding("kvroute-twin", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    except Exception as exc:  # a regex tiktoken's engine does not take
        return None, f"tiktoken cannot take it ({type(exc).__name__}: {exc})"
    allowed = frozenset(special)
    core, ordinary = enc.encode, enc.encode_ordinary
    # a text without any special token's string gives the same ids either way; ``encode`` hands its
    # set of allowed specials to tiktoken's Rust core on every call (3.4 µs a call here, so the 100
    # chunks of a cold 6k-token chat prompt took 1.36 ms against 1.02 ms whole): a regex search of
    # the text (0.15 µs for 256 characters, with 3 or 256 specials) spares most calls that
    find_special = re.compile("|".join(map(re.escape, contents))).search if contents else None

    def encode(text: str) -> list[int]:
        if find_special is None or find_special(text) is None:
            return ordinary(text)
        return core(text, allowed_special=allowed, disallowed_special=())

    # every entry's own text (where rank and merge order part, a whole word is where it shows) and
    # the probes, through both
    texts = [t for t in hf.decode_batch([[i] for i in sorted(ranks.values())], skip_special_tokens=False)
             if "\ufffd" not in t]
    texts += [PROBE, MORE_PROBE, PROBE + MORE_PROBE + "".join(contents)]
    want = batch_encoder(hf)(texts, add_special_tokens=False)
    for text, w in zip(texts, want, strict=True):
        if encode(text) != w.ids:
            return None, f"tiktoken tokenizes {text[:40]!r} otherwise"
    return encode, ""
