"""The search service over real HTTP: in-process with the client tools, and the CLI process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from megatron_rl.data.world import build_world_index, generate_world
from megatron_rl.env.index import SearchIndex
from megatron_rl.env.search import HttpSearch, LocalSearch
from megatron_rl.env.service import start_service
from megatron_rl.env.visit import HttpPages, LocalPages, Visit

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world():
    return generate_world(1000, seed=3)


@pytest.fixture(scope="module")
def index_dir(world, tmp_path_factory) -> Path:
    return build_world_index(world, tmp_path_factory.mktemp("env_service"), "jsonl")


def test_service_matches_local_tools(world, index_dir):
    index = SearchIndex(index_dir)
    qs = world.questions(24, seed=1)

    async def go() -> None:
        runner, url = await start_service(index)
        try:
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
            remote, local = HttpSearch(url), LocalSearch(index)
            # many rollout workers at once
            got = await asyncio.gather(*(remote(query=q.question, top_k=4) for q in qs))
            want = [await local(query=q.question, top_k=4) for q in qs]
            assert all(r.ok for r in got)
            assert [r.data for r in got] == [r.data for r in want]
            assert [r.content for r in got] == [r.content for r in want]
            assert all(q.support[0] in [h["url"] for h in r.data] for q, r in zip(qs, got))

            page_url = qs[0].support[1]
            v_remote = await Visit(HttpPages(url))(url=page_url, goal="birth")
            v_local = await Visit(LocalPages(index))(url=page_url, goal="birth")
            assert v_remote.ok and v_remote.content == v_local.content
            missing = await Visit(HttpPages(url))(url="https://nowhere.test/")
            assert (missing.error, missing.attempts) == ("visit_error", 1), "404: no retry"
            assert "HTTP 404" in missing.detail

            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as r:
                    health = await r.json()
                assert health == {"ok": True, "docs": 1000, "index_id": index.id}
                for body in ({"query": ""}, {"query": "x", "top_k": 0}, {"top_k": 3},
                             {"query": "x", "top_k": True}, [1, 2]):
                    async with s.post(url + "/search", json=body) as r:
                        assert r.status == 400 and "error" in await r.json(), body
                async with s.post(url + "/search", data=b"{nope") as r:
                    assert r.status == 400
                async with s.post(url + "/visit", json={"url": 3}) as r:
                    assert r.status == 400
            await remote.close()
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_cli_serve_on_a_free_port(index_dir):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "search", "serve",
                             "--index", str(index_dir), "--port", "0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and "serving" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"serve exited: {proc.stderr.read()}")
        m = re.search(r"\(1000 docs\) on (http://127\.0\.0\.1:\d+)$", line.strip())
        assert m, line
        result = asyncio.run(HttpSearch(m.group(1))(query="university", top_k=2))
        assert result.ok and len(result.data) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
    assert rc == 0


def test_cli_serve_rejects_a_non_index(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "search", "serve", "--index",
                        str(tmp_path), "--port", "0"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "not a search index" in r.stderr
