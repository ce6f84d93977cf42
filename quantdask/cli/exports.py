"""``quantdask export``: a run directory into an experiment tracker (``mlflow``), or a search's
allocation as the file its runtime loads (``allocation``)."""

from __future__ import annotations


def cmd_export(args) -> int:
    """``export mlflow RUN_DIR``: one MLflow run per job, under a parent run."""
    from quantdask.store.mlflow_export import export_mlflow

    summary = export_mlflow(args.run_dir, args.tracking_uri, args.experiment)
    superseded = f", {summary.superseded} earlier runs superseded" if summary.superseded else ""
    print(f"mlflow: {summary.created} job runs created, {summary.skipped} already exported"
          f"{superseded}; experiment {summary.experiment!r} (id {summary.experiment_id}) at "
          f"{summary.tracking_uri}, parent run {summary.parent_run_id}")
    return 0


def cmd_export_allocation(args) -> int:
    """``export allocation RUN_DIR --search NAME --budget B --to DIR``: the allocation the
    search chose at that budget, written as its runtime's file (no probe runs again)."""
    from quantdask.search.export import export_allocation

    done = export_allocation(args.run_dir, args.search, args.budget, args.to, args.candidate)
    measured = ("not measured (its job did not finish)" if done.measured_kl is None
                else f"measured KL {done.measured_kl:.4g}")
    print(f"allocation {done.search} at {done.budget_bits_per_weight:g} bits per weight "
          f"(candidate {done.candidate}, job {done.job_id}): {done.path} ({done.file_bytes:,} "
          f"bytes); predicted KL {done.predicted_kl:.4g} ({done.predicted_bytes:,} bytes of "
          f"tensors), {measured}")
    return 0
