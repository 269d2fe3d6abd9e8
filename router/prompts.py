"""The token ids of a request's prompt, tokenized the way the pods tokenize it.

Token-id prompts are used as they are. Text prompts go through the configured local tokenizer with
the request's ``add_special_tokens`` (default true, as vLLM's completions); chat requests are
rendered as vLLM 0.32 renders them (``indexer.tokens.chat_request_ids``: tools, documents,
chat_template_kwargs, continue_final_message, add_special_tokens default false), so the router's
block keys match what the pods cache. A request carrying its own chat template is a 400 here, as
in vLLM without ``--trust-request-chat-template`` (the router will not run a client's template);
with ``tokenizer: remote`` the pod decides. The pods' chat-rendering serve flags that no request
shows (``--chat-template``, ``--chat-template-content-format``, ``--default-chat-template-kwargs``,
``--exclude-tools-when-tool-choice-none``) are mirrored by the router's settings of the same names
(``serve_chat_flags``). For a batch of prompts the first one routes the request.

A request's ``truncate_prompt_tokens`` cuts its tokens as vLLM cuts them (``truncate``). A chat
request with image, audio, video or embeddings parts is rendered by vLLM with the model's media
tokens, and its blocks keyed with the media's hashes: the router cannot reproduce that, so it routes
such a request on an estimate of its length (its text alone) with no block keys (``Unkeyed``): no
prefix is looked up or credited, and the pod answers it (or, a text-only model, refuses it).

A request with a ``cache_salt`` (an API key's derived salt, or a client's own) is tokenized through
the prefix token cache with its chunk-key chains seeded by that salt (``salt_seed``): its chunks are
found only by requests of the same salt, so another tenant cannot time the router's tokenizing to
learn whether its text was seen (docs/reliability.md). A request without one costs a None check.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from indexer.keys import block_keys
from indexer.prefix_tokens import CachedTokens, NotCached, salt_seed
from indexer.tokens import (
    ChatRequest,
    ChatTemplateError,
    MediaContent,
    ServeChatFlags,
    Tokenizer,
    chat_text,
    completion_add_special_tokens,
    load_chat_template,
    routing_encoder,
    without_media,
)
from router.errors import APIError


class Unkeyed(list[int]):
    """Token ids that stand in for a prompt's length only (a rendering the router cannot reproduce):
    ``prompt_block_keys`` gives them no keys, so nothing is looked up or credited."""


def serve_chat_flags(settings: Any) -> ServeChatFlags | None:
    """The pods' chat-rendering serve flags from the router's settings (``default_chat_template_kwargs``,
    ``exclude_tools_when_tool_choice_none``, ``chat_template``: read here, as vLLM reads the flag,
    ``chat_template_content_format``), or None when all are unset: then nothing changes. A
    ``chat_template`` that cannot be read or compiled raises ``ChatTemplateError``."""
    defaults = settings.default_chat_template_kwargs or None
    template = load_chat_template(settings.chat_template) if settings.chat_template is not None else None
    content_format = settings.chat_template_content_format
    if defaults is None and not settings.exclude_tools_when_tool_choice_none and template is None \
            and content_format == "auto":
        return None
    return ServeChatFlags(defaults, settings.exclude_tools_when_tool_choice_none, template, content_format)


def is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def completion_prompt(body: dict[str, Any]) -> list[int] | str:
    """The prompt that routes a completion: its token ids, or the text to tokenize (for a batch of
    prompts, the first one). Raises a 400 for anything else."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if is_token_list(prompt):
            return prompt
        first = prompt[0]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return first
        if is_token_list(first) and all(is_token_list(p) for p in prompt):
            return first
    if prompt is None:
        if body.get("prompt_embeds") is not None:  # vLLM's --enable-prompt-embeds: nothing the router can key
            return Unkeyed()
        raise APIError(400, "'prompt' is required", param="prompt")
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                   "token-id lists, and not empty", param="prompt")


def chat_messages(body: dict[str, Any]) -> list[Any]:
    """The chat messages of a request; a 400 unless they are a non-empty list."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    return messages


def check_chat(body: dict[str, Any]) -> ChatRequest:
    """The chat fields of a request checked as vLLM checks them (a 400 otherwise), for
    ``tokenizer: remote``: a request's own chat template is left to the pod to accept or refuse."""
    chat_messages(body)
    try:
        return ChatRequest.from_body(body, trust_request_template=True)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def add_special_tokens(body: dict[str, Any]) -> bool:
    """A completion's ``add_special_tokens`` (default true); a 400 unless a boolean."""
    try:
        return completion_add_special_tokens(body)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def request_seed(salt: Any) -> int:
    """The prefix token cache's chain seed for a request whose ``cache_salt`` is ``salt``, not None
    (``indexer.prefix_tokens.salt_seed``; 0 for a salt that is not a string, which ``cache_salt``
    refuses with a 400 anyway)."""
    return salt_seed(salt) if isinstance(salt, str) else 0


def salted_encoder(tokenizer: Tokenizer, max_new_chars: int | None, seed: int) -> Callable[[str, bool], Sequence[int]]:
    """``indexer.tokens.routing_encoder`` for a salted request: the prefix token cache's chains start
    from ``seed`` (a tokenizer without the cache keeps nothing to find: its own encoder)."""
    cache = getattr(tokenizer, "prefix_cache", None)
    if cache is None:
        return routing_encoder(tokenizer, max_new_chars)

    def encode(text: str, add_special_tokens: bool) -> Sequence[int]:
        return cache.encode_cached(text, add_special_tokens, max_new_chars, seed)

    return encode


def text_encoder(tokenizer: Tokenizer, body: Mapping[str, Any]) -> Callable[[str], list[int]]:
    """``tokenizer.encode`` for the other prompts of a completion batch (``router.costs.batch_rest_tokens``),
    seeded as the first prompt is when the request is salted: through the prefix token cache, they
    would otherwise leave a salted tenant's text where any request finds it."""
    salt = body.get("cache_salt")
    if salt is None:
        return tokenizer.encode
    cache = getattr(tokenizer, "prefix_cache", None)
    if cache is None:
        return tokenizer.encode
    seed = request_seed(salt)
    return lambda text: cache.encode(text, True, seed)


def completion_tokens(body: dict[str, Any], tokenizer: Tokenizer, max_new_chars: int | None = None,
                      seed: int = 0) -> Sequence[int]:
    """``seed``: ``request_seed`` of the request's salt (0: none)."""
    prompt = completion_prompt(body)
    if isinstance(prompt, str):
        if max_new_chars is not None and isinstance(body.get("prompt"), list):
            raise NotCached  # a batch of texts: the others are tokenized whole (router/costs.py)
        encode = routing_encoder(tokenizer, max_new_chars) if not seed else salted_encoder(tokenizer, max_new_chars,
                                                                                          seed)
        return encode(prompt, add_special_tokens(body))
    return prompt


def chat_tokens(body: dict[str, Any], tokenizer: Tokenizer, max_new_chars: int | None = None,
                flags: ServeChatFlags | None = None, seed: int = 0) -> Sequence[int]:
    """``seed``: ``request_seed`` of the request's salt (0: none)."""
    chat_messages(body)
    try:
        text, special = chat_text(body, tokenizer, flags=flags)
    except MediaContent:
        return media_chat_estimate(body, tokenizer, max_new_chars, flags, seed)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    encode = routing_encoder(tokenizer, max_new_chars) if not seed else salted_encoder(tokenizer, max_new_chars, seed)
    return encode(text, special)


def media_chat_estimate(body: dict[str, Any], tokenizer: Tokenizer, max_new_chars: int | None,
                        flags: ServeChatFlags | None = None, seed: int = 0) -> Unkeyed:
    """A chat request with media parts: its tokens without the media (an estimate of its length),
    unkeyed. A request the router would refuse without its media is still a 400."""
    try:
        text, special = chat_text({**body, "messages": without_media(body["messages"])}, tokenizer, flags=flags)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    encode = routing_encoder(tokenizer, max_new_chars) if not seed else salted_encoder(tokenizer, max_new_chars, seed)
    return Unkeyed(encode(text, special))


def truncation(body: dict[str, Any]) -> tuple[int, str | None] | None:
    """The request's ``truncate_prompt_tokens`` (a count of at least 0) and ``truncation_side``
    ("left", "right" or None: the tokenizer's own), or None. -1 (the model's context length, which
    the router does not know) and values vLLM refuses are left to the pod: the prompt keyed whole."""
    n = body.get("truncate_prompt_tokens")
    if type(n) is not int or n < 0:
        return None
    side = body.get("truncation_side")
    return n, side if side in ("left", "right") else None


def truncate(tokens: Sequence[int], n: int, side: str | None, plain: Sequence[int] | None = None) -> Sequence[int]:
    """``tokens`` cut to ``n`` as vLLM 0.32 cuts them (renderers/params.py ``TokenizeParams``).
    With ``truncation_side`` the whole tokenization is sliced: "right" keeps the first ``n``,
    "left" the last ``n``. Without it the tokenizer truncates while it encodes, from the left (vLLM
    makes a generating model's tokenizer truncate left: tokenizers/registry.py), and keeps the
    special tokens it adds (BOS): the last ``n - specials`` tokens of the text between them.
    ``plain``: the same text's tokens without special tokens, where ``tokens`` has them added (None:
    none added, as for a chat prompt by default or a token-id prompt)."""
    if len(tokens) <= n:
        return tokens
    if side == "right":
        return list(tokens[:n])
    if side == "left" or plain is None or len(plain) >= len(tokens):
        return list(tokens[len(tokens) - n:])
    ids, body = list(tokens), list(plain)
    added = len(ids) - len(body)
    lead = next((p for p in range(added + 1) if ids[p:p + len(body)] == body), 0)
    keep = max(0, n - added)
    cut = ids[:lead] + (body[len(body) - keep:] if keep else []) + ids[lead + len(body):]
    return cut[len(cut) - n:] if len(cut) > n else cut  # then sliced as above (fewer than its specials)


def _truncated(kind: str, body: dict[str, Any], tokenizer: Tokenizer, tokens: Sequence[int], n: int,
               side: str | None, max_new_chars: int | None, flags: ServeChatFlags | None = None) -> Sequence[int]:
    if len(tokens) <= n or isinstance(tokens, Unkeyed):
        return tokens
    plain = None
    if side is None and (add_special_tokens(body) if kind == "completion" else body.get("add_special_tokens") is True) \
            and (kind == "chat" or isinstance(completion_prompt(body), str)):
        plain = prompt_tokens(kind, {**body, "add_special_tokens": False, "truncate_prompt_tokens": None},
                              tokenizer, max_new_chars, flags)
    return truncate(tokens, n, side, plain)


def prompt_tokens(kind: str, body: dict[str, Any], tokenizer: Tokenizer,
                  max_new_chars: int | None = None, flags: ServeChatFlags | None = None) -> Sequence[int]:
    """``kind`` is "chat" or "completion". With a prefix token cache the answer may be a
    ``CachedTokens`` (``indexer/prefix_tokens.py``): a sequence whose block keys come cheap. With
    ``max_new_chars``, ``NotCached`` is raised rather than tokenize more than that many characters
    past the cached prefix (or any batch of prompts). An ``Unkeyed`` answer only estimates the
    prompt's length (``chat_tokens``); ``truncate_prompt_tokens`` is applied (``truncate``).
    ``flags``: the pods' chat-rendering serve flags (``serve_chat_flags``; None: unset). A request's
    ``cache_salt`` seeds its chunks in the prefix token cache (``request_seed``)."""
    salt = body.get("cache_salt")
    seed = 0 if salt is None else request_seed(salt)
    if kind == "chat":
        tokens = chat_tokens(body, tokenizer, max_new_chars, flags, seed)
    else:
        tokens = completion_tokens(body, tokenizer, max_new_chars, seed)
    if body.get("truncate_prompt_tokens") is not None:
        cut = truncation(body)
        if cut is not None:
            tokens = _truncated(kind, body, tokenizer, tokens, *cut, max_new_chars, flags)
    return tokens


def prompt_block_keys(tokens: Sequence[int], block_size: int, seed: int, adapter: str | None,
                      salt: str | None) -> list[int]:
    """The prompt's block keys, with the extra keys vLLM hashes into each block and announces in its
    BlockStored ``extra_keys``: a LoRA adapter's name in every block (the chain's ``seed`` names it
    too, as the index keys the events' ``lora_name``), a ``cache_salt`` in the first block after it;
    so a prompt meets only blocks of the same adapter and salt. Tokens from the prefix token cache
    (``CachedTokens``) key only what their remembered prefix does not cover."""

    def extra_for(blocks: int, first: int) -> list[Any] | None:  # blocks first .. first + blocks - 1
        if adapter is not None:
            extra: list[Any] = [[adapter]] * blocks
            if salt is not None and first == 0 and extra:
                extra[0] = [adapter, salt]
            return extra
        return [[salt]] if salt is not None and first == 0 else None

    if isinstance(tokens, CachedTokens):
        return tokens.block_keys(block_size, seed, (adapter, salt), extra_for)
    if isinstance(tokens, Unkeyed):
        return []
    return block_keys(tokens, block_size, seed, extra_for(len(tokens) // block_size, 0))


T = TypeVar("T")


class TokenizePool:
    """Tokenizing big prompts off the event loop in a few threads, at most ``threads x 8`` jobs
    admitted at once (the rest wait their turn). The tokenizers library releases the GIL while it
    encodes, but the Python around it does not, so small requests still wait on it: the tokenize
    process (``router/tokenize_proc.py``) does this work when it can, and these threads when it
    cannot (starting, restarting, or ``tokenize_process`` off)."""

    def __init__(self, threads: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvroute-tokenize")
        self._slots = asyncio.Semaphore(threads * 8)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        async with self._slots:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def usable_cpus(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
    CPU limit, ``cpu_max``: "QUOTA PERIOD" or "max PERIOD") where one is set."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


class LoopLoad:
    """Whether the event loop is crowded: another request is being handled, and the loop's thread
    was busy for at least ``busy_share`` of the last ``window_s`` seconds (its CPU time over the
    wall time, measured at most once a window, when asked). Never with ``spare_core`` false.

    What it decides (``router/api.py``, ``prompt_ids``): a prompt tokenized on a crowded loop makes
    every other request wait for it while the tokenize process's core idles, so it goes to that
    process instead; on a quiet loop it is tokenized on the spot, where it pays no round trip. Both
    halves matter: one client sending back to back keeps the loop as busy as many do, but nothing
    waits behind its requests; many clients with answers streaming from slow pods keep many
    requests in flight on a loop with time to spare. And the tokenize process needs a core of its
    own to take the work: with as many router workers as CPUs (``usable_cpus() < 2 * workers``)
    each worker and its tokenize process share one, and sending it prompts only adds the round trips.
    """

    def __init__(self, busy_share: float = 0.5, spare_core: bool = True, window_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.thread_time):
        self.busy_share = busy_share
        self.spare_core = spare_core
        self.window_s = window_s
        self.active = 0  # requests being handled now (router/api.py counts them in and out)
        self.share = 0.0  # the loop thread's share of one core over the last whole window
        self._clock, self._cpu = clock, cpu
        self._since, self._cpu_since = clock(), cpu()

    def crowded(self) -> bool:
        if self.active < 2 or not self.spare_core:
            return False
        now = self._clock()
        if now - self._since >= self.window_s:
            spent = self._cpu()
            self.share = (spent - self._cpu_since) / (now - self._since)
            self._since, self._cpu_since = now, spent
        return self.share >= self.busy_share
