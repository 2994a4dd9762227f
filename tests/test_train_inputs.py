"""`megatron-rl train` on bad user inputs: a bad data row, a missing column, an unknown or
ill-typed `tools_kwargs` entry, a tokenizer larger than the model's embedding and a bad prompt
template each end the command with exit code 2 and one line naming the file, row and field,
before any trainer rank or engine starts."""

from __future__ import annotations

import json
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.models.registry import get_model_spec
from tests.cli_run import cli_in_process
from tests.conversion_cases import save_random_hf

GOOD = {"data_source": "own", "prompt": [{"role": "user", "content": "Where was Kalo born?"}],
        "reward_model": {"ground_truth": "Marburg"}}


def _train(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """The checks end before any rank starts, so the command runs in this process."""
    return cli_in_process("train", "tiny-moe-rl-cpu", f"train.output_dir={tmp_path / 'run'}",
                          "checkpoint.dir=null", *overrides, cwd=tmp_path)


def _data(tmp_path) -> dict[str, str]:
    """A data file per kind of problem → the message it must give."""
    cases = {}
    (tmp_path / "bad_row.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(
        {**GOOD, "reward_model": {"ground_truth": ""}}) + "\n")
    cases["bad_row.jsonl"] = ("bad_row.jsonl line 2.reward_model.ground_truth: a non-empty "
                              "string or list of strings, got ['']")
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in GOOD.items() if k != "prompt"}]),
                   tmp_path / "no_prompt.parquet")
    cases["no_prompt.parquet"] = "no_prompt.parquet row 0: missing column 'prompt'"
    pq.write_table(pa.Table.from_pylist([{**GOOD, "tools_kwargs": {"python": {"x": 1}}}]),
                   tmp_path / "unknown_tool.parquet")
    cases["unknown_tool.parquet"] = ("unknown_tool.parquet row 0.tools_kwargs: ['python'] are "
                                     "not tools of this run (tools: search, visit)")
    pq.write_table(pa.Table.from_pylist([{**GOOD, "tools_kwargs": {"search": {"top_k": 99}}}]),
                   tmp_path / "bad_argument.parquet")
    cases["bad_argument.parquet"] = ("bad_argument.parquet row 0.tools_kwargs.search: argument "
                                     "'top_k' must be <= 20, got 99")
    return cases


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "[megatron-rl] RL:" not in proc.stdout  # no rank or engine was started
    return lines[0]


def test_bad_data_gives_one_line_naming_file_row_and_field(tmp_path):
    for name, message in _data(tmp_path).items():
        line = _one_line(_train(tmp_path, f"data.train_files=[{name}]"))
        assert line == f"megatron-rl: {message}", (name, line)
    # held-out files are checked too
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD) + "\n")
    line = _one_line(_train(tmp_path, "data.train_files=[good.jsonl]",
                            "data.val_files=[no_prompt.parquet]"))
    assert line == "megatron-rl: no_prompt.parquet row 0: missing column 'prompt'"


@pytest.fixture(scope="module")
def mismatched_hf(tmp_path_factory):
    """A tiny-moe folder whose tokenizer has 40 more ids than the embedding."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-moe"
    save_random_hf("tiny-moe", str(folder))
    tok = tiny_qwen3_tokenizer(vocab_size=get_model_spec("tiny-moe").vocab_size)
    tok.add_tokens([f"<extra_{i}>" for i in range(40)])
    tok.save_pretrained(folder)
    return folder


def test_a_mismatched_tokenizer_gives_one_line(tmp_path, mismatched_hf):
    vocab = get_model_spec("tiny-moe").vocab_size
    line = _one_line(_train(tmp_path, f"model.hf_path={mismatched_hf}"))
    assert line == (f"megatron-rl: model.hf_path='{mismatched_hf}': its tokenizer has "
                    f"{vocab + 40} tokens but the model's embedding holds {vocab} (a mismatched "
                    "tokenizer?)")


def test_a_bad_prompt_template_gives_one_line(tmp_path):
    line = _one_line(_train(tmp_path, "data.prompt_template=nope"))
    assert line.startswith("megatron-rl: config error: data.prompt_template='nope': no "
                           "template file ")
