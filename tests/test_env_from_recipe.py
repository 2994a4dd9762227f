"""Tools and judges from the recipe: a user corpus indexed with the CLI and searched through
`env.search.index`; verl prompts whose `tools_kwargs` must name the run's tools; a cache from
`env.cache`; the summarizer and the GenRM judge wired to an aux pool by name, served by a real
embedded engine over its OpenAI-compatible `/v1`."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.config.loader import ConfigError, load_config
from megatron_rl.data.parquet import DataError
from megatron_rl.engines.embedded import EmbeddedServer
from megatron_rl.models.registry import get_model_spec
from megatron_rl.records.trajectory import Trajectory, Turn
from megatron_rl.tasks import build_task
from tests.fakes import build_index_cli

CORPUS = [
    {"id": "1", "url": "https://w.test/zorvex", "title": "Zorvex Dynamics",
     "text": "Zorvex Dynamics is a company founded in 1990 by Kalo Mirtan."},
    {"id": "2", "url": "https://w.test/kalo", "title": "Kalo Mirtan",
     "text": "Kalo Mirtan was born in Marburg and founded Zorvex Dynamics."},
    {"id": "3", "url": "https://w.test/velt", "title": "Velt", "text": "The Velt is a river."},
]


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory):
    return build_index_cli(tmp_path_factory.mktemp("corpus"), CORPUS)


def _prompts(path, tools_kwargs):
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "user", "prompt": [{"role": "user", "content": "Where was Kalo born?"}],
        "reward_model": {"ground_truth": "Marburg"}, "extra_info": {"index": 0},
        "tools_kwargs": tools_kwargs}]), path)
    return path


def test_user_corpus_data_and_cache_from_the_recipe(corpus_index, tmp_path):
    data = _prompts(tmp_path / "train.parquet",
                    {"search": {"top_k": 3}, "visit": {"goal": "birthplace"}})
    cfg = load_config("tiny-moe-rl-cpu", [
        f"env.search.index={corpus_index}", f"env.cache={tmp_path / 'cache.sqlite'}",
        f"data.train_files=[{data}]", "rl.eval_every=0"])
    task = build_task(cfg, tiny_qwen3_tokenizer(), tmp_path)
    assert not list(tmp_path.glob("world-*")), "no generated world for a user corpus"
    first = next(task.prompts)
    assert (first.question, first.answer, first.uid) == ("Where was Kalo born?", "Marburg",
                                                         "train:0.e0")
    search, visit = task.agent.tools["search"], task.agent.tools["visit"]

    async def calls():
        hits = await search(query="Kalo Mirtan born")
        page = await visit(url="https://w.test/kalo", goal="where was he born")
        again = await visit(url="https://w.test/kalo", goal="where was he born")
        await task.aclose()
        return hits, page, again

    hits, page, again = asyncio.run(calls())
    assert hits.ok and hits.data[0]["url"] == "https://w.test/kalo"
    assert page.ok and "born in Marburg" in page.content and not page.cached
    assert again.cached and again.content == page.content  # env.cache served it
    # a tools_kwargs key that is no tool of the run fails at load, naming row and field
    bad = _prompts(tmp_path / "bad.parquet", {"search": {"top_k": 3}, "python": {"x": 1}})
    cfg = load_config("tiny-moe-rl-cpu", [f"env.search.index={corpus_index}",
                                          f"data.train_files=[{bad}]"])
    with pytest.raises(DataError, match=r"bad.parquet row 0.tools_kwargs: \['python'\] are not "
                                        r"tools of this run \(tools: search, visit\)"):
        build_task(cfg, tiny_qwen3_tokenizer(), tmp_path)


def test_env_section_errors_name_the_field():
    with pytest.raises(ConfigError, match="env.search.url: required with env.search.kind=http"):
        load_config("tiny-moe-rl-cpu", ["env.search.kind=http"])
    with pytest.raises(ConfigError, match="env.visit.summarizer: kind=chat needs base_url or "
                                          "pool"):
        load_config("tiny-moe-rl-cpu", ["env.visit.summarizer.kind=chat"])
    with pytest.raises(ConfigError, match="limits.max_retries=-1: must be >= 0"):
        load_config("tiny-moe-rl-cpu", ["env.search.limits.max_retries=-1"])
    with pytest.raises(ConfigError, match="env.cache: set env.cache or env.cache_url_env"):
        load_config("tiny-moe-rl-cpu", ["env.cache=x.db", "env.cache_url_env=PG_URL"])


def test_summarizer_and_judge_from_an_aux_pool_on_an_embedded_engine(corpus_index, tmp_path):
    spec = get_model_spec("tiny-moe")
    tokenizer = tiny_qwen3_tokenizer(vocab_size=spec.vocab_size)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
    server = EmbeddedServer(model, tokenizer, max_batch_size=4).start()
    try:
        aux = {"helpers": [server.url + "/v1"]}
        cfg = load_config("tiny-moe-rl-cpu", [
            f"env.search.index={corpus_index}", "env.visit.summarizer.kind=chat",
            "env.visit.summarizer.pool=helpers", "env.visit.summarizer.max_tokens=8",
            "rl.judge={kind: genrm, pool: helpers, max_tokens: 4, max_retries: 0}",
            "rl.eval_every=0"])
        task = build_task(cfg, tokenizer, tmp_path, aux)
        visit = task.agent.tools["visit"]
        assert visit.summarizer.base_urls == aux["helpers"]
        assert task.resources[0].client.config.base_url == aux["helpers"]
        busy = server.core.busy_seconds
        traj = Trajectory("u0", "g0", "Where was Kalo born?", reference="Marburg",
                          turns=[Turn("agent", [1], [2], [0.0], [0],
                                      text="<answer>Marburg</answer>")])

        async def run():
            page = await visit(url="https://w.test/kalo", goal="where was he born")
            await task.score([traj])
            await task.aclose()
            return page

        page = asyncio.run(run())
        # the engine generated both: the digest (any text from a random policy) and a reply
        # with no verdict line, so the judge fails (labelled) instead of guessing
        assert server.core.busy_seconds > busy
        assert page.ok and page.content, page
        assert "judge_error" in traj.labels and traj.metadata["judge"]["correct"] is None
    finally:
        server.stop()


def test_search_top_k_from_the_recipe_is_the_calls_default(corpus_index, tmp_path):
    """`env.search.top_k`: the results a call gets when it gives no `top_k` (and the default
    its schema shows the policy); a call's own `top_k` still wins."""
    data = _prompts(tmp_path / "train.parquet", {"visit": {"goal": "birthplace"}})
    cfg = load_config("tiny-moe-rl-cpu", [f"env.search.index={corpus_index}",
                                          "env.search.top_k=2", f"data.train_files=[{data}]"])
    task = build_task(cfg, tiny_qwen3_tokenizer(), tmp_path)
    search = task.agent.tools["search"]
    assert search.parameters["properties"]["top_k"]["default"] == 2

    async def calls():
        default = await search(query="Zorvex Kalo Velt river")
        three = await search(query="Zorvex Kalo Velt river", top_k=3)
        await task.aclose()
        return default, three

    default, three = asyncio.run(calls())
    assert len(default.data) == 2 and len(three.data) == 3
    assert "found 2 results" in default.content
    with pytest.raises(ConfigError, match="env.search.top_k"):
        load_config("tiny-moe-rl-cpu", ["env.search.top_k=0"])
