"""The search service's reply is foreign text: a malformed result quoted in the tool's error is
redacted whole before it is cut, so a key that straddles the cut never leaks in part."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from megatron_rl.env.reliability import ReliabilityConfig
from megatron_rl.env.search import HttpSearch
from megatron_rl.utils.secrets import register_secret
from tests.test_env_remote import FakeServer, Reply, serving

KEY = "sk-search-SECRETKEY-0123456789abcd"  # a test value, echoed by a careless service
CUT = 200  # characters of a malformed result quoted in the error


@pytest.mark.parametrize("into_key", [4, 15, len(KEY) - 1])
def test_a_key_straddling_the_cut_of_a_malformed_result_never_leaks(caplog, capfd,
                                                                    into_key: int) -> None:
    register_secret(KEY)
    item = {"title": "t" * (CUT - 11 - into_key) + KEY + " tail"}  # no url: malformed
    assert str(item).index(KEY) + into_key == CUT
    fake = FakeServer()
    fake.on("/search", Reply(200, body={"results": [item]}))
    caplog.set_level(logging.DEBUG)

    async def go():
        async with serving(fake) as url:
            tool = HttpSearch(url, reliability=ReliabilityConfig(max_retries=0))
            result = await tool(query="q")
            await tool.close()
            return result

    result = asyncio.run(go())
    assert result.error == "search_error" and "malformed result" in result.detail
    assert "***" in result.detail
    texts = [json.dumps(result.to_dict()), result.content, caplog.text, capfd.readouterr().err]
    for prefix in (KEY[:n] for n in range(4, len(KEY) + 1)):
        leaked = [t for t in texts if prefix in t]
        assert not leaked, f"{prefix!r} leaked into {leaked[0][:400]!r}"
