"""The KV cell ledger (worker/engines/llamacpp/pool.py) against a naive model of llama.cpp's cells:
each cell a set of owning sequences, free when the set is empty."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from basertd.worker.engines.llamacpp.pool import CellLedger, PoolExhausted

N_CELLS = 64
SEQS = range(5)


class LedgerVsCells(RuleBasedStateMachine):
    """Random append / share / truncate / drop sequences; the ledger's free count, lengths and
    "what would dropping free" answers must match the naive per-cell owner sets."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = CellLedger(N_CELLS)
        self.owners: list[set[int]] = []  # naive: one owner set per allocated cell id (grows)
        self.seqs: dict[int, list[int]] = {}  # naive: seq -> its naive cell ids by position

    def _naive_free(self) -> int:
        return N_CELLS - sum(1 for o in self.owners if o)

    @rule(seq=st.sampled_from(SEQS), n=st.integers(0, 20))
    def append(self, seq, n):
        if n > self._naive_free():
            with pytest.raises(PoolExhausted):
                self.ledger.append(seq, n)
            return
        self.ledger.append(seq, n)
        cells = self.seqs.setdefault(seq, [])
        for _ in range(n):
            self.owners.append({seq})
            cells.append(len(self.owners) - 1)

    @precondition(lambda self: self.seqs and any(not self.seqs.get(s) for s in SEQS))
    @rule(data=st.data())
    def share(self, data):
        src = data.draw(st.sampled_from(sorted(self.seqs)))
        dst = data.draw(st.sampled_from([s for s in SEQS if not self.seqs.get(s)]))
        n = data.draw(st.integers(0, len(self.seqs[src])))
        self.ledger.share(src, dst, n)
        self.seqs[dst] = list(self.seqs[src][:n])
        for c in self.seqs[dst]:
            self.owners[c].add(dst)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        keep = data.draw(st.integers(0, len(self.seqs[seq]) + 2))
        if keep >= len(self.seqs[seq]):
            return
        self.ledger.truncate(seq, keep)
        for c in self.seqs[seq][keep:]:
            self.owners[c].discard(seq)
        del self.seqs[seq][keep:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def drop(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        self.ledger.drop(seq)
        for c in self.seqs.pop(seq):
            self.owners[c].discard(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def freed_by_is_exact(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), unique=True, max_size=3))
        drops = [(s, data.draw(st.integers(0, len(self.seqs[s])))) for s in chosen]
        dropped: dict[int, set[int]] = {}
        for s, keep in drops:
            for c in self.seqs[s][keep:]:
                dropped.setdefault(c, set()).add(s)
        expect = sum(1 for c, by in dropped.items() if self.owners[c] <= by)
        assert self.ledger.freed_by(drops) == expect

    @invariant()
    def counts_match(self):
        assert self.ledger.free == self._naive_free()
        for s in SEQS:
            assert self.ledger.length(s) == len(self.seqs.get(s, []))
            excl = sum(1 for c in self.seqs.get(s, []) if self.owners[c] == {s})
            assert self.ledger.exclusive(s) == excl


TestLedgerVsCells = LedgerVsCells.TestCase
TestLedgerVsCells.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_sharing_costs_no_cells_and_the_last_owner_frees():
    led = CellLedger(32)
    led.append(0, 20)
    led.share(0, 1, 16)
    led.share(0, 2, 16)
    assert led.used == 20
    led.drop(0)
    assert led.used == 16  # positions 16..19 were only seq 0's
    led.drop(1)
    assert led.used == 16
    led.drop(2)
    assert led.free == 32


def test_share_refuses_a_non_empty_destination_and_a_long_range():
    led = CellLedger(32)
    led.append(0, 4)
    led.append(1, 1)
    with pytest.raises(ValueError):
        led.share(0, 1, 2)
    with pytest.raises(ValueError):
        led.share(0, 2, 5)
    assert led.used == 5
