"""verl-schema prompt files: the documented layouts load as they are, curriculum order, and
every bad file, row or field is one error that names it."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data.parquet import DataError, read_prompts

SYSTEM = "You are a research agent. Tools: search(query), visit(url, goal)."

# verl's documented RL layout (examples/data_preprocess): ground truth a plain string
VERL_ROW = {"data_source": "nq", "prompt": [{"role": "user", "content": "Who wrote Dune?"}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": "Frank Herbert"},
            "extra_info": {"split": "train", "index": 0}}
# LiteResearcher-style: a system prompt with tools, nested target (a list), tools_kwargs
LITE_ROW = {"data_source": "lite/webwalker",
            "prompt": [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": "Where was the founder of Zorvex born?"}],
            "ability": "deep-research",
            "reward_model": {"style": "llm", "ground_truth": {"target": ["Marburg", "Marbourg"]}},
            "extra_info": {"index": 7, "bucket": 2},
            "tools_kwargs": {"search": {"top_k": 5}, "visit": {}}}
# IterSynth-style: the question inside extra_info too, difficulty instead of bucket
ITER_ROW = {"data_source": "itersynth/multihop",
            "prompt": [{"role": "user", "content": "Which river runs through the capital?"}],
            "ability": "multi-hop",
            "reward_model": {"style": "rule", "ground_truth": "Velt"},
            "extra_info": {"index": 3, "difficulty": 1, "question": "Which river ...",
                           "answer": "Velt"}}


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_documented_layouts_load_as_they_are(tmp_path):
    verl = _parquet(tmp_path / "verl.parquet", [VERL_ROW])
    lite = tmp_path / "lite.jsonl"
    lite.write_text(json.dumps(LITE_ROW) + "\n")
    iters = _parquet(tmp_path / "iter.parquet", [ITER_ROW])
    a, b, c = read_prompts([verl, lite, iters], tool_names=["search", "visit"])
    assert (a.question, a.answer, a.uid) == ("Who wrote Dune?", "Frank Herbert", "verl:0")
    assert a.messages == VERL_ROW["prompt"] and a.metadata["data_source"] == "nq"
    assert b.question == "Where was the founder of Zorvex born?"
    assert json.loads(b.answer) == ["Marburg", "Marbourg"]  # a JSON list: any of them
    assert b.messages[0] == {"role": "system", "content": SYSTEM} and b.uid == "lite:7"
    assert b.metadata["tools_kwargs"] == {"search": {"top_k": 5}, "visit": {}}
    assert (c.answer, c.uid, c.metadata["extra_info"]["difficulty"]) == ("Velt", "iter:3", 1)


def test_bucket_curriculum_walks_buckets_in_order(tmp_path):
    rows = [dict(VERL_ROW, extra_info={"index": i, "bucket": b}) for i, b in
            enumerate([2, 0, 1, 0, 2])]
    f = _parquet(tmp_path / "c.parquet", rows)
    assert [p.uid for p in read_prompts([f])] == [f"c:{i}" for i in range(5)]
    ordered = read_prompts([f], curriculum="bucket")
    assert [p.metadata["extra_info"]["bucket"] for p in ordered] == [0, 0, 1, 2, 2]
    assert [p.uid for p in ordered] == ["c:1", "c:3", "c:2", "c:0", "c:4"]  # stable


@pytest.mark.parametrize("row,message", [
    ({k: v for k, v in VERL_ROW.items() if k != "prompt"}, r"row 0: missing column 'prompt'"),
    ({k: v for k, v in VERL_ROW.items() if k != "reward_model"},
     r"row 0: missing column 'reward_model'"),
    (dict(VERL_ROW, prompt=[{"role": "wizard", "content": "x"}]), r"row 0\.prompt\[0\]: a message"),
    (dict(VERL_ROW, prompt=[{"role": "system", "content": "x"}]),
     r"row 0\.prompt: no user message"),
    (dict(VERL_ROW, reward_model={"ground_truth": ""}),
     r"row 0\.reward_model\.ground_truth: a non-empty string"),
    (dict(VERL_ROW, reward_model={"ground_truth": {"answer": "x"}}),
     r"row 0\.reward_model\.ground_truth: a mapping needs a 'target' key"),
    (dict(VERL_ROW, reward_model={"ground_truth": {"target": [1, 2]}}),
     r"row 0\.reward_model\.ground_truth\.target: a non-empty string or list"),
    (dict(VERL_ROW, tools_kwargs={"search": {}, "browse": {}}),
     r"row 0\.tools_kwargs: \['browse'\] are not tools of this run \(tools: search, visit\)"),
    (dict(VERL_ROW, extra_info={"tools_kwargs": {"python": {}}}),
     r"row 0\.tools_kwargs: \['python'\] are not tools"),
    (dict(VERL_ROW, extra_info=[1, 2]), r"row 0\.extra_info: a mapping"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, row, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(VERL_ROW) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"{f}" + message.replace("row 0", " line 2")):
        read_prompts([f], tool_names=["search", "visit"])


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        read_prompts([tmp_path / "missing.parquet"])
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=f"{broken}: not a readable parquet file"):
        read_prompts([broken])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=f"{latin} line 1: not UTF-8"):
        read_prompts([latin])
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text(json.dumps(VERL_ROW) + "\n{not json\n")
    with pytest.raises(DataError, match=f"{garbage} line 2: not JSON"):
        read_prompts([garbage])
    dup = tmp_path / "dup.jsonl"
    dup.write_text((json.dumps(VERL_ROW) + "\n") * 2)
    with pytest.raises(DataError, match=r"dup.jsonl line 2: uid 'dup:0' repeats"):
        read_prompts([dup])
    csv = tmp_path / "x.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataError, match=f"{csv}: data files are .parquet or .jsonl"):
        read_prompts([csv])
