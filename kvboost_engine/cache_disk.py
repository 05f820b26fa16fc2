"""The disk tier side of the chunk cache: write-through of new chunks, restore on a miss.

A mixin of ChunkCache (it uses the cache's lock-held internals): new nodes are written to the
disk tier in the background; a lookup that ends on a node boundary probes the disk for the
prompt's next chunks (by prefix key) and brings them back into pool blocks, in order, for as
long as they continue the path. Entries are checksummed by the disk tier; a bad file is a miss.
"""
from __future__ import annotations

from .errors import BudgetError
from .hashing import PrefixHasher
from .tree import Node, blocks_for


class DiskRestore:
    def _hold_for_disk(self, nodes: list[Node]) -> list[tuple]:
        """(key, start, tokens, exact, table) of new nodes not yet on disk; the tables hold
        references so the KV stays put until it is written (lock held)."""
        pending = []
        for node in nodes:
            if not self.disk.contains(node.key):
                table = [None] * node.first_block + node.blocks
                self.pool.retain(node.blocks)
                pending.append((node.key, node.start, node.tokens, node.exact, table))
        return pending

    def _write_through(self, pending: list[tuple]) -> None:
        for key, start, tokens, exact, table in pending:
            try:
                kv = self.disk_codec.encode(self.pool.read(table, start, len(tokens)))
                self.disk.put_async(key, start, tokens, kv, exact)
            finally:
                self.pool.release([b for b in table if b is not None])

    def read(self, node: Node, offset: int, count: int):
        """KV of `count` of a node's positions from `offset`: [2, layers, kv_heads, count, D] (a copy)."""
        table = [None] * node.first_block + node.blocks
        return self.pool.read(table, node.start + offset, count)

    def _read_disk(self, tokens, limit, chunk_ends, offset: int) -> list[tuple]:
        """Disk entries that continue tokens[:offset], chunk by chunk, in order (no lock held)."""
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(tokens[:offset])
        cursor, entries = offset, []
        for end in (c for c in chunk_ends if offset < c <= limit):
            hasher.update(tokens[cursor:end])
            cursor = end
            entry = self.disk.get(hasher.key())
            if entry is None:
                break
            start, entry_tokens, data, exact = entry
            if start > offset or tuple(tokens[start:end]) != tuple(entry_tokens):
                break
            kv = self.disk_codec.decode(data, len(entry_tokens))
            entries.append((start, end, kv, exact and self.disk_codec.exact))
            offset = end
        return entries

    def _adopt_entries(self, entries: list[tuple], tokens, path: list[Node], offset: int) -> None:
        """Bring read entries into the tree for as long as they continue the path (lock held)."""
        for start, end, kv, exact in entries:
            if end <= offset:
                continue                                    # another thread stored it meanwhile
            if start > offset:
                return
            node = self._adopt_disk_entry(path, tokens, offset, end, kv[:, :, :, offset - start:], exact)
            if node is None:
                return
            path.append(node)
            self.counters.disk_hits += 1
            self.counters.disk_tokens += end - offset
            offset = end

    def _adopt_disk_entry(self, path: list[Node], tokens, start: int, end: int, kv, exact: bool) -> Node | None:
        parent = path[-1] if path else self.root
        indices = blocks_for(start, end, self.block_tokens)
        self.make_room(len(indices), {n.uid for n in path})
        try:
            blocks = self.pool.allocate(len(indices))
        except BudgetError:
            return None
        table = [None] * indices.start + blocks
        head = indices.start * self.block_tokens
        if head < start:                                # the block also holds the path's earlier positions
            self.pool.write(table, head, self.pool.read(self._path_table(path, head, start), head, start - head))
        self.pool.write(table, start, kv)
        self._hold(blocks)
        self.pool.release(blocks)
        key = PrefixHasher(self.fingerprint)
        key.update(tokens[:end])
        node = Node(key.key(), tuple(tokens[start:end]), blocks, indices.start, parent, start, next(self._uids),
                    exact=exact and parent.exact)
        parent.children[node.tokens[0]] = node
        self._lru[node.uid] = node
        self._fit_budget({n.uid for n in path} | {node.uid}, [node])
        return node if node.alive else None

