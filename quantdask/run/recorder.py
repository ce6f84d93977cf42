"""What the driver persists as a sweep goes: each attempt's row and log, each job's note on what
was decided after a failure, each final result with its per-layer rows, device samples, and the
workers taken out of rotation. Telemetry never costs a result."""

from __future__ import annotations

import json
import logging
from typing import Any

import polars as pl

from quantdask.backends import BASELINE
from quantdask.job.outcome import JobOutcome
from quantdask.records import AttemptRow, Recorded
from quantdask.run import LOG_CHANNEL
from quantdask.run.attempts import Attempt
from quantdask.run.live_logs import LiveLogs
from quantdask.store.run_store import RunStore, attempt_log_text
from quantdask.sweepfile.gates import Gate, gate_columns
from quantdask.util import utcnow
from quantdask.words import Status

log = logging.getLogger(LOG_CHANNEL)


class Recorder:
    """Writes one driver session's records (``run_id``) to its run directory."""

    def __init__(self, store: RunStore, run_id: str, gates: tuple[Gate, ...] = ()):
        self.store = store
        self.run_id = run_id
        self.gates = gates
        self.live = LiveLogs(store)  # running attempts' lines, settled by ``attempt``

    def attempt(self, attempt: Attempt, outcome: JobOutcome) -> None:
        """The attempt's row in the attempts frame and its log under the job's logs (in place
        of the lines it sent while it ran, when it brings its whole log: ``run.live_logs``)
        and its worker's."""
        job, record = attempt.job, outcome.record
        text = attempt_log_text(job.id, attempt.number, record, outcome.log)
        self.live.settle(attempt.key, job.id, text, whole=outcome.whole_log)
        self.store.append_worker_log(record.get("worker") or "unknown-worker", text)
        self.store.write_attempt(AttemptRow(
            run_id=self.run_id, job_id=job.id, attempt=attempt.number,
            key=attempt.key, worker=record.get("worker"),
            device=record.get("device"), started_at=record.get("started_at")
            or attempt.started_at, finished_at=record["finished_at"],
            status=record["status"], failure_class=record.get("failure_class"),
            error_class=record.get("error_class"), error_message=record.get("error_message"),
            # What this try ran with: an out-of-memory retry asks for more room.
            eval_batch_size=job.eval.batch_size, gpu_share=job.gpu_share,
            device_memory_request_bytes=job.device_memory_bytes or None,
        ))

    def decision(self, attempt: Attempt, failure_class: str, reason: str) -> None:
        """What was decided after a failed attempt, in the job's log."""
        self.store.append_job_log(attempt.job.id, (
            f"{utcnow().isoformat()} WARNING {attempt.job.id} attempt={attempt.number} "
            f"{failure_class}: {reason}\n"))

    def result(self, attempt: Attempt, outcome: JobOutcome) -> dict[str, Any]:
        """The job's final result (with its rows of the per-job frames when done); returns its
        row."""
        job = attempt.job
        recorded = Recorded(
            job_id=job.id, sweep=job.sweep, model=job.model.label, backend=job.backend,
            config=json.dumps(job.options.as_dict(), sort_keys=True),
            config_label=job.config_label, attempts=attempt.number, priority=job.priority,
            queued_at=attempt.queued_at)
        record = {**outcome.record, **recorded.columns(),
                  **(job.search.columns() if job.search is not None else {})}
        if record["status"] == Status.DONE:
            record.update(gate_columns(self.gates, record, outcome.rows.get("tasks", []),
                                       job.is_baseline))
            for frame, rows in outcome.rows.items():  # the frames of the phases that ran
                self.store.write_job_rows(frame, job.id, rows)
        self.store.write_result(record)
        log.info("%s %s %s: %s", job.id, job.model.label, job.config_label, record["status"])
        return record

    def restamp_gates(self) -> int:
        """Check every done job recorded in the run directory against this sweep's gates (they
        may have changed since those jobs ran; the measurements have not) and rewrite the gate
        columns of those whose verdict differs, so that the records, the report and
        ``quantdask status`` judge by the gates of the last sweep run here. Returns how many
        were rewritten."""
        results = self.store.read_results()
        tasks = self.store.read("tasks")
        rewritten = 0
        for record in results.filter(pl.col("status") == Status.DONE).to_dicts():
            rows = tasks.filter(pl.col("job_id") == record["job_id"]).to_dicts()
            columns = gate_columns(self.gates, record, rows, record["backend"] == BASELINE)
            if any(record[k] != v for k, v in columns.items()):
                self.store.write_result({k: v for k, v in {**record, **columns}.items()
                                         if v is not None})
                rewritten += 1
        if rewritten:
            log.info("gates changed: re-checked %d recorded jobs against them", rewritten)
        return rewritten

    def samples(self, samples: list[dict[str, Any]]) -> None:
        try:
            self.store.write_samples(samples)
        except Exception as error:  # noqa: BLE001 - a bad batch is logged and dropped
            log.error("dropped %d device samples: %s", len(samples), error)

    def excluded(self, worker: str, reason: str) -> None:
        self.store.record_excluded_worker(worker, reason)
