"""Which KV cells of the one unified cache each sequence holds, counted the way llama.cpp stores them.

The engine's context is one pool of `n_cells` cells shared by every sequence (llama.cpp's kv_unified).
A decoded token takes a free cell; `llama_memory_seq_cp` between sequences of one pool adds the copy's
sequence id to the same cells (shared, not copied); a cell is free again once no sequence holds it.
llama.cpp has no call that says how many cells are in use, so the scheduler mirrors every change it makes
here: each cell gets an id when it is filled, a sequence is the list of its cells' ids in position order,
and a cell is used while any sequence lists it. Admission, growth and preemption read `free`; /status
reads `used` and `shared`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolUsage:
    cells: int  # the pool's size
    used: int  # cells some sequence holds
    shared: int  # of those, cells more than one sequence holds (a common prefix stored once)
    held: int  # the cells the sequences would take if each kept its own copy (>= used)

    @property
    def free(self) -> int:
        return self.cells - self.used


class KvPool:
    def __init__(self, n_cells: int, n_seqs: int):
        self.n_cells = n_cells
        self._seqs: list[list[int]] = [[] for _ in range(n_seqs)]
        self._refs: Counter[int] = Counter()
        self._next_id = 0

    @property
    def used(self) -> int:
        return len(self._refs)

    @property
    def free(self) -> int:
        return self.n_cells - len(self._refs)

    def held(self, seq: int) -> int:
        return len(self._seqs[seq])

    def only_held_by(self, seq: int, start: int = 0) -> int:
        """Of `seq`'s cells from its `start`-th on, those no other sequence holds: what letting go of them
        frees."""
        refs = self._refs
        return sum(1 for c in self._seqs[seq][start:] if refs[c] == 1)

    def grow(self, seq: int, n: int) -> None:
        """`seq` filled n new cells (a decode of n of its tokens, a media chunk's embeddings)."""
        if n <= 0:
            return
        ids = range(self._next_id, self._next_id + n)
        self._next_id += n
        self._seqs[seq].extend(ids)
        self._refs.update(ids)

    def truncate(self, seq: int, keep: int) -> None:
        """`seq` now holds only its first `keep` cells (llama_memory_seq_rm of the rest)."""
        cells = self._seqs[seq]
        if keep >= len(cells):
            return
        dropped = cells[max(0, keep) :]
        del cells[max(0, keep) :]
        refs = self._refs
        for c in dropped:
            if refs[c] <= 1:
                del refs[c]
            else:
                refs[c] -= 1

    def share(self, src: int, dst: int, n: int) -> None:
        """`dst` (cleared first) holds `src`'s first n cells too (llama_memory_seq_cp within the pool)."""
        self.truncate(dst, 0)
        ids = self._seqs[src][:n]
        self._seqs[dst] = list(ids)
        self._refs.update(ids)

    def usage(self) -> PoolUsage:
        return PoolUsage(
            self.n_cells,
            len(self._refs),
            sum(1 for n in self._refs.values() if n > 1),
            sum(len(s) for s in self._seqs),
        )
