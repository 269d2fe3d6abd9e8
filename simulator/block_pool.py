"""The prefix cache of one pod: a pool of KV blocks with chained hashes, ref counts and LRU eviction.

It follows vLLM's block pool: a block is named by a hash chained over its parent's hash and its
tokens (computed as vLLM computes it: ``simulator.hashing``; the pool sees the 64-bit form events
carry).
Blocks in use have a positive ref count; a freed block goes to the tail of the free queue and
keeps its hash, so it can still be hit until it is reallocated; a freed block without a hash goes
to the head, to be reused first. Allocation takes the head of the queue (least recently freed) and
evicts its hash. Every change that vLLM would publish is handed
to ``on_event`` as ``("stored", hashes, parent, token_ids)``, ``("removed", [hash])`` or
``("cleared",)``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, on_event: Callable[[tuple], None] | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}           # hash -> the block a lookup returns
        self.copies: dict[int, list[int]] = {}     # hash -> further blocks holding it (duplicates)
        self.on_event = on_event or (lambda event: None)

    # --- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Fraction of blocks in use (cached but unreferenced blocks count as free, as in vLLM)."""
        return 1.0 - len(self.free) / self.num_blocks

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the leading ``hashes`` that are cached (stops at the first miss)."""
        found = []
        cached = self.cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def free_after_touch(self, block_ids: Sequence[int]) -> int:
        """How many blocks stay allocatable once ``block_ids`` are referenced."""
        return len(self.free) - sum(1 for b in block_ids if self.ref[b] == 0)

    def copy(self) -> BlockPool:
        """A copy of the pool that announces nothing, for playing ahead: changes to it leave this one
        as it is, but this one must not change while the copy is in use (its free queue is read
        through from this one's: ``_FreeQueueCopy``)."""
        out = BlockPool.__new__(BlockPool)
        out.num_blocks, out.block_size = self.num_blocks, self.block_size
        out.ref, out.block_hash = list(self.ref), list(self.block_hash)
        out.free, out.cached = _FreeQueueCopy(self.free), dict(self.cached)  # type: ignore[assignment]
        out.copies = {h: list(bs) for h, bs in self.copies.items()}
        out.on_event = lambda event: None
        return out

    # --- changes ---------------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Reference cached blocks (a prefix hit): they leave the free queue while in use."""
        for b in block_ids:
            if self.ref[b] == 0:
                self.free.pop(b, None)
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks from the head of the free queue, evicting their hashes; None if short."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                self._evict(h, b)
            self.ref[b] = 1
            out.append(b)
        return out

    def _evict(self, h: int, b: int) -> None:
        """Block ``b`` loses hash ``h``: one BlockRemoved per copy, as vLLM's eviction sends."""
        extra = self.copies.get(h)
        if self.cached.get(h) == b:
            if extra:
                self.cached[h] = extra.pop(0)
            else:
                del self.cached[h]
        elif extra and b in extra:
            extra.remove(b)
        else:
            return
        if extra is not None and not extra:
            del self.copies[h]
        self.on_event(("removed", [h]))

    def cache(self, block_ids: Sequence[int], hashes: Sequence[int], parent: int | None,
              token_ids: Sequence[int], salt: str | None = None, lora: tuple[int, str, str] | None = None) -> None:
        """Name newly full blocks by their hashes and announce them (one BlockStored for the run).

        A hash already cached in another block (its prompt was computed twice at once) makes this
        block a further copy, announced like any other, as vLLM announces it. With ``salt`` (the
        request's cache_salt) a run that starts at the first block announces it in that block's
        extra keys (``("stored", ..., extra_keys, lora)``), as vLLM does; with ``lora`` (adapter id,
        name, path) every block's extra keys carry the adapter's name and the event its id and name.
        """
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        bs = self.block_size
        run_parent = parent
        for i, (b, h) in enumerate(zip(block_ids, hashes)):
            if self.block_hash[b] is not None:   # already named (a prefix hit): not new
                if new_hashes:
                    self.on_event(self._stored(new_hashes, run_parent, new_tokens, salt, lora))
                    new_hashes, new_tokens = [], []
                run_parent = h
                continue
            self.block_hash[b] = h
            if h in self.cached:
                self.copies.setdefault(h, []).append(b)
            else:
                self.cached[h] = b
            new_hashes.append(h)
            new_tokens.extend(token_ids[i * bs:(i + 1) * bs])
        if new_hashes:
            self.on_event(self._stored(new_hashes, run_parent, new_tokens, salt, lora))

    @staticmethod
    def _stored(hashes: list[int], parent: int | None, token_ids: list[int], salt: str | None,
                lora: tuple[int, str, str] | None = None) -> tuple:
        """The event tuple; extra keys untagged, as vLLM publishes them: the adapter's name on every
        block, the salt after it on a prompt's first block (a run without a parent starts the prompt)."""
        salted = salt is not None and parent is None
        if lora is None and not salted:
            return ("stored", hashes, parent, token_ids)
        every = [lora[1]] if lora is not None else None
        extra: list = [every] * len(hashes)
        if salted:
            extra[0] = (every or []) + [salt]
        return ("stored", hashes, parent, token_ids, extra, lora)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference. As vLLM's ``free_blocks``: unreferenced blocks with a hash join the free
        queue's tail, last block first (a sequence's tail is evicted before its head); blocks without
        one (a partial last block) go to its head, in that order, to be reused first and spare the
        cached ones."""
        first: list[int] = []
        for b in reversed(block_ids):
            r = self.ref[b] - 1
            self.ref[b] = r
            if r == 0:
                if self.block_hash[b] is None:
                    first.append(b)
                else:
                    self.free[b] = None
            elif r < 0:  # defensive: never go negative
                self.ref[b] = 0
        for b in reversed(first):
            self.free[b] = None
            self.free.move_to_end(b, last=False)

    def reset(self) -> None:
        """Forget every cached hash (vLLM's reset_prefix_cache) and announce AllBlocksCleared."""
        self.cached.clear()
        self.copies.clear()
        self.block_hash = [None] * self.num_blocks
        self.on_event(("cleared",))

    def forget(self) -> None:
        """Lose the cache silently, as a restarted engine does (no event: a new process knows nothing)."""
        self.cached.clear()
        self.copies.clear()
        self.block_hash = [None] * self.num_blocks


class _FreeQueueCopy:
    """A copied pool's free queue: the original's, read in order as far as the copy takes from its
    head, with the copy's own changes beside it (copying an ``OrderedDict`` of thousands of blocks
    took most of a forward run's time). Only the operations ``BlockPool`` uses."""

    def __init__(self, base: OrderedDict[int, None]):
        self._base = base
        self._unread = iter(base)
        self._gone: set[int] = set()          # of the original's: taken out, or read from the head
        self._head: deque[int] = deque()      # moved to the front since the copy
        self._tail: OrderedDict[int, None] = OrderedDict()  # freed since the copy
        self._n = len(base)

    def __len__(self) -> int:
        return self._n

    def __setitem__(self, b: int, _: None) -> None:  # a block freed: the queue's tail
        if b not in self._tail:
            self._tail[b] = None
            self._n += 1

    def move_to_end(self, b: int, last: bool = True) -> None:
        assert not last and b in self._tail  # BlockPool moves a block it has just freed to the front
        del self._tail[b]
        self._head.appendleft(b)

    def pop(self, b: int, default: None = None) -> None:
        if b in self._tail:
            del self._tail[b]
        elif b in self._head:
            self._head.remove(b)
        elif b in self._base and b not in self._gone:
            self._gone.add(b)
        else:
            return default  # not in the queue
        self._n -= 1
        return None

    def popitem(self, last: bool = True) -> tuple[int, None]:
        assert not last  # BlockPool takes from the head
        if self._head:
            b = self._head.popleft()
        else:
            for b in self._unread:
                if b not in self._gone:
                    self._gone.add(b)
                    break
            else:
                b, _ = self._tail.popitem(last=False)
        self._n -= 1
        return b, None
