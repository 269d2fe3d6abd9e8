"""One request inside a simulated engine: its tokens, blocks, progress and where its output goes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from simulator.hashing import BlockHasher, external

FINISH = object()  # queue item that ends a request's output; the reason is on the request


class SimRequest:
    """Progress follows vLLM's model: ``num_computed`` of ``len(all_tokens)`` tokens have KV; when
    all have, the engine samples the next token and appends it (so decode and prefill are the same
    step, and a preempted request simply recomputes)."""

    __slots__ = ("request_id", "prompt", "n_prompt", "all_tokens", "max_tokens", "length_capped",
                 "num_computed", "block_ids", "num_cached_blocks", "digests", "hashes", "hasher",
                 "cached_tokens", "remote_tokens", "arrival", "scheduled_at", "first_token_at",
                 "last_token_at", "finished_at", "finish_reason", "aborted", "queue", "keep_blocks",
                 "num_output", "admitted", "prefill_compute_s", "salt", "lora", "reads_cache")

    def __init__(self, request_id: str, prompt: Sequence[int], max_tokens: int, length_capped: bool,
                 block_size: int, hasher: BlockHasher, arrival: float, salt: str | None = None,
                 lora: tuple[int, str, str] | None = None):
        self.request_id = request_id
        self.prompt = list(prompt)
        self.n_prompt = len(self.prompt)
        self.all_tokens = list(self.prompt)
        self.max_tokens = max_tokens
        self.length_capped = length_capped  # True: finish 'length' at max_tokens; else 'stop'
        self.num_computed = 0
        self.num_output = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0
        self.salt = salt   # cache_salt: an extra key of the first block, so a chain of its own
        self.lora = lora   # (adapter id, name, path): an extra key of every block
        self.hasher = hasher
        self.digests = hasher.chain(None, self.prompt, block_size, first_keys=self._salt_keys(),
                                    every_keys=self._lora_keys())
        self.hashes = [external(d) for d in self.digests]
        self.cached_tokens = 0
        self.remote_tokens = 0  # tokens whose KV came from a remote prefill (NIXL decode leg)
        self.arrival = arrival
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.aborted = False
        self.admitted = False
        self.keep_blocks = False  # NIXL prefill leg: blocks stay leased after the finish
        self.prefill_compute_s = 0.0
        # False for a request that asks for prompt logprobs: vLLM reads no cached or transferred KV
        # for it (its sampling params' skip_reading_prefix_cache) and computes the whole prompt
        self.reads_cache = True
        self.queue: asyncio.Queue = asyncio.Queue()

    def extend_hashes(self, full_blocks: int, block_size: int) -> None:
        """Make sure hashes exist for the first ``full_blocks`` blocks of ``all_tokens`` (output blocks)."""
        have = len(self.digests)
        if full_blocks <= have:
            return
        parent = self.digests[-1] if self.digests else None
        new = self.hasher.chain(parent, self.all_tokens[have * block_size:full_blocks * block_size], block_size,
                                first_keys=None if have else self._salt_keys(), every_keys=self._lora_keys())
        self.digests.extend(new)
        self.hashes.extend(external(d) for d in new)

    def _salt_keys(self) -> tuple | None:
        return None if self.salt is None else (("cache_salt", self.salt),)

    def _lora_keys(self) -> tuple | None:
        return None if self.lora is None else (("lora", self.lora[1], self.lora[2]),)

    def emit(self, token_id: int, now: float) -> None:
        self.all_tokens.append(token_id)
        self.num_output += 1
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.queue.put_nowait(token_id)

    @property
    def done_generating(self) -> bool:
        return self.num_output >= self.max_tokens

    def finish(self, reason: str, now: float) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.finished_at = now
        self.queue.put_nowait(FINISH)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival
