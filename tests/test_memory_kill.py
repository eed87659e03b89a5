"""An acknowledged write survives a SIGKILL.

A child process adds events one at a time with ``prefill=True`` and prints each id once ``add``
returned (the acknowledgement). The parent kills it with SIGKILL mid-stream, at a varying moment, then
reopens the store: every acknowledged event is there with its rows, every segment verifies against
its sha256 (``open`` does the full check), no orphan segment file is left, and the reopened memory
still equals a fresh prefill of its events. Two rounds: the second continues the store the first
left behind.

Marked ``slow`` (each round starts a child that loads torch). In the fast tier the same recovery is
tested in one process: an orphan segment, as a kill between its write and the commit leaves it, is
discarded by ``open`` (tests/test_memory.py::test_open_discards_orphans_and_checks_segments).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from eventkv.memory import EventMemory
from eventkv.memory.store import SEGMENTS
from eventkv.testing import tiny_lm

CHILD = r"""
import sys
from eventkv.memory import EventMemory
from eventkv.testing import tiny_lm

directory, mode, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
lm = tiny_lm("llama")
mem = EventMemory.create(directory, lm, namespace="kill") if mode == "create" else EventMemory.open(directory, lm)
print("ready", flush=True)
for i in range(start, start + 150):
    mem.add({"text": f"reg {i % 7} = {i * 13 % 101}", "id": f"k{i}"}, prefill=True)
    print(f"k{i}", flush=True)
print("done", flush=True)
"""


def _run_and_kill(directory, mode: str, start: int, acks_before_kill: int, extra_delay: float) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), mode, str(start)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    acked: list[str] = []
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        while len(acked) < acks_before_kill:
            line = proc.stdout.readline().strip()
            assert line and line != "done", f"child ended early: {proc.stderr.read()}"
            acked.append(line)
        time.sleep(extra_delay)  # land the kill at a varying point of the next add
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()  # lines printed before the kill are acknowledged too
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    acked += [x for x in rest.split() if x.startswith("k")]
    return acked


@pytest.mark.slow
@pytest.mark.parametrize("delays", [(0.0, 0.013)])
def test_acknowledged_adds_survive_sigkill(tmp_path, delays):
    d = tmp_path / "m"
    lm = tiny_lm("llama")
    acked: list[str] = []
    start = 0
    for round_, delay in enumerate(delays):
        mode = "create" if round_ == 0 else "open"
        acked += _run_and_kill(d, mode, start, acks_before_kill=12, extra_delay=delay)
        with EventMemory.open(d, lm) as mem:  # discards orphans, verifies every segment's sha256
            for eid in acked:
                rec = mem.get(eid)
                assert rec.prefilled and rec.text.startswith("reg "), eid
            segs = {r["file"].split("/")[-1] for r in mem.store.segment_rows()}
            assert sorted(p.name for p in (d / SEGMENTS).iterdir()) == sorted(segs)
            mem.store.verify("full")
            st = mem.stats()
            assert st.rows_prefilled <= st.rows
            # an add whose DB commit landed but whose segment did not is simply pending: prefill it
            mem.prefill()
            ids = [r.id for r in mem.list()]
            acked_set = set(acked)
            assert [i for i in ids if i in acked_set] == acked  # history order = acknowledgement order
            # an add may commit and be killed before it prints its acknowledgement: at most one per kill
            assert len([i for i in ids if i not in acked_set]) <= round_ + 1
            ans = mem.query("reg 3?", select="all", max_new_tokens=2)
            assert ans.served_ids == ids
            start = int(ids[-1][1:]) + 1  # an add committed but killed before its acknowledgement counts too
