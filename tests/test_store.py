"""The results schema and the run directory: atomic per-job files read back as one frame."""

from __future__ import annotations

import datetime as dt
import os

import polars as pl
import pytest

from quantdask.errors import RunDirError, SchemaError
from quantdask.store.readers import read_results, read_windows
from quantdask.store.run_store import RunStore
from quantdask.store.schema import RESULT_SCHEMA
from quantdask.store.summary import job_status
from quantdask.store.validation import records_to_frame, validate_record

pytestmark = pytest.mark.timeout(60)

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


def done_record(job_id: str = "bitsandbytes-0000000000000001", **overrides) -> dict:
    record = dict(
        job_id=job_id, sweep="s", model="m", backend="bitsandbytes", config='{"bits": 4}',
        config_label="nf4", status="done", attempts=1, priority=0, worker="0", host="h",
        device="cpu", queued_at=NOW, started_at=NOW, finished_at=NOW, wall_s=1.0, load_s=0.1,
        quantize_s=0.2, eval_s=0.3, source_cached=True, peak_device_mem_bytes=10,
        peak_device_reserved_bytes=10, peak_host_rss_bytes=10, param_count=100, size_bytes=60,
        bits_per_weight=4.8, quantized_bytes=50, bits_per_quantized_weight=50 * 8 / 90,
        unquantized_bytes=10, unquantized_dtypes="float32 100%", quantized_params=90,
        quantized_share=0.9, perplexity=2.5,
        kl_divergence=0.01, kl_tail_mass=0.001, top1_agreement=0.95, eval_tokens=100,
        kl_kind="estimate", kl_median=0.005, kl_p90=0.02, kl_p99=0.05, kl_p999=0.1, kl_max=0.2,
        top1_agreement_se=0.02, delta_p_mean=-0.001, delta_p_rms=0.01, delta_p_p01=-0.03,
        delta_p_p05=-0.01, delta_p_median=0.0, delta_p_p95=0.01, delta_p_p99=0.03,
        ln_ppl_ratio=0.004,
    )
    record.update(overrides)
    return record


def record_done(store: RunStore, job_id: str) -> None:
    """What the scheduler writes for a done job: its layer rows, then its result."""
    store.write_job_rows("layers", job_id, [])
    store.write_job_rows("windows", job_id, [])
    store.write_result(done_record(job_id))


def test_done_record_round_trips_with_the_full_schema(tmp_path):
    store = RunStore(tmp_path / "run").create()
    store.write_result(done_record())
    frame = read_results(tmp_path / "run")
    assert frame.schema == pl.Schema(RESULT_SCHEMA)
    assert frame.height == 1
    assert frame.row(0, named=True)["perplexity"] == 2.5
    assert frame.row(0, named=True)["finished_at"] == NOW


def test_a_baseline_record_has_no_bits_per_quantized_weight(tmp_path):
    store = RunStore(tmp_path).create()
    store.write_result(done_record(
        backend="baseline", quantized_params=0, quantized_share=0.0, quantized_bytes=0,
        bits_per_quantized_weight=None, unquantized_bytes=60))  # nothing quantized: null
    row = read_results(tmp_path).row(0, named=True)
    assert row["bits_per_quantized_weight"] is None and row["unquantized_bytes"] == 60


@pytest.mark.parametrize("change, message", [
    ({"perplexity": None}, "lacks perplexity"),
    ({"unquantized_dtypes": None}, "lacks unquantized_dtypes"),
    ({"quantized_bytes": None, "unquantized_bytes": None},
     "lacks quantized_bytes, unquantized_bytes"),
    ({"size_bytes": "60"}, "size_bytes must be Int64"),
    ({"attempts": True}, "attempts must be Int64"),
    ({"finished_at": NOW.replace(tzinfo=None)}, "timezone-aware"),
    ({"status": "finished"}, "status must be one of"),
    ({"speed": 3.0}, "unknown result columns: speed"),
])
def test_records_that_do_not_fit_the_schema_are_rejected(change, message, tmp_path):
    store = RunStore(tmp_path).create()
    with pytest.raises(SchemaError, match=message):
        store.write_result(done_record(**change))
    assert list(store.results_dir.iterdir()) == []


def test_failed_and_skipped_need_a_reason_not_metrics():
    failed = {k: v for k, v in done_record(status="failed").items() if k not in
              ("perplexity", "size_bytes", "wall_s")}
    with pytest.raises(SchemaError, match="failure_class, error_class, error_message"):
        validate_record(failed)
    with pytest.raises(SchemaError, match="failure_class must be one of"):
        validate_record({**failed, "failure_class": "bad luck", "error_class": "RuntimeError",
                         "error_message": "boom"})
    ok = validate_record({**failed, "failure_class": "job_error", "error_class": "RuntimeError",
                          "error_message": "boom"})
    assert ok["perplexity"] is None and ok["error_class"] == "RuntimeError"


def test_write_is_atomic_and_replaces_the_previous_result(tmp_path):
    store = RunStore(tmp_path).create()
    store.write_result(done_record(status="failed", failure_class="job_error", error_class="E",
                                   error_message="m"))
    store.write_result(done_record())
    names = [p.name for p in store.results_dir.iterdir()]
    assert names == ["bitsandbytes-0000000000000001.parquet"]
    assert read_results(tmp_path)["status"].to_list() == ["done"]


def test_a_write_that_dies_halfway_keeps_the_previous_result(tmp_path, monkeypatch):
    store = RunStore(tmp_path).create()
    store.write_result(done_record(perplexity=2.5))
    real_write = pl.DataFrame.write_parquet

    def crash_halfway(frame, file, *args, **kwargs):
        real_write(frame, file, *args, **kwargs)
        file.truncate(10)  # part of the bytes reached the disk, then the process "died"
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", crash_halfway)
    with pytest.raises(OSError):
        store.write_result(done_record(perplexity=9.9))
    assert os.listdir(store.results_dir) == ["bitsandbytes-0000000000000001.parquet"]
    assert read_results(tmp_path)["perplexity"].to_list() == [2.5]


def test_a_damaged_result_is_set_aside_and_its_job_runs_again(tmp_path):
    store = RunStore(tmp_path).create()
    record_done(store, "a")
    record_done(store, "b")
    (store.results_dir / "b.parquet").write_bytes(b"PAR1 torn write")
    (store.results_dir / ".a.parquet.x.tmp").write_bytes(b"left by a crash")
    assert read_results(tmp_path)["job_id"].to_list() == ["a"]  # readable rows still read
    with store.lock():
        moved = store.set_aside_unreadable()
    assert [p.name.split(".unreadable-")[0] for p in moved] == ["b.parquet"]
    assert sorted(os.listdir(store.results_dir))[0] == "a.parquet"
    assert not any(n.endswith(".tmp") for n in os.listdir(store.results_dir))
    assert store.finished_job_ids() == {"a"}


def test_results_from_an_older_version_read_with_nulls_and_are_measured_again(tmp_path):
    store = RunStore(tmp_path).create()
    old = records_to_frame([done_record("old")]).drop("kl_divergence", "top1_agreement")
    old.write_parquet(store.results_dir / "old.parquet")
    store.write_job_rows("layers", "old", [])
    record_done(store, "new")
    frame = read_results(tmp_path)
    assert frame.schema == pl.Schema(RESULT_SCHEMA)
    assert frame.filter(pl.col("job_id") == "old")["kl_divergence"].to_list() == [None]
    assert store.finished_job_ids() == {"new"}


def test_a_second_driver_on_the_same_run_dir_is_refused(tmp_path):
    store = RunStore(tmp_path).create()
    with store.lock():
        expected = f"in use by another quantdask run \\(pid {os.getpid()}\\)"
        with pytest.raises(RunDirError, match=expected):
            with RunStore(tmp_path).lock():
                pass
    with RunStore(tmp_path).lock():  # released with its holder
        pass


def test_finished_jobs_are_the_done_ones(tmp_path):
    store = RunStore(tmp_path).create()
    record_done(store, "a")
    store.write_result(done_record("no-layers"))  # a crash between the two writes
    store.write_result(done_record("b", status="skipped", failure_class="unsupported",
                                   error_class="UnsupportedHere",
                                   error_message="needs CUDA"))
    store.write_result(done_record("c", status="failed", failure_class="job_error", error_class="E",
                                   error_message="m"))
    # Skipped and failed jobs run again: what is unsupported depends on the machine.
    assert store.finished_job_ids() == {"a"}


def test_empty_run_dir_reads_as_an_empty_frame_with_the_schema(tmp_path):
    frame = read_results(tmp_path / "nothing-here")
    assert frame.height == 0 and frame.schema == pl.Schema(RESULT_SCHEMA)


def test_job_status_marks_unrecorded_jobs_pending(tmp_path):
    store = RunStore(tmp_path).create()
    store.write_plan([
        {"job_id": "a", "model": "m", "backend": "none", "config_label": "baseline", "priority": 1},
        {"job_id": "b", "model": "m", "backend": "bitsandbytes", "config_label": "nf4",
         "priority": 0},
    ])
    store.write_result(done_record("a"))
    status = dict(job_status(tmp_path).select("job_id", "status").iter_rows())
    assert status == {"a": "done", "b": "pending"}


def test_a_done_jobs_windows_round_trip_and_are_part_of_it(tmp_path):
    store = RunStore(tmp_path / "run").create()
    rows = [{"window": w, "tokens": 127, "ln_ppl": 0.5 + w, "kl": 0.01 * w,
             "top1_agreement": 0.9, "delta_p": -0.001, "token_hash": f"{w:016x}"}
            for w in range(3)]
    store.write_job_rows("layers", "a", [])
    store.write_job_rows("windows", "a", rows)
    store.write_result(done_record("a"))
    store.write_job_rows("layers", "b", [])  # no windows written (a crash, or an older version)
    store.write_result(done_record("b"))
    frame = read_windows(tmp_path / "run")
    assert frame["job_id"].to_list() == ["a"] * 3 and frame.drop("job_id").to_dicts() == rows
    assert store.finished_job_ids() == {"a"}  # b runs again


# What the driver adds to an attempt's record (the recorder: the job's identity, its tries, when
# it was queued; the gates' verdict) and run_job's finish time: every other column comes from a
# phase's typed record.
DRIVER_COLUMNS = ("job_id", "sweep", "model", "backend", "config", "config_label", "priority",
                  "attempts", "queued_at", "finished_at", "gates_passed", "gates_met",
                  "gates_failed")
"""The columns the driver stamps (run.recorder) and the worker's run_job closes with."""


def _record_types(phase) -> list:
    """The record types a phase may return beside its next stage (its annotation,
    ``tuple[Made, Record | None]``, None left out)."""
    import typing

    from quantdask.job.phases import Made

    stage, record = typing.get_args(typing.get_type_hints(phase)["return"])
    assert stage is Made, f"phase {phase.__name__} must return its next stage first"
    return [t for t in typing.get_args(record) or (record,) if t is not type(None)]


def _returned(phase) -> type:
    """The record type a phase returns (its annotation, None left out)."""
    [record] = _record_types(phase)
    return record


@pytest.mark.timeout(30)
def test_every_result_column_comes_from_exactly_one_place():
    from quantdask.job.phases import PHASES
    from quantdask.records import NotDone, PhaseRecord, Quantized, Span, Streamed, Where
    from quantdask.store.schema import FRAME, RESULT_SCHEMA
    from quantdask.stream.streamed_job import STREAMED_PHASES
    from quantdask.sweepfile.search import SearchRole

    producers: dict[str, tuple[str, ...]] = {"driver": DRIVER_COLUMNS,
                                             "SearchRole": SearchRole.column_names()}
    frames: dict[str, list[str]] = {}
    for record_type in (Where, Span, NotDone):
        producers[record_type.__name__] = record_type.column_names()
    for phase in PHASES:
        types = _record_types(phase)
        assert len(types) == 1 and issubclass(types[0], PhaseRecord), (
            f"phase {phase.__name__} must return one PhaseRecord (or None), not {types}")
        producers[phase.__name__] = types[0].column_names()
        for frame in types[0].frame_names():
            frames.setdefault(frame, []).append(phase.__name__)
    frames.setdefault("phases", []).append("Span")
    seen: dict[str, str] = {}
    for producer, columns in producers.items():
        for column in columns:
            assert column not in seen, f"{column} comes from both {seen[column]} and {producer}"
            seen[column] = producer
    # A streamed job's phases, and a GGUF job's (a runtime of its own), make the same columns
    # once each, and their own (the stream's, the runtime's).
    from quantdask.gguf.phases import GGUF_PHASES
    from quantdask.records import InRuntime

    for kind, phases, record in (("stream", STREAMED_PHASES, Streamed),
                                 ("runtime", GGUF_PHASES, InRuntime)):
        only = set(record.column_names()) - set(Quantized.column_names())
        columns = [c for phase in phases for c in _returned(phase).column_names()]
        assert len(columns) == len(set(columns)), columns
        assert set(columns) - only <= set(seen)
        for column in only:
            assert column not in seen, f"{column} comes from a resident phase too"
            seen[column] = kind
    assert set(seen) - {"status"} == set(RESULT_SCHEMA) - {"status"}, (
        f"not in the schema: {sorted(set(seen) - set(RESULT_SCHEMA))}; "
        f"from no phase: {sorted(set(RESULT_SCHEMA) - set(seen))}")
    # Each per-job frame is filled by exactly one phase, and names a declared frame.
    per_job = {name for name, frame in FRAME.items() if frame.per_done_job}
    assert set(frames) == per_job and all(len(p) == 1 for p in frames.values()), frames


@pytest.mark.timeout(30)
def test_a_records_nested_fields_are_read_from_its_type_hints_once(monkeypatch):
    import typing

    from quantdask import records
    from quantdask.records import base

    monkeypatch.setattr(base, "_NESTED", {})
    reads = []
    hints = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda kind: reads.append(kind) or hints(kind))
    first = records.Scored.nested()
    assert records.Scored.nested() == first == {"quality": records.Quality}
    assert reads == [records.Scored]


@pytest.mark.timeout(30)
def test_every_frames_schema_and_nullable_columns_come_from_its_row_type():
    from quantdask import records
    from quantdask.store.schema import FRAME, schema_of

    typed = {"layers": records.LayerRow, "windows": records.WindowRow, "tasks": records.TaskRow,
             "worker_tasks": records.WorkerTaskRow,
             "speed": records.SpeedAsRead, "phases": records.PhaseRow,
             "attempts": records.AttemptRow, "sessions": records.SessionRow,
             "samples": records.SampleRow, "sensitivity": records.SensitivityRow,
              "allocation": records.AllocationRow, "refinement": records.RefinementRow,
             "task_items": records.TaskItemRow,
             "environment": records.EnvironmentRow}
    assert set(typed) | {"results"} == set(FRAME)
    for name, row_type in typed.items():
        frame = FRAME[name]
        # A done job's rows come without its id (the store adds it as it writes them).
        stamped = {"job_id": pl.String()} if frame.per_done_job else {}
        assert frame.schema == {**stamped, **schema_of((row_type,))}, name
        assert frame.optional == row_type.optional_columns(), name
    assert FRAME["speed"].derived == ("baseline_decode_tokens_per_s", "decode_speedup",
                                      "prefill_speedup")
    assert FRAME["sensitivity"].optional == ("kl", "kl_se", "bytes", "error", "worker", "score")
    assert FRAME["attempts"].schema["started_at"] == pl.Datetime("us", "UTC")


@pytest.mark.timeout(30)
def test_typed_rows_are_written_as_their_columns(tmp_path):
    from quantdask.records import SensitivityRow

    store = RunStore(tmp_path / "run")
    row = SensitivityRow(search="s", search_key="k", model="m", unit="u", layer=0,
                         format="4b", params=10, kl=None, kl_se=None, bytes=None,
                         error="does not fit", worker=None, seconds=0.5)
    store.write_rows("sensitivity", "part", [row])
    assert store.read("sensitivity").to_dicts() == [row.row()]


@pytest.mark.timeout(30)
def test_the_results_schema_is_derived_from_the_records():
    import dataclasses

    from quantdask.records import Ended, GateVerdict, PhaseRecord, Recorded
    from quantdask.store.schema import RESULT_RECORDS, RESULT_SCHEMA, schema_of

    # Every column once, each of its record's type; the driver's stamps are a record too.
    assert len(RESULT_SCHEMA) == len({c for r in RESULT_RECORDS for c in r.column_names()})
    assert set(DRIVER_COLUMNS) | {"status"} == (set(Recorded.column_names())
                                                | set(Ended.column_names())
                                                | set(GateVerdict.column_names()))
    assert RESULT_SCHEMA["finished_at"] == pl.Datetime("us", "UTC")
    assert RESULT_SCHEMA["perplexity"] == pl.Float64()
    assert RESULT_SCHEMA["gates_passed"] == pl.Boolean()

    @dataclasses.dataclass(frozen=True)
    class Odd(PhaseRecord):
        when: dt.datetime | None
        stats: dict[str, float]

    with pytest.raises(TypeError, match="Odd.stats: a column holds one plain type"):
        schema_of((Odd,))
