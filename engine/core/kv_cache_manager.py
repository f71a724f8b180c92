"""Paged KV-cache bookkeeping: a BlockPool of ref-counted blocks with an O(1) LRU free list, and a
BlockManager that gives sequences block tables and shares full blocks through a chained-hash prefix cache.

With `reserve_blocks` > 0 (EngineConfig.kv_cache_layout="contiguous") a request's first allocation takes
that many blocks at once, the max-length reservation of a contiguous per-request cache: the same tables
and kernels run, but admission needs the whole reservation free, as it did before paging.

Block 0 is the null block: never handed out, so padded block-table entries and padded CUDA-graph rows
can point at it harmlessly.

With a host tier (EngineConfig.kv_offload_gib > 0) a HostBlockPool holds blocks that left the device: those of
a request preempted by swapping (owned by it until it is swapped back in or ends), and full cached blocks the
device pool evicted (an LRU second prefix cache keyed by the same chained hashes, fetched back by
match_prefix). The manager only journals the copies; the engine runs a step's journal before its forward,
device -> host copies first, so a block freed by a swap-out or an eviction may be refilled in the same step.
Host blocks read by this step's copies stay pinned until the journal is taken.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.core.sequence import Sequence


def chain_hash(parent: int, tokens) -> int:
    """A full block's prefix-cache key: its tokens and its parent block's key (the whole prefix). Python's hash
    of a tuple of ints is the same in every process, so a router in another process computes the same keys."""
    return hash((parent, tuple(tokens)))


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained keys of the full blocks of a prompt."""
    out, parent = [], 0
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # ref-count-zero blocks, least recently used first; uncached blocks are kept at the front
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.num_extra_refs = 0         # sum over blocks of (ref count - 1) where > 0: table entries that share
        self.on_evict = None            # (block, hash) -> None: a host tier keeps the evicted content
        # per-step journal for the event stream
        self.allocated: list[int] = []
        self.freed: list[int] = []
        self.evicted: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def take(self) -> int:
        """A block for new content: the least recently used free block; its cached hash is evicted."""
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self.evicted.append(b)
            if self.on_evict is not None:
                self.on_evict(b, h)
        self.ref_counts[b] = 1
        self.allocated.append(b)
        return b

    def share(self, b: int) -> None:
        """Reuse a cached block (ref count + 1), reviving it from the free list if needed."""
        if self.ref_counts[b] == 0:
            del self.free[b]
        else:
            self.num_extra_refs += 1
        self.ref_counts[b] += 1

    def release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0, f"block {b} released twice"
        if self.ref_counts[b] > 0:
            self.num_extra_refs -= 1
        if self.ref_counts[b] == 0:
            self.free[b] = None
            if self.block_hash[b] is None:
                self.free.move_to_end(b, last=False)
            self.freed.append(b)

    def register(self, b: int, h: int) -> None:
        if self.block_hash[b] is None and h not in self.hash_to_block:
            self.block_hash[b] = h
            self.hash_to_block[h] = b

    def pop_journal(self) -> tuple[list[int], list[int], list[int]]:
        out = (self.allocated, self.freed, self.evicted)
        self.allocated, self.freed, self.evicted = [], [], []
        return out


class HostBlockPool:
    """The host tier's blocks: owned by a swapped-out request, or cached by hash (LRU, evictable), or free."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.owned: set[int] = set()                       # held by swapped-out requests
        self.cached: OrderedDict[int, int] = OrderedDict()  # hash -> host block, least recently used first
        self.block_hash: dict[int, int] = {}               # host block -> its hash (cached blocks)
        self.pinned: dict[int, int] = {}                   # host block -> copies of this step that read it

    @property
    def num_evictable(self) -> int:
        return sum(1 for b in self.cached.values() if b not in self.pinned)

    @property
    def num_available(self) -> int:
        return len(self.free) + self.num_evictable

    def take(self) -> int | None:
        """A host block for new content: a free one, else the least recently used unpinned cached one."""
        if self.free:
            return self.free.pop()
        for h, b in self.cached.items():
            if b not in self.pinned:
                del self.cached[h], self.block_hash[b]
                return b
        return None

    def pin(self, b: int) -> None:
        self.pinned[b] = self.pinned.get(b, 0) + 1

    def unpin_all(self) -> None:
        self.pinned.clear()

    def release_owned(self, b: int) -> None:
        self.owned.remove(b)
        self.free.append(b)

    def lookup(self, h: int) -> int | None:
        b = self.cached.get(h)
        if b is not None:
            self.cached.move_to_end(h)
        return b


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, reserve_blocks: int = 0,
                 num_host_blocks: int = 0):
        self.pool = BlockPool(num_blocks)
        self.host = HostBlockPool(num_host_blocks) if num_host_blocks else None
        self.pool.on_evict = self._offload if self.host is not None else None
        # this step's copies: (device block, host block) out, (host block, device block) in
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []
        self.swap_stats = dict(swapped_out=0, swapped_in=0, offloaded=0, fetched=0)
        self._host_to_free: list[int] = []
        self._seen = dict(self.swap_stats)              # swap_stats at the last pop_step_stats
        self.block_size = block_size
        self.reserve_blocks = reserve_blocks
        self.enable_prefix_caching = enable_prefix_caching and not reserve_blocks
        self.step_queries = 0
        self.step_hits = 0
        self.step_shared = 0
        self.total_queries = 0
        self.total_hits = 0

    # ---- hashing -------------------------------------------------------------------------------
    def _update_hashes(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend seq.block_hashes over the full blocks of token_ids[:upto_tokens]."""
        bs = self.block_size
        hashes = seq.block_hashes
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else 0, seq.token_ids[i * bs:(i + 1) * bs]))

    # ---- admission and growth ------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, max(-(-num_tokens // self.block_size), self.reserve_blocks) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens) <= self.pool.num_free

    def match_prefix(self, seq: Sequence) -> None:
        """On admission from waiting: adopt the longest chain of cached full blocks (not the last token)."""
        if not self.enable_prefix_caching or seq.block_table or seq.host_block_table \
                or seq.prompt_logprobs is not None:
            return              # prompt logprobs need every prompt position computed (as vLLM)
        limit = (seq.num_tokens - 1) // self.block_size   # keep >= 1 token to compute, for logits
        self._update_hashes(seq, limit * self.block_size)
        matched = []
        for h in seq.block_hashes[:limit]:
            b = self.pool.hash_to_block.get(h)
            if b is not None:
                self.pool.share(b)                        # held before a fetch below may evict
            else:                                         # the chain may go on in the host tier: copy it back
                hb = self.host.lookup(h) if self.host is not None else None
                if hb is None or self.pool.num_free == 0:
                    break
                self.host.pin(hb)                         # read by this step's copies: not evicted before
                b = self.pool.take()
                self.pool.register(b, h)
                self.blocks_to_swap_in.append((hb, b))
                self.swap_stats["fetched"] += 1
            matched.append(b)
        seq.block_table = matched
        seq.num_committed_blocks = len(matched)
        seq.num_computed_tokens = len(matched) * self.block_size

    def record_admission(self, seq: Sequence) -> None:
        """Count a scheduled admission in the prefix-cache stats (queries only on first admission)."""
        self.step_shared += len(seq.block_table)
        if seq.admitted or not self.enable_prefix_caching:
            return
        hits = seq.num_computed_tokens
        seq.num_cached_tokens = seq.metrics.num_cached_tokens = hits
        self.step_queries += seq.num_tokens
        self.step_hits += hits
        self.total_queries += seq.num_tokens
        self.total_hits += hits

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold num_computed + num_new tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)):
            seq.block_table.append(self.pool.take())

    def free(self, seq: Sequence) -> None:
        # blocks filled in a request's last step (finish, abort, preemption) are cached too: a request that
        # finishes in the step that computed its prompt (max_tokens=1) would otherwise cache nothing
        self.commit_computed(seq)
        for b in reversed(seq.block_table):      # tail blocks become least recently used last
            self.pool.release(b)
        seq.block_table = []
        seq.num_committed_blocks = 0
        for hb in seq.host_block_table:          # a swapped-out request that ends while waiting
            self.host.release_owned(hb)
        seq.host_block_table = []

    # ---- the host tier -------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        """A host tier with room for seq's blocks, and computed tokens worth keeping."""
        return self.host is not None and min(seq.num_computed_tokens, seq.num_tokens - 1) > 0 \
            and len(seq.block_table) <= self.host.num_available

    def swap_out(self, seq: Sequence) -> None:
        """Preemption by swapping: seq's blocks move to the host tier (check can_swap_out first); its computed
        tokens are kept, less the last one, whose logits the next step needs again."""
        keep = min(seq.num_computed_tokens, seq.num_tokens - 1)
        n = -(-keep // self.block_size)
        hosts = [self.host.take() for _ in range(n)]
        self.host.owned.update(hosts)
        self.blocks_to_swap_out.extend(zip(seq.block_table[:n], hosts))
        self.swap_stats["swapped_out"] += n
        self.free(seq)
        seq.host_block_table = hosts
        seq.num_computed_tokens = keep

    def swap_in(self, seq: Sequence) -> None:
        """seq's host blocks back into fresh device blocks (can_allocate checks for them and the first chunk's);
        the host blocks are free once this step's copies ran (pinned until then)."""
        for hb in seq.host_block_table:
            b = self.pool.take()
            seq.block_table.append(b)
            self.blocks_to_swap_in.append((hb, b))
            self.host.owned.remove(hb)
            self.host.pin(hb)
            self._host_to_free.append(hb)
        self.swap_stats["swapped_in"] += len(seq.host_block_table)
        seq.host_block_table = []

    def _offload(self, b: int, h: int) -> None:
        """The device pool evicts cached block b (hash h): keep its content in the host tier's LRU."""
        if h in self.host.cached:
            self.host.lookup(h)
            return
        hb = self.host.take()
        if hb is None:
            return
        self.host.cached[h] = hb
        self.host.block_hash[hb] = h
        self.blocks_to_swap_out.append((b, hb))
        self.swap_stats["offloaded"] += 1

    def pop_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (device -> host) and (host -> device) block copies, for the runner to run before the
        forward, in that order; host blocks read by them are unpinned, those swapped in become free."""
        out = (self.blocks_to_swap_out, self.blocks_to_swap_in)
        self.blocks_to_swap_out, self.blocks_to_swap_in = [], []
        if self.host is not None:
            self.host.unpin_all()
            self.host.free.extend(self._host_to_free)
            self._host_to_free = []
        return out

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return blocks beyond what num_tokens needs (rejected speculative tokens)."""
        keep = max(-(-num_tokens // self.block_size), self.reserve_blocks)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())
        seq.num_committed_blocks = min(seq.num_committed_blocks, len(seq.block_table))

    def commit_computed(self, seq: Sequence) -> None:
        """After a step: publish the hashes of seq's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        # (computed may run past the known tokens when a multi-step / speculative run stopped early:
        #  only blocks whose every token is in token_ids are published)
        n_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_table))
        if n_full <= seq.num_committed_blocks:
            return
        self._update_hashes(seq, n_full * self.block_size)
        for i in range(seq.num_committed_blocks, n_full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_committed_blocks = n_full

    # ---- stats ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def slot_usage(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(reserved, used) KV slots: slots of the blocks held by sequences, and of those the slots holding a
        computed token. `seqs` are the holders (the running requests); a shared block is full (only full
        blocks are cached), so it is counted once by subtracting the extra references."""
        bs = self.block_size
        reserved = (self.pool.num_usable - self.pool.num_free) * bs
        used = sum(min(s.num_computed_tokens, len(s.block_table) * bs) for s in seqs)
        return reserved, used - self.pool.num_extra_refs * bs

    def pop_step_stats(self) -> dict:
        alloc, freed, evicted = self.pool.pop_journal()
        st = self.swap_stats
        out = dict(blocks_allocated=alloc, blocks_freed=freed, blocks_evicted=evicted,
                   blocks_shared=self.step_shared, prefix_cache_queries=self.step_queries,
                   prefix_cache_hits=self.step_hits, blocks_offloaded=st["offloaded"] - self._seen["offloaded"],
                   blocks_fetched=st["fetched"] - self._seen["fetched"])
        self._seen = dict(st)
        self.step_queries = self.step_hits = self.step_shared = 0
        return out
