"""``Replies.on_reply`` with nobody waiting: a late PONG (``Fleet.worker_stats`` waits 1 s, and a
worker in a long step between ticks, an embedding chunk, answers after it) is routine and logged
at debug; any other reply nobody waits for is a warning."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from basertd.schema import link
from basertd.schema.link import MsgType
from basertd.server.workers.link_replies import Replies


def test_a_late_pong_is_debug_and_other_late_replies_warn():
    replies = Replies(structlog.get_logger("test"))
    with capture_logs() as logs:
        assert replies.on_reply(link.Envelope(1, MsgType.PONG, 7, corr=3), link.Pong()) is None
        assert replies.on_reply(link.Envelope(1, MsgType.EMBED_RESULT, 8, corr=4), link.EmbedResult()) is None
    assert [(x["event"], x["log_level"], x["corr"]) for x in logs] == [
        ("late_reply", "debug", 3),
        ("late_reply", "warning", 4),
    ]
