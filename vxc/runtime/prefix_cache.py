"""Exact prefix reuse across requests: a radix tree of state snapshots keyed by token prefix.

The :class:`~vxc.runtime.scheduler.Scheduler` calls two hooks (see its module doc):

* ``store(state, slot, tokens)`` after every prefill chunk — the slot's state is exactly the state after
  ``tokens``, whose length is a multiple of the chunk or a prompt end;
* ``restore(state, slot, prompt) -> m`` when a request takes a (just zeroed) slot: the slot is set to the
  state after ``prompt[:m]``, the longest cached prefix that leaves at least one prompt token to feed — or the
  whole prompt, where a request with that same prompt stored it with the logits its last token gave
  (``store(..., logits=...)`` at a prompt end); ``take_logits(slot)`` then hands those logits over, and the
  request chooses its first token from them with nothing to prefill. Without that, a recurrent model's state
  could serve the same prompt again only from the last chunk boundary before its end (a prompt shorter than
  one chunk: never).

**The tree.** A node stands at a position ``pos`` where some request's state was stored; the edge from its
parent holds the tokens ``parent.pos .. pos`` (``key``: one chunk of a request, so a block of ``chunk`` tokens,
or fewer at a prompt end or after a restore at one). What a node holds follows the region kinds the state
declares, nothing else:

* ``rows``: the node's own positions of every per-token region that keeps one row per position (K and V rows,
  latent rows) — ``[len(key), ...]`` (``[2, len(key), ...]`` for K/V rows). A restore at a node copies the rows
  of every node on its path; no row is held twice along a path, whatever the number of snapshots on it;
* ``snap``: everything else at ``pos``, copied whole — the fixed regions (recurrent matrices, conv histories)
  and the per-token regions held as a ring of window rows (their first ``min(pos, rows)`` rows: past a ring's
  length every row is live, before it the rest of a fresh slot is zero).

Every tensor is a clone of the slot's own buffer: the region's declared dtype is kept (an fp32 recurrent
matrix under bf16 compute stays fp32), on the state's device.

**Exactness.** A restore writes back bit for bit the state some request had at ``pos`` (the rest of a zeroed
slot stays zero), so the suffix then prefills exactly as it did — or would have — in that request's run. To
keep every path the state of one computation, each slot remembers the node its state descends from (where it
was restored, or what it stored last); a store extends the tree from there only. Where another request
already stored the same tokens from the same node (two requests with a shared prefix prefilling side by
side), the slot's rows and snapshot are compared with the node's (``torch.equal``) and the node is adopted
when they match; when they do not (the same tokens reached through other chunk boundaries), this slot stores
nothing further (``conflicts`` counts it). A match that ends between snapshots — inside an edge, at a node
whose snapshot was evicted, or at the whole prompt — falls back to the nearest earlier snapshot on the path.

**Memory.** ``budget`` bytes (the tensors held, counted exactly). When a store needs room, least recently
used entries go first: a leaf node as a whole (rows and snapshot; a parent left with neither children nor a
snapshot goes too), or the snapshot alone of a node with children (its rows stay: the children need them, and
a match through it falls back to an earlier snapshot). So an eviction never breaks a descendant. A hit or a
store touches its node and then every ancestor, so ancestors are always more recent than their descendants
and leaves go first. The path a store extends is pinned while it makes room; a node that does not fit even
then is not stored (and that slot stores nothing further).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator, Optional

import torch


LOGITS = "@logits"  # a snapshot's entry for the logits of the node's last token (not a region)


class Node:
    __slots__ = ("parent", "key", "pos", "children", "rows", "snap", "nbytes", "live")

    def __init__(self, parent: Optional["Node"], key: tuple, pos: int):
        self.parent = parent
        self.key = key  # tokens parent.pos .. pos
        self.pos = pos
        self.children: dict[int, list[Node]] = {}  # first token of the child's key -> children
        self.rows: dict[str, torch.Tensor] = {}
        self.snap: Optional[dict[str, torch.Tensor]] = None
        self.nbytes = 0
        self.live = True

    def path(self) -> list["Node"]:
        """This node and its ancestors below the root, root side first."""
        out, n = [], self
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        return out[::-1]

    def child(self, key: tuple) -> Optional["Node"]:
        for c in self.children.get(key[0], ()):
            if c.key == key:
                return c
        return None


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class PrefixCache:
    """Snapshots of the state after token prefixes, shared by every request of one engine (see the module doc).

    ``budget``: bytes the held tensors may take (on the state's device)."""

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, not {budget}")
        self.budget = int(budget)
        self.root = Node(None, (), 0)
        self.bytes = 0
        self.snapshots = 0
        self.hits = self.misses = self.hit_tokens = 0
        self.evictions = self.conflicts = 0
        self._lru: OrderedDict[int, Node] = OrderedDict()  # oldest first
        self._anchor: dict[int, Optional[Node]] = {}  # slot -> the node its state descends from (None: stores nothing)
        self._full: dict[int, torch.Tensor] = {}  # slot -> the logits of a whole-prompt restore, until taken
        self._sig = None  # the region layout this cache holds
        self._bound = None  # the state it was last checked against
        self._kv: set[str] = set()
        self._kind: dict[str, str] = {}  # region id -> "rows" (one row per position) or "whole" (snapshot)
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ the scheduler's hooks

    def restore(self, state, slot: int, prompt: list[int]) -> int:
        with self.lock:
            self._bind(state)
            node = self._match(prompt)
            self._full.pop(slot, None)
            if node.pos == len(prompt):  # the whole prompt, with its last token's logits
                self._full[slot] = node.snap[LOGITS]
            self._anchor[slot] = node
            if node is self.root:
                self.misses += 1
                return 0
            views = state.slot(slot)
            for n in node.path():
                for rid, t in n.rows.items():
                    state.rows(rid, views[rid], n.parent.pos, n.pos).copy_(t)
            for rid, t in node.snap.items():
                if rid != LOGITS:
                    self._whole(state, rid, views[rid], node.pos).copy_(t)
            self.hits += 1
            self.hit_tokens += node.pos
            self._touch(node)
            return node.pos

    def take_logits(self, slot: int) -> Optional[torch.Tensor]:
        """The stored logits of the prompt's last token when the last restore into ``slot`` matched the whole
        prompt (None otherwise); handed over once."""
        with self.lock:
            return self._full.pop(slot, None)

    def store(self, state, slot: int, tokens: list[int], logits: Optional[torch.Tensor] = None) -> None:
        """``logits``: those of the last token of ``tokens`` where it ends a prompt (kept with the snapshot, so
        the same prompt can be served whole)."""
        with self.lock:
            self._bind(state)
            parent = self._anchor.get(slot, self.root)
            p = len(tokens)
            if parent is None or not parent.live or p <= parent.pos:
                self._anchor[slot] = None
                return
            key = tuple(tokens[parent.pos:p])
            views = state.slot(slot)
            node = parent.child(key)
            if node is not None:  # stored by another request: the same state, or this slot stops here
                if not self._same(state, views, node):
                    self.conflicts += 1
                    self._anchor[slot] = None
                    return
                if node.snap is None:  # evicted: this slot's state at p is the one it held
                    snap = self._snapshot(state, views, p)
                    if self._make_room(_bytes(snap.values()), pinned=node):
                        self._set_snap(node, snap)
                self._anchor[slot] = node
                self._touch(node)
                self._keep_logits(node, logits)
                return
            node = Node(parent, key, p)
            node.rows = {rid: state.rows(rid, views[rid], parent.pos, p).clone()
                         for rid in self._kind if self._kind[rid] == "rows"}
            snap = self._snapshot(state, views, p)
            need = _bytes(node.rows.values()) + _bytes(snap.values())
            if not self._make_room(need, pinned=parent):
                self._anchor[slot] = None
                return
            parent.children.setdefault(key[0], []).append(node)
            node.nbytes = _bytes(node.rows.values())
            self.bytes += node.nbytes
            self._set_snap(node, snap)
            self._anchor[slot] = node
            self._touch(node)
            self._keep_logits(node, logits)

    # ------------------------------------------------------------------ reports

    def stats(self) -> dict:
        with self.lock:
            return {"bytes": self.bytes, "budget": self.budget, "snapshots": self.snapshots, "nodes": len(self._lru),
                    "hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
                    "evictions": self.evictions, "conflicts": self.conflicts}

    def nodes(self) -> Iterator[Node]:
        """Every node held (the root excluded)."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            for cs in n.children.values():
                stack.extend(cs)
            if n is not self.root:
                yield n

    def clear(self) -> None:
        """Drop every node (the counters of hits and misses stay)."""
        with self.lock:
            for n in list(self._lru.values()):
                n.live = False
            self.root = Node(None, (), 0)
            self._lru.clear()
            self._anchor.clear()
            self._full.clear()
            self.bytes = self.snapshots = 0

    # ------------------------------------------------------------------ inside

    def _bind(self, state) -> None:
        if state is self._bound:
            return
        sig = tuple((rid, state.layout[rid], bool(state.growing[rid]), bool(state.ring.get(rid, False)), b.dtype,
                     tuple(b.shape[1:])) for rid, b in state.slots.items())
        if self._sig is None:
            self._sig = sig
            self._kind = {rid: "rows" if state.growing[rid] and not state.ring.get(rid, False) else "whole"
                          for rid in state.slots}
            self._kv = {rid for rid in state.slots if state.layout[rid] == "kv_rows"}
        elif sig != self._sig:
            raise ValueError("a prefix cache holds the state of one engine: this state's regions differ from "
                             "the ones it was filled with")
        self._bound = state

    def _whole(self, state, rid: str, buf: torch.Tensor, pos: int) -> torch.Tensor:
        """The part of region ``rid`` (one slot's buffer) a snapshot at ``pos`` holds: a fixed region whole; a
        ring its first min(pos, rows) rows (the rest of a fresh slot is zero until positions wrap)."""
        if not state.growing[rid]:
            return buf
        n = min(pos, buf.shape[1] if rid in self._kv else buf.shape[0])
        return state.rows(rid, buf, 0, n)

    def _snapshot(self, state, views, pos: int) -> dict[str, torch.Tensor]:
        return {rid: self._whole(state, rid, views[rid], pos).clone()
                for rid in self._kind if self._kind[rid] == "whole"}

    def _same(self, state, views, node: Node) -> bool:
        a = node.parent.pos
        for rid, t in node.rows.items():
            if not torch.equal(state.rows(rid, views[rid], a, node.pos), t):
                return False
        if node.snap is not None:
            for rid, t in node.snap.items():
                if rid != LOGITS and not torch.equal(self._whole(state, rid, views[rid], node.pos), t):
                    return False
        return True

    def _keep_logits(self, node: Node, logits: Optional[torch.Tensor]) -> None:
        """Keep ``logits`` in ``node``'s snapshot (counted in its bytes) where it has a snapshot without them."""
        if logits is None or node.snap is None or LOGITS in node.snap:
            return
        t = logits.detach().clone()
        if not self._make_room(_bytes([t]), pinned=node) or node.snap is None:
            return
        node.snap[LOGITS] = t
        node.nbytes += _bytes([t])
        self.bytes += _bytes([t])

    def _set_snap(self, node: Node, snap: dict[str, torch.Tensor]) -> None:
        node.snap = snap
        b = _bytes(snap.values())
        node.nbytes += b
        self.bytes += b
        self.snapshots += 1

    def _match(self, prompt: list[int]) -> Node:
        """The deepest node with a snapshot whose path spells a prefix of ``prompt`` leaving a token to feed, or
        spells the whole prompt and holds its last token's logits (the root when none)."""
        end = len(prompt)
        best, stack = self.root, [self.root]
        while stack:
            n = stack.pop()
            if (n is not self.root and n.snap is not None and n.pos > best.pos
                    and (n.pos < end or LOGITS in n.snap)):
                best = n
            if n.pos >= end:
                continue
            for c in n.children.get(prompt[n.pos], ()):
                if c.pos <= end and tuple(prompt[n.pos:c.pos]) == c.key:
                    stack.append(c)
        return best

    def _touch(self, node: Node) -> None:
        while node is not None and node.parent is not None:
            self._lru[id(node)] = node
            self._lru.move_to_end(id(node))
            node = node.parent

    def _make_room(self, need: int, pinned: Node) -> bool:
        """Evict least recently used entries until ``need`` more bytes fit; never ``pinned`` or its ancestors
        as a whole (their rows are the new node's prefix). False, evicting nothing, when it cannot fit."""
        path = pinned.path()
        if need + sum(_bytes(n.rows.values()) for n in path) > self.budget:
            return False
        keep = set(map(id, path))
        while self.bytes + need > self.budget:
            for n in self._lru.values():  # oldest first; ancestors are always more recent than descendants
                if not n.children and id(n) not in keep:
                    self._remove(n, keep)
                    break
                if n.snap and _bytes(n.snap.values()):
                    self._drop_snap(n)
                    break
            else:  # unreachable: everything but the pinned rows is evictable and they fit
                return False
            self.evictions += 1
        return True

    def _drop_snap(self, n: Node) -> None:
        b = _bytes(n.snap.values())
        n.snap = None
        n.nbytes -= b
        self.bytes -= b
        self.snapshots -= 1

    def _remove(self, n: Node, keep: set) -> None:
        """Remove leaf ``n``, then each ancestor left with neither children nor a snapshot (unless in ``keep``)."""
        while True:
            if n.snap is not None:
                self.snapshots -= 1
            self.bytes -= n.nbytes
            n.live = False
            self._lru.pop(id(n), None)
            p = n.parent
            sib = p.children[n.key[0]]
            sib.remove(n)
            if not sib:
                del p.children[n.key[0]]
            if p.parent is None or p.children or p.snap is not None or id(p) in keep:
                return
            n = p
