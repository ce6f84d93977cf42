"""``artifacts.verify`` takes the in-memory model's KL from the windows the score phase already
measured: the figure is the one a fresh measurement gives (checked against the computation
verify made before it reused them), and the in-memory model runs no forward pass for it."""

from __future__ import annotations

import dataclasses

import pytest

from quantdask.backends import get_backend
from quantdask.job.job import run_job
from quantdask.measure.reference import compute_reference
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict


def test_the_kl_of_the_first_windows_is_weighted_by_their_tokens():
    from quantdask.job.artifacts import VERIFY_WINDOWS, windows_kl
    from quantdask.records import WindowRow

    def row(window: int, tokens: int, kl: float) -> WindowRow:
        return WindowRow(window, tokens, ln_ppl=0.0, kl=kl, top1_agreement=1.0, delta_p=0.0)

    rows = [row(w, 10, 9.0) for w in range(VERIFY_WINDOWS, 8)]
    rows += [row(3, 20, 0.5), row(1, 30, 2.0), row(0, 10, 1.0), row(2, 20, 0.5)]
    # Per token over windows 0-3 (not the mean of their means, 1.0; nor windows past them).
    assert windows_kl(rows) == pytest.approx((10 * 1.0 + 30 * 2.0 + 40 * 0.5) / 80)
    assert windows_kl([row(0, 5, -1e-9)]) == 0.0  # clipped, as before
    with pytest.raises(ArithmeticError):
        windows_kl([row(0, 5, float("nan"))])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("batch_size", [8, 3])
def test_verify_reuses_the_scored_windows_and_reports_the_delta_it_did_before(
        tmp_path, monkeypatch, batch_size):
    """nf4 on the demo model, 8 eval windows in batches of 8 (the first 4 share one batch with
    4 more) or of 3 (they span two): the in-memory KL verify uses equals the old computation
    (``quality`` of the in-memory model on the first 4 windows, measured again just before the
    save), ``reload_kl_delta`` equals that computation's delta, the reloaded model is scored
    fresh, and the in-memory model's forward runs no time during the artifacts phase."""
    from transformers import AutoModelForCausalLM

    import quantdask.job.artifacts as artifacts
    import quantdask.job.phases as job_module
    from quantdask.job.artifacts import VERIFY_WINDOWS
    from quantdask.measure.metrics import quality

    data = sweep_dict(backends=[{"backend": "bitsandbytes", "configs": [{"bits": 4}]}],
                      artifacts={"keep": "done", "to": str(tmp_path / "models"),
                                 "verify": True})
    data["eval"]["batch_size"] = batch_size
    job = next(j for j in expand_grid(sweep_from_dict(data)) if not j.is_baseline)
    reference = compute_reference(job.model, job.eval, job.eval.read_text())

    def old_verify_kl(model) -> float:
        """What verify measured before: the first windows, on their own."""
        windows = reference.windows[:VERIFY_WINDOWS]
        distribution = {k: t[:VERIFY_WINDOWS] for k, t in reference.distribution.items()}
        return quality(model, windows, distribution, batch_size, "cpu").kl_divergence

    calls = {"in_memory": 0, "reloaded": 0}

    def counter(name):
        def count(module, args, kwargs):
            calls[name] += 1
        return count

    bnb = get_backend("bitsandbytes")

    def quantize(source, options, device):
        model = bnb.quantize(source, options, device)
        model.register_forward_pre_hook(counter("in_memory"), with_kwargs=True)
        return model

    seen: dict[str, float] = {}
    keep = job_module.keep_artifact

    def measured_keep(model, *args, **kwargs):
        seen["old_before"] = old_verify_kl(model)  # the model as it is before the save
        at_start = calls["in_memory"]
        artifact = keep(model, *args, **kwargs)
        seen["verify_forwards"] = calls["in_memory"] - at_start
        return artifact

    delta = artifacts.reload_kl_delta

    def seen_delta(before, *args, **kwargs):
        seen["before"] = before
        return delta(before, *args, **kwargs)

    load = AutoModelForCausalLM.from_pretrained

    def counted_load(location, *args, **kwargs):
        model = load(location, *args, **kwargs)
        if str(location).startswith(str(tmp_path / "models")):
            model.register_forward_pre_hook(counter("reloaded"), with_kwargs=True)
        return model

    monkeypatch.setattr(job_module, "keep_artifact", measured_keep)
    monkeypatch.setattr(artifacts, "reload_kl_delta", seen_delta)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted_load)
    record = run_job(job, dataclasses.replace(bnb, quantize=quantize),
                     reference=reference).record
    assert record["status"] == "done", record.get("error_message")
    assert record["artifact_error"] is None
    assert seen["verify_forwards"] == 0 and calls["reloaded"] > 0
    assert seen["before"] > 1e-4  # a real figure, so the next line compares something
    assert seen["before"] == pytest.approx(seen["old_before"], rel=1e-6, abs=1e-9)

    saved = load(tmp_path / "models" / job.id, device_map="cpu").eval()
    old_delta = old_verify_kl(saved) - seen["old_before"]
    assert record["reload_kl_delta"] == pytest.approx(old_delta, rel=1e-3, abs=1e-8)
