"""Prompt-prefix identities that survive process boundaries, and a bounded record of them.

The engine's prefix cache keys block ``i`` by ``hash((key of block i-1, token ids of block i,
extra keys))`` (``core/kv_cache_manager.py``). That value is Python's ``hash``, which differs
between processes (``hash(None)`` is an address in CPython 3.11), so the ingress, the router and
the replicas cannot compare it. They use the same chain here with BLAKE2b instead: block ``i``'s
key is ``blake2b(key of block i-1 || token ids of block i)``, seeded with the ``cache_salt``, so
two prompts share the keys of exactly the full blocks they share, and a salted request never
matches another salt's (as the engine's cache). Only full blocks get a key, as only full blocks
are cached.

``PrefixIndex`` is what a replica (and the router, for what it sent) remembers of those keys: an
LRU set of at most ``capacity`` keys. A replica sizes it to its pool's block count, so it can
never claim more blocks than its cache could hold, and it forgets the least recently used first,
as the pool evicts the least recently freed cached block first: an approximation of what the
cache holds that costs no engine call.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Container, Iterable, Optional, Sequence

DEFAULT_MAX_BLOCKS = 64  # keys per prompt: a 64-block prefix identifies a shared system prompt well enough


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None,
                        max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[int]:
    """Chained 63-bit keys of the full blocks of ``token_ids`` (the first ``max_blocks``).

    Args:
        token_ids: the prompt's token ids (each in [0, 2**63)).
        block_size: tokens per block (the engine's ``block_size``).
        cache_salt: the request's ``cache_salt`` (None: unsalted).
        max_blocks: most keys returned.

    Returns:
        ``min(len(token_ids) // block_size, max_blocks)`` keys, ints in [0, 2**63), equal in
        every process for equal inputs.

    Raises:
        ValueError: ``block_size`` < 1 or ``max_blocks`` < 0.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
    parent = hashlib.blake2b((cache_salt or "").encode("utf-8", "surrogatepass"), digest_size=8).digest()
    keys = []
    for index in range(min(len(token_ids) // block_size, max_blocks)):
        block = array("q", token_ids[index * block_size:(index + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        keys.append(int.from_bytes(parent, "little") >> 1)
    return keys


class PrefixIndex:
    """An LRU set of at most ``capacity`` block keys.

    Invariant: ``len(self) <= capacity``; the order is least to most recently used.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Iterable[int]) -> None:
        """Record ``keys`` as most recently used, forgetting the least recent beyond capacity."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        assert len(self._keys) <= self.capacity

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are held (a chain: a block counts only after its parent)."""
        return leading_matches(keys, self._keys)

    def keys(self) -> list[int]:
        """The held keys, least recently used first (what a replica reports)."""
        return list(self._keys)


def leading_matches(keys: Sequence[int], held: Container[int]) -> int:
    """How many leading ``keys`` are in ``held`` (a replica's reported keys, as a set)."""
    matched = 0
    for key in keys:
        if key not in held:
            break
        matched += 1
    return matched
