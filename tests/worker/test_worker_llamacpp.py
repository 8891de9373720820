"""``basertd-worker --engine llamacpp`` on the tiny GGUF (tests/tinymodel.py): the handshake reports
the model, TOKENIZE uses its vocabulary, and greedy ticks through the worker give the tokens the
same engine gives in this process for the same plans (n_threads=1 on both sides)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from ring_rig import RingRig

from basertd.schema import link
from basertd.schema.abi import TickFlag
from basertd.schema.tick import LaneAdmit, LaneDecode, LanePrefill, LaneRetire, TickPlan
from basertd.server.workers.process import RingGeometry
from basertd.server.workers.sync_worker import SyncWorker

pytest.importorskip("llama_cpp")

LANES, CONTEXT = 4, 256
PROMPTS = [b"hello world", b"the a of and is"]


def plans(prompt_refs) -> list[TickPlan]:
    """Admit two greedy lanes, prefill in two chunks, decode 3 + 4 + 4 tokens (the second lane
    with partial emits on), retire."""
    out = []
    tags = [11, 12]
    lens = [r.count for r in prompt_refs]
    half = [n // 2 for n in lens]
    out.append(
        TickPlan(
            plan_seq=1,
            prefill_token_budget=64,
            admits=[LaneAdmit(lane_tag=t, prompt=r) for t, r in zip(tags, prompt_refs, strict=True)],
            prefills=[
                LanePrefill(lane_tag=t, token_offset=0, token_count=h)
                for t, h in zip(tags, half, strict=True)
            ],
        )
    )
    out.append(
        TickPlan(
            plan_seq=2,
            prefill_token_budget=64,
            max_decode_lanes=2,
            prefills=[
                LanePrefill(lane_tag=t, token_offset=h, token_count=n - h)
                for t, h, n in zip(tags, half, lens, strict=True)
            ],
            decodes=[LaneDecode(lane_tag=t, max_new_tokens=3) for t in tags],
        )
    )
    for seq in (3, 4):
        out.append(
            TickPlan(
                plan_seq=seq,
                flags=int(TickFlag.PARTIAL_EMITS),
                max_decode_lanes=2,
                decodes=[LaneDecode(lane_tag=t, max_new_tokens=4) for t in tags],
            )
        )
    out.append(TickPlan(plan_seq=5, retires=[LaneRetire(lane_tag=t) for t in tags]))
    return out


def in_process_tokens(model_path, prompts_ids: list[np.ndarray], geometry: dict) -> list[list[np.ndarray]]:
    """The same plans on a LlamaCppEngine in this process, with rings of the same geometry."""
    from basertd.worker.engines.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(model_path, lanes=LANES, context_length=CONTEXT, n_threads=1)
    rig = RingRig({rid: (g.slots, g.slot_bytes) for rid, g in geometry.items()})
    try:
        engine.attach_rings(rig.mappings())
        refs = [rig.prompt.write(p) for p in prompts_ids]
        out = []
        for plan in plans(refs):
            events = engine.tick(plan)
            out.append([rig.emit.read(e.token_ref) for e in events.emits])
        return out
    finally:
        engine.close()
        rig.close()


def test_llamacpp_worker_matches_in_process(make_spec, tiny_gguf):
    vocab = 293
    spec = make_spec(
        engine="llamacpp",
        model=str(tiny_gguf),
        lanes=LANES,
        context_length=CONTEXT,
        threads=1,
        emit_window_ms=0,
        logits_ring=RingGeometry.for_elems(8, vocab),
    )
    with SyncWorker(spec) as w:
        caps = w.capabilities
        assert caps.engine == "llamacpp" and caps.vocab_size == vocab and caps.max_lanes == LANES
        assert caps.tokenizer.kind == "gguf" and caps.tokenizer.path == str(tiny_gguf)
        assert 2 in caps.eos_token_ids and caps.context_length == CONTEXT
        ids = [w.request(link.Tokenize(text=p, add_special=True)).tokens.copy() for p in PROMPTS]
        assert all(len(i) > 1 for i in ids)
        assert w.request(link.Detokenize(tokens=ids[0][1:])).text.strip() == PROMPTS[0]  # BOS aside
        refs = [w.proc.prompt_ring.write(i) for i in ids]
        got, partial = [], {}
        for plan in plans(refs):
            events = w.tick(
                plan, on_emit=lambda e: partial.setdefault(e.lane_tag, []).extend(e.tokens.tolist())
            )
            got.append([w.proc.emit_ring.read(e.token_ref) for e in events.emits])
        assert w.ping().stats.get("live_lanes", 0) == 0
        geometry = {1: spec.prompt_ring, 2: spec.emit_ring, 3: spec.logits_ring}
    want = in_process_tokens(str(tiny_gguf), ids, geometry)
    assert [[t.tolist() for t in tick] for tick in got] == [[t.tolist() for t in tick] for tick in want]
    assert sum(len(t) for tick in got for t in tick) == 2 * (3 + 4 + 4)
    # The streamed ticks' partial emits carried exactly those ticks' tokens, per lane.
    for tag_index, tag in enumerate((11, 12)):
        assert partial[tag] == got[2][tag_index].tolist() + got[3][tag_index].tolist()


def test_llamacpp_without_model_exits_2_naming_the_flag(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "basertd.worker.main",
            "--link",
            f"ipc://{tmp_path}/x",
            "--engine",
            "llamacpp",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--model" in proc.stderr


def test_llamacpp_unloadable_model_exits_3(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "basertd.worker.main",
            "--link",
            f"ipc://{tmp_path}/x",
            "--engine",
            "llamacpp",
            "--model",
            str(bad),
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3 and str(bad) in proc.stderr
