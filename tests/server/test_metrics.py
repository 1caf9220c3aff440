"""/metrics in the Prometheus text format, one registry per app."""

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory
from tests.server.helpers import CHAT


def scrape(client, **kw) -> dict:
    resp = client.get("/metrics", **kw)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_requests_tokens_and_speed_are_counted(client):
    reply = client.post("/v1/chat/completions", json=CHAT).json()
    client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    client.post("/v1/chat/completions", json={**CHAT, "temperature": 9})
    client.get("/v1/no/such/path/123")
    m = scrape(client)
    chat = "/v1/chat/completions"
    assert value(m, "duet_requests_total", endpoint=chat, method="POST", status="200") == 2
    assert value(m, "duet_requests_total", endpoint=chat, method="POST", status="400") == 1
    # Unknown paths share one series, whatever the path.
    assert value(m, "duet_requests_total", endpoint="unmatched", method="GET", status="404") == 1
    tiny = {"model": "tiny", "engine": "torch"}
    completion = reply["usage"]["completion_tokens"]
    assert value(m, "duet_tokens_total", kind="completion", **tiny) == 2 * completion
    assert value(m, "duet_tokens_total", kind="prompt", **tiny) == 2 * reply["usage"]["prompt_tokens"]
    assert value(m, "duet_time_to_first_token_seconds_count", **tiny) == 2
    assert value(m, "duet_decode_tokens_per_second_count", **tiny) == 2
    assert value(m, "duet_engine_queue_depth", **tiny) == 0
    assert value(m, "duet_process_resident_memory_bytes") > 10_000_000
    assert value(m, "duet_queue_seconds_count", **tiny) == 2
    assert ("duet_engine_kv_cache_bytes", tuple(sorted(tiny.items()))) in m
    assert ("duet_generation_kv_cache_bytes", tuple(sorted(tiny.items()))) in m
    assert value(m, "duet_engine_kv_cache_used_bytes", **tiny) == 0  # nothing running now
    assert ("duet_engine_batch_size", tuple(sorted(tiny.items()))) in m
    # The engine's process is this one (an in-process engine): a collection counts at once.
    import gc

    oldest = value(m, "duet_engine_gc_oldest_collections_total", **tiny)
    paused = value(m, "duet_engine_gc_pause_seconds_total", **tiny)
    gc.collect()
    m = scrape(client)
    assert value(m, "duet_engine_gc_oldest_collections_total", **tiny) == oldest + 1
    assert value(m, "duet_engine_gc_pause_seconds_total", **tiny) > paused


def test_each_app_has_its_own_registry(make_client):
    with make_client() as a, make_client() as b:
        a.post("/v1/chat/completions", json=CHAT)
        chat = {"endpoint": "/v1/chat/completions", "method": "POST", "status": "200"}
        assert value(scrape(a), "duet_requests_total", **chat) == 1
        assert value(scrape(b), "duet_requests_total", **chat) == 0


def test_metrics_need_the_key_when_keys_are_set(make_client):
    with make_client(api_keys=["k"]) as client:
        assert client.get("/metrics").status_code == 401
        m = scrape(client, headers={"Authorization": "Bearer k"})
        # Refused before routing, yet counted under its endpoint.
        assert value(m, "duet_requests_total", endpoint="/metrics", method="GET", status="401") == 1


def test_queue_depth_shows_waiting_requests(models_file):
    factory = FakeFactory(token_delay_s=0.05, reply="z" * 20)
    app = create_app(Settings(models_file=models_file), factory)

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            jobs = [asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)) for _ in range(3)]
            await asyncio.sleep(0.3)
            during = scrape_text(await client.get("/metrics"))
            await asyncio.gather(*jobs)
            after = scrape_text(await client.get("/metrics"))
            return during, after

    def scrape_text(resp):
        return {s.name + str(sorted(s.labels.items())): s.value
                for f in text_string_to_metric_families(resp.text) for s in f.samples}

    with LiveServer(app) as server:
        during, after = asyncio.run(main(server.url))
    key = "duet_engine_queue_depth" + str(sorted({"model": "tiny", "engine": "torch"}.items()))
    assert during[key] == 3 and after[key] == 0
