"""Every line of the daemon's log is JSON (README "Logs": ``journalctl -u basertd -o cat | jq``),
llama.cpp's own warnings included: a llama.cpp worker on the tiny sliding-window GGUF (its context
logs "using full-size SWA cache" as a warning) and the coordinator's tokenizer, which loads the same
file. The ``logging`` records become JSON lines through ``basertd.json_logs``."""

from __future__ import annotations

import json

from daemon_harness import Daemon


def test_every_line_of_a_llamacpp_daemons_log_is_json(tiny_gemma3_gguf):
    config = (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gemma3_gguf}"\n'
        "lanes = 2\ncontext_length = 128\nthreads = 1\n"
    )
    with Daemon(config) as d:
        with d.client() as c:
            assert list(c.stream("a b c", max_tokens=4, temperature=0))
        text = d.log_text()
    lines = [line for line in text[: text.rfind("\n")].splitlines() if line.strip()]  # whole lines
    plain = [line for line in lines if not line.startswith("{")]
    assert not plain, plain[:5]
    events = [json.loads(line) for line in lines]
    from_llamacpp = [e for e in events if e.get("logger") == "basertd.llamacpp"]
    levels = ("info", "warning", "error")
    assert from_llamacpp and all(e["level"] in levels for e in from_llamacpp), from_llamacpp
    # what the engine asked for (the full-size window cache) is not a warning
    swa = [e for e in from_llamacpp if "using full-size SWA cache" in e["event"]]
    assert swa and all(e["level"] == "info" for e in swa), swa
    assert all("timestamp" in e and e.get("worker_id") == 0 for e in from_llamacpp), from_llamacpp
