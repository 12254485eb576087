"""Token-level prefix cache: a radix tree over token ids whose nodes own KV pages.

A hit resumes a prompt at the exact token count a previous request stopped at -- its prompt end, its
finish, or anywhere inside a cached run -- not at a page boundary (spec: "Prefix hits resume at any
token"). That works because the K/V of position p depends only on tokens 0..p: the first j slots of
any cached page are valid for any prompt that agrees with the cached tokens up to there.

Tree shape. Every node's key starts at a page-aligned offset. A *full* node's key is a whole number
of pages and may have children; a *partial* node's key ends inside its last page and is always a
leaf. Children of one node may share a first-page prefix (the tree splits only at page boundaries),
so a lookup takes the child with the longest common prefix.

Sharing. A hit hands out the matched full pages by reference (KVManager refcounts) and names the
page holding the matched tail, if the hit ends mid-page. The requester must COPY that page into a
fresh one before writing its own tokens after the tail (copy-on-write), because the cached node
keeps claiming the page's first slots. Cached pages are never written: a request only writes
positions at or beyond its hit, which live in its own pages.

Eviction. Leaves whose pages nobody but the tree holds (refcount 1) are evicted least recently used
first when the pool runs short (KVManager.evict_hook).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from jengine.engine.kv_manager import KVManager


@dataclass(eq=False)
class _Node:
    key: list[int]
    pages: list[int]
    parent: "_Node | None"
    children: list["_Node"] = field(default_factory=list)
    last_access: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    length: int  # tokens whose K/V the hit supplies (the request's cached_tokens)
    shared_pages: list[int]  # full pages covering tokens[: length // page_size * page_size]
    partial_page: int | None  # page whose first length % page_size slots hold the tail; copy it


def _common_prefix_len(key: list[int], tokens: list[int], offset: int) -> int:
    n = min(len(key), len(tokens) - offset)
    i = 0
    while i < n and key[i] == tokens[offset + i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.root = _Node(key=[], pages=[], parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree holds a reference to

    def _is_full(self, node: _Node) -> bool:
        return len(node.key) % self.page_size == 0

    def _best_child(self, node: _Node, tokens: list[int], offset: int) -> tuple[_Node | None, int]:
        best, best_len = None, 0
        for child in node.children:
            n = _common_prefix_len(child.key, tokens, offset)
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    # -- lookup ----------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_len: int) -> PrefixMatch:
        """Longest cached prefix of tokens[:max_len]. Marks the path as recently used."""
        tokens = list(tokens[: max(max_len, 0)])
        now = next(self._clock)
        node, offset, shared = self.root, 0, []
        while offset < len(tokens):
            child, n = self._best_child(node, tokens, offset)
            if child is None:
                break
            child.last_access = now
            if n == len(child.key) and self._is_full(child):
                shared += child.pages
                offset += n
                node = child
                continue
            # The hit ends inside this child: its whole pages are shared, the rest is a tail.
            whole = n // self.page_size
            shared += child.pages[:whole]
            partial = child.pages[whole] if n % self.page_size else None
            return PrefixMatch(offset + n, shared, partial)
        return PrefixMatch(offset, shared, None)

    # -- insertion -------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Cache tokens whose K/V lie in `pages` (position order; the last may be partial).

        Runs already cached are kept as they are (the caller's duplicate pages stay the caller's);
        only the new suffix's pages gain a tree reference.
        """
        tokens = list(tokens)
        if len(pages) < self.kv.pages_for(len(tokens)):
            raise ValueError(f"{len(tokens)} tokens need {self.kv.pages_for(len(tokens))} pages, got {len(pages)}")
        now = next(self._clock)
        node, offset = self.root, 0
        while offset < len(tokens):
            child, n = self._best_child(node, tokens, offset)
            if child is not None:
                child.last_access = now
                if n == len(child.key) and self._is_full(child):
                    node, offset = child, offset + n
                    continue
                if offset + n == len(tokens):
                    return  # everything left is already inside `child`
                aligned = n // self.page_size * self.page_size
                if aligned:
                    node, offset = self._split(child, aligned), offset + aligned
            self._add_leaf(node, tokens[offset:], pages[offset // self.page_size: self.kv.pages_for(len(tokens))], now)
            return

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's key at a page boundary; returns the new upper node (full, `at` tokens)."""
        parent = child.parent
        upper = _Node(key=child.key[:at], pages=child.pages[: at // self.page_size], parent=parent,
                      children=[child], last_access=child.last_access)
        parent.children[parent.children.index(child)] = upper
        child.key = child.key[at:]
        child.pages = child.pages[at // self.page_size:]
        child.parent = upper
        return upper

    def _add_leaf(self, node: _Node, key: list[int], pages: list[int], now: int) -> None:
        leaf = _Node(key=key, pages=list(pages), parent=node, last_access=now)
        self.kv.incref(leaf.pages)
        self.num_pages += len(leaf.pages)
        # A partial sibling whose tokens the new leaf extends is now redundant: drop it.
        for sib in list(node.children):
            if not self._is_full(sib) and len(sib.key) < len(key) and key[: len(sib.key)] == sib.key:
                self._remove(sib)
        node.children.append(leaf)

    def _remove(self, node: _Node) -> None:
        assert not node.children, "only leaves are removed"
        node.parent.children.remove(node)
        self.kv.decref(node.pages)
        self.num_pages -= len(node.pages)

    # -- eviction --------------------------------------------------------------------------------
    def _evictable(self, node: _Node) -> bool:
        return (node is not self.root and not node.children
                and all(self.kv.refcount(p) == 1 for p in node.pages))

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages if possible, least recently used leaves first."""
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += len(leaf.pages)
            self._remove(leaf)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return freed

    def flush(self) -> None:
        """Drop every cached entry. Pages that running requests still hold stay theirs."""
        for node in list(self._nodes()):
            if node is not self.root:
                self.kv.decref(node.pages)
        self.root.children = []
        self.num_pages = 0

    def cached_tokens(self) -> int:
        return sum(len(n.key) for n in self._nodes())
