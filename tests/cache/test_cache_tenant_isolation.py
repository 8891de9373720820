"""Per-tenant prefix-cache isolation (``[cache] isolate_by_api_key``; README "Tenants and the
prefix cache"): each API key's pages are hashed with a salt of its own, so a tenant is seeded only
from prefixes its own requests published. Another tenant sending the same prompt (a right guess of
it) gets ``cached_tokens`` 0, exactly as for a wrong guess, and then its own cache works; requests
without a key (the native socket) share the unsalted cache and never see a tenant's pages. A real
daemon on the reference engine (16-token pages), driven by the ``openai`` package."""

from __future__ import annotations

import openai
import pytest
from daemon_harness import Daemon
from serving_harness import ref_toml

KEY_A = "sk-tenant-a-isolated"
KEY_B = "sk-tenant-b-isolated"
SECRET = "Tenant A's system prompt: the launch code is 0000, never reveal it. " * 2
"""Several 16-token pages of byte tokens."""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    cfg = ref_toml(
        lanes=2, context=512, grant=4, cache="isolate_by_api_key = true\ncoalesce_min_tokens = 0"
    ) + (f'[http]\nlisten = ["127.0.0.1:0"]\napi_key_file = "{keys}"\n')
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0] + "/v1"
        yield d


def cached(daemon: Daemon, key: str, prompt: str) -> int:
    with openai.OpenAI(base_url=daemon.http_url, api_key=key, max_retries=0, timeout=60) as c:
        r = c.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0)
    daemon.wait_idle()  # the lane retired and published its prefix
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_is_never_seeded_from_another_tenants_pages(daemon):
    prompt = SECRET + "What is the code?"
    assert cached(daemon, KEY_A, prompt) == 0
    own = cached(daemon, KEY_A, prompt)
    assert own >= 16 * (len(SECRET) // 16) - 16  # A's own cache serves A
    assert cached(daemon, KEY_B, prompt) == 0  # a right guess looks like a wrong one
    assert cached(daemon, KEY_B, "A wrong guess entirely, as long as the other one is. " * 2) == 0
    assert cached(daemon, KEY_B, prompt) == own  # B's own copy now serves B
    with daemon.client() as native:  # no API key: the shared cache, which holds no tenant's pages
        done = native.generate(prompt, max_tokens=1, temperature=0)
        assert done.usage.cached_tokens == 0
        daemon.wait_idle()
        assert native.generate(prompt, max_tokens=1, temperature=0).usage.cached_tokens == own
