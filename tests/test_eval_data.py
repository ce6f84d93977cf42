"""Eval text from a `datasets` dataset: local files only, the rows joined, the content in the
job id, and errors that name the field."""

from __future__ import annotations

import json

import pytest

from quantdask.demo_model import DEMO_EVAL_TEXT
from quantdask.errors import SpecError
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def rows() -> list[str]:
    """The demo eval text as dataset rows: one paragraph of ten lines each."""
    with open(DEMO_EVAL_TEXT, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return ["\n".join(lines[i:i + 10]) for i in range(0, len(lines), 10)]


def with_eval(tmp_path, **evaluation):
    data = sweep_dict()
    data["eval"] = {"seq_len": 32, "samples": 8, **evaluation}
    return sweep_from_dict(data, root=str(tmp_path))


def test_a_parquet_dataset_is_its_rows_joined_and_ids_follow_the_content(tmp_path, rows):
    import polars as pl

    pl.DataFrame({"text": rows, "n": range(len(rows))}).write_parquet(tmp_path / "eval.parquet")
    sweep = with_eval(tmp_path, dataset={"path": "parquet", "data_files": "eval.parquet",
                                         "split": "train"})
    assert sweep.eval.read_text() == "\n\n".join(rows)
    assert "dataset parquet (eval.parquet), split train, column text" == sweep.eval.source
    # The same text from a file: the same jobs (the id holds the content's hash, not its source).
    (tmp_path / "eval.txt").write_text("\n\n".join(rows), encoding="utf-8")
    from_file = with_eval(tmp_path, text="eval.txt")
    assert [j.id for j in expand_grid(sweep)] == [j.id for j in expand_grid(from_file)]


def test_a_json_lines_dataset_with_another_column_runs_a_job(tmp_path, rows):
    from quantdask.backends import get_backend
    from quantdask.job.job import run_job

    with open(tmp_path / "eval.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"content": row, "source": "demo"}) + "\n")
    sweep = with_eval(tmp_path, dataset={"path": "json", "data_files": ["eval.jsonl"],
                                         "split": "train", "column": "content"})
    job = next(j for j in expand_grid(sweep) if not j.is_baseline)
    record = run_job(job, get_backend(job.backend)).record  # its reference from the dataset's text
    assert record["status"] == "done" and record["eval_tokens"] == 8 * 31
    text_job = next(j for j in expand_grid(with_eval(tmp_path, text=DEMO_EVAL_TEXT))
                    if not j.is_baseline)
    assert text_job.id != job.id  # other text (rows joined by blank lines): another job


@pytest.mark.parametrize("dataset, field, words", [
    ({"path": "parquet", "data_files": "eval.parquet", "split": "train", "column": "body"},
     "eval.dataset.column", "has no column 'body'; its columns: text, n"),
    ({"path": "parquet", "data_files": "missing.parquet", "split": "train"},
     "eval.dataset.data_files[0]", "no file at"),
    ({"path": "wikitext", "name": "wikitext-2-raw-v1", "split": "test"},
     "eval.dataset", "Nothing is downloaded"),
    ({"split": "test"}, "eval.dataset.path", "is required"),
    ({"path": "parquet", "files": "x"}, "eval.dataset.files", "unknown key"),
])
def test_a_bad_dataset_names_the_field(tmp_path, rows, dataset, field, words):
    import polars as pl

    pl.DataFrame({"text": rows, "n": range(len(rows))}).write_parquet(tmp_path / "eval.parquet")
    with pytest.raises(SpecError) as err:
        with_eval(tmp_path, dataset=dataset)
    assert err.value.field == field and words in str(err.value)


def test_the_eval_text_comes_from_a_file_or_a_dataset_never_both(tmp_path):
    for evaluation in ({}, {"text": DEMO_EVAL_TEXT, "dataset": {"path": "parquet"}}):
        with pytest.raises(SpecError, match="one of the two") as err:
            with_eval(tmp_path, **evaluation)
        assert err.value.field == "eval.text"


def test_a_dataset_missing_here_is_refused_at_once_where_datasets_was_imported_online(
        monkeypatch):
    # lm-eval imports `datasets` before quantdask could set HF_DATASETS_OFFLINE: the missing
    # dataset was then looked up on the Hub (five retries, 23 s) before the refusal.
    import datasets

    from quantdask.sweepfile import text_source

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(SpecError, match="OfflineModeIsEnabled.*Nothing is downloaded"):
        text_source._load.__wrapped__("wikitext", "wikitext-2-raw-v1", "test", (), "text")
    assert datasets.config.HF_HUB_OFFLINE
