"""Hostile grammar specs against a real daemon (DESIGN.md "Client API"): nothing a request carries
runs unbounded on the coordinator's event loop, and a spec that crashes llguidance costs only that
request.

- A Lark chain of 3,000 rules and a Lark ``%json`` whose schema is a 3,000-long ``$ref`` chain
  overflow llguidance's native stack (SIGSEGV). They compile in a child process: a 400 naming the
  crash on the native API and on OpenAI's, counted in ``basertd_sandbox_jobs_failed_total``, the
  same spec again answered from the cache (no second crash), and the daemon serves on.
- One OpenAI request of 2 prompts x n=16 under a large pattern schema compiles it once
  (``basertd_grammar_compiles_total``), while probes on other connections (native Health, HTTP
  ``/health``, a native generation on another worker) answer in under a second.
- A regex for a worker that compiles JSON schemas only (the reference engine) is a 400 at
  admission, not a 500 from the worker's GRAMMAR_CREATE.

``pytest -s`` prints the probe latencies measured during the hostile requests.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import openai
import pytest
from daemon_harness import Daemon

from basertd.client import ClientError
from basertd.schema.client import ErrorCode

CHAIN = 3000
"""Rules (or ``$ref``s) in a chain: deep enough to overflow an 8 MiB native stack."""


def lark_chain(n: int = CHAIN) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def json_ref_chain_lark(n: int = CHAIN) -> str:
    defs: dict[str, dict] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return "start: %json " + json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}) + "\n"


def pattern_schema(n: int) -> dict:
    """An object of ``n`` optional pattern-constrained strings: slow to compile, ``{}`` is valid."""
    props = {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"} for i in range(n)}
    return {"type": "object", "properties": props, "additionalProperties": False}


@pytest.fixture(scope="module")
def daemon(tiny_gguf):
    cfg = (
        f'[[workers]]\nengine = "llamacpp"\nmodel = "{tiny_gguf}"\n'
        "lanes = 4\ncontext_length = 256\nthreads = 1\n"
        '[[workers]]\nengine = "basert"\nlanes = 2\ncontext_length = 256\n'
        "[scheduler]\nqueue_limit = 1000\n"
        '[http]\nlisten = ["127.0.0.1:0"]\n'
    )
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        with urllib.request.urlopen(d.http_url + "/v1/models", timeout=30) as r:
            ids = [m["id"] for m in json.load(r)["data"]]
        d.llama_model = next(i for i in ids if "tiny" in i)
        d.ref_model = next(i for i in ids if i != d.llama_model)
        yield d


@pytest.fixture(scope="module")
def oai(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def metric(d: Daemon, name: str, labels: str = "") -> float:
    """The value of one series of ``/metrics`` (0 when absent)."""
    with urllib.request.urlopen(d.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


CRASHES = ("basertd_sandbox_jobs_failed_total", '{pool="grammar",reason="crash"}')


@pytest.mark.parametrize("spec", [lark_chain(), json_ref_chain_lark()], ids=["lark_chain", "json_ref_chain"])
def test_a_spec_that_crashes_the_compiler_is_a_400_and_the_daemon_serves_on(daemon, oai, spec):
    crashes = metric(daemon, *CRASHES)
    with daemon.client() as c:
        with pytest.raises(ClientError) as info:
            c.generate("x", max_tokens=4, grammar=spec, model=daemon.llama_model)
        assert info.value.code == ErrorCode.INVALID_REQUEST and "crashed" in info.value.message, info.value
        assert metric(daemon, *CRASHES) == crashes + 1  # reported
        with pytest.raises(openai.BadRequestError, match="crashed"):  # the cached verdict: no second crash
            oai.completions.create(
                model=daemon.llama_model, prompt="x", max_tokens=4, extra_body={"grammar": spec}
            )
        assert metric(daemon, *CRASHES) == crashes + 1
        out = c.generate("x", max_tokens=3, temperature=0, grammar='start: "ab"+', model=daemon.llama_model)
        assert out.text.startswith("ab")
        assert c.generate("hello", max_tokens=2, model=daemon.ref_model).finish_reason == "length"
    with urllib.request.urlopen(daemon.http_url + "/health", timeout=30) as r:
        assert json.load(r)["status"] == "ok"


class Probes:
    """Native Health, HTTP ``/health`` and a two-token native generation on the reference worker,
    one after another on their own connections until stopped; ``worst`` latency in seconds."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.latencies: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self.d.client() as c:
                while not self._stop.is_set():
                    for probe in (
                        c.health,
                        lambda: urllib.request.urlopen(self.d.http_url + "/health", timeout=30).read(),
                        lambda: c.generate("probe", max_tokens=2, model=self.d.ref_model),
                    ):
                        t = time.monotonic()
                        probe()
                        self.latencies.append(time.monotonic() - t)
                    self._stop.wait(0.05)
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Probes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self.errors, self.errors

    @property
    def worst(self) -> float:
        return max(self.latencies)


def test_one_compile_heavy_spec_times_many_choices_compiles_once_and_probes_stay_fast(daemon, oai):
    schema = pattern_schema(400)
    compiles = metric(daemon, "basertd_grammar_compiles_total")
    with Probes(daemon) as probes:
        t = time.monotonic()
        out = oai.completions.create(
            model=daemon.llama_model,
            prompt=["first", "second"],
            n=16,
            max_tokens=2,
            temperature=0,
            extra_body={
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
            },
        )
        took = time.monotonic() - t
        time.sleep(0.3)  # a few probes after it, too
    assert len(out.choices) == 32 and all(c.text.startswith("{") for c in out.choices)
    print(
        f"\n2 prompts x n=16, 400-property pattern schema: {took:.2f} s; {len(probes.latencies)} probes, "
        f"worst {probes.worst * 1000:.0f} ms"
    )
    assert len(probes.latencies) >= 3 and probes.worst < 1.0, probes.latencies
    assert metric(daemon, "basertd_grammar_compiles_total") == compiles + 1


def test_a_regex_for_a_worker_that_compiles_json_schemas_only_is_a_400_at_admission(daemon):
    with daemon.client() as c:
        for fields in ({"regex": "(a*)*b"}, {"grammar": 'start: "a"+'}):
            with pytest.raises(ClientError) as info:
                c.generate("x", max_tokens=4, model=daemon.ref_model, **fields)
            assert info.value.code == ErrorCode.INVALID_REQUEST, info.value
            assert "compiles only json_schema" in info.value.message, info.value
        fmt = {"type": "json_object"}
        assert c.generate("x", max_tokens=2, model=daemon.ref_model, response_format=fmt).finish_reason
    w = [w for w in daemon.workers() if w.engine == "basert"]
    assert w and w[0].queue_depth == 0 and w[0].lanes_busy == 0
