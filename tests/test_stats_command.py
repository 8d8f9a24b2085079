"""`evocache stats`: hits, misses, tokens and money saved per rule and tenant, from the access events a
deployment wrote (a JSONL file, or its Redis stream), over a span of time."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from evocache.cli.app import make_app
from evocache.controller import (
    CallHandle,
    EventsConfig,
    RedisConfig,
    StoreConfig,
    build_runtime,
    cache_if,
    tenant_scope,
)

SECRET = "a-test-secret-of-32-bytes-000000"


def traffic(config: StoreConfig) -> None:
    rt = build_runtime(config)

    @cache_if("true", store=rt, call_param="call")
    def answer(prompt: str, *, call: CallHandle) -> str:
        call.report_usage(tokens=100, cost=0.002, saved_tokens=10, saved_cost=0.0001)
        return prompt[::-1]

    for tenant, prompts in (("acme", ["a", "a", "a", "b"]), ("globex", ["a"])):
        with tenant_scope(tenant):
            for prompt in prompts:
                answer.call(prompt)
    rt.close()  # flushes the events


def run(*args: str):
    return CliRunner().invoke(make_app(), ["stats", *args])


def test_stats_from_an_event_file_per_tenant_with_what_was_saved(tmp_path):
    events = tmp_path / "events.jsonl"
    traffic(StoreConfig(events=EventsConfig(sink="jsonl", path=str(events))))
    done = run("--events", str(events), "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    acme, globex = report["rows"]
    assert (acme["ns"], acme["calls"], acme["hits"], acme["misses"], acme["hit_ratio"]) == ("acme", 4, 2, 2, 0.5)
    # Two misses saved what the engine reused (10 tokens each), two hits their answers (100 tokens each).
    assert acme["tokens_saved"] == 220 and round(acme["cost_saved"], 6) == 0.0042
    assert (globex["calls"], globex["tokens_saved"]) == (1, 10)
    assert report["total"]["calls"] == 5
    table = run("--events", str(events))
    assert table.exit_code == 0 and "acme" in table.output and "50.0%" in table.output
    later = json.loads(run("--events", str(events), "--since", "2999-01-01T00:00", "--json").output)
    assert later["rows"] == [] and later["total"]["calls"] == 0
    assert json.loads(run("--events", str(events), "--since", "1h", "--json").output)["total"]["calls"] == 5


def test_stats_from_a_redis_stream(redis_url):
    traffic(StoreConfig(redis=RedisConfig(url=redis_url, secret=SECRET), events=EventsConfig(sink="redis")))
    done = run("--redis", redis_url, "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["total"]["hits"] == 2


def test_bad_input_is_a_usage_error_naming_it(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"v": 2, "t": 1}\n')
    for args, named in ((("--events", str(broken)), "broken.jsonl:1"), ((), "--events"),
                        (("--events", str(tmp_path / "none.jsonl")), "none.jsonl"),
                        (("--events", str(broken), "--since", "yesterday"), "--since")):
        done = run(*args)
        assert done.exit_code == 2 and named in done.output, (args, done.output)
