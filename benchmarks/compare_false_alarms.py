"""How often ``quantdask compare`` flags a difference that is not there, and how often it finds
one that is: its verdicts on simulated pairs of runs, through the comparison's own code.

    .venv/bin/python -m benchmarks.compare_false_alarms [--trials 2000] [--windows 32]
        [--jobs 7] [--questions 200]

Each trial builds two runs in memory (the frames ``qd.compare`` reads: results, windows, task
items) of ``--jobs`` jobs with per-window KL, ln_ppl and top-1 from a realistic skewed
distribution (log-normal KLs that differ by window), and per-question task scores; run B is
run A under a null model, then with a planted shift:

- ``jitter``: B = A with GPU-like numerical noise (relative 1e-4 per window; 4% of the
  questions near ties, each run's answer to them a coin toss): with the default tolerances;
- ``noise``, tolerance 0: each run's window KLs the same windows' times 1 + zero-mean noise
  of its own as large as the spread between windows (sd 0.5: normal, heavy-tailed t3, skewed),
  ln_ppl and top-1 moved alike, each question re-drawn with the same accuracy: two
  exchangeable runs, and only the significance test between this and a false alarm;
- ``tail``, tolerance 0: the same mean but not exchangeable: B's noise alone, skewed (B's KLs
  rarer but larger errors than A's): the paired t-test's known weakness, measured;
- ``shift``, tolerance 0: B = A with 5% relative noise per window and the near ties tossed
  again, then one job's KL 10% higher on every window and one job's accuracy 5 points lower:
  how often each is found (power), and how often any other job or metric is flagged.

A trial is a false alarm when any verdict of the comparison (every job, metric and task) is
worse or better: the family-wise rate, which Holm's adjustment keeps at 5%. Prints each rate
with its 95% Clopper-Pearson interval.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import polars as pl

from quantdask.comparison.compare import TEST_SCHEMA, _with_verdicts
from quantdask.comparison.quality import quality_tests
from quantdask.comparison.runs import RunFrames, done_in_both, matched_jobs
from quantdask.comparison.tasks import task_tests
from quantdask.comparison.verdicts import DEFAULT_TOLERANCES, NO_DIFFERENCE, Tolerance

ZERO = {m: Tolerance(0.0, False) for m in DEFAULT_TOLERANCES}


def _results(jobs: int) -> pl.DataFrame:
    return pl.DataFrame({
        "job_id": [f"j{i}" for i in range(jobs)], "model": ["m"] * jobs,
        "config_label": [f"c{i}" for i in range(jobs)], "status": ["done"] * jobs,
        "backend": ["bitsandbytes"] * jobs, "config": ["{}"] * jobs,
        "error_message": [None] * jobs, "failure_class": [None] * jobs},
        schema_overrides={"error_message": pl.String, "failure_class": pl.String})


def _run(name: str, results, kl, ln_ppl, top1, items) -> RunFrames:
    jobs, windows = kl.shape
    frame = pl.DataFrame({
        "job_id": np.repeat([f"j{i}" for i in range(jobs)], windows),
        "window": np.tile(np.arange(windows), jobs), "tokens": 31,
        "ln_ppl": ln_ppl.ravel(), "kl": kl.ravel(), "top1_agreement": top1.ravel(),
        "delta_p": 0.0, "token_hash": np.tile([f"{w:016x}" for w in range(windows)], jobs)})
    questions = items.shape[1]
    item_frame = pl.DataFrame({
        "job_id": np.repeat([f"j{i}" for i in range(jobs)], questions), "task": "t",
        "doc_id": np.tile(np.arange(questions), jobs), "metric": "acc", "filter": "none",
        "value": items.ravel().astype(float)})
    tasks = item_frame.group_by("job_id").agg(pl.mean("value"), pl.len().alias("samples")) \
        .with_columns(task=pl.lit("t"), metric=pl.lit("acc"), filter=pl.lit("none"),
                      is_group=pl.lit(False), stderr=pl.lit(0.01), higher_is_better=True)
    return RunFrames(name, results, frame, tasks, item_frame, pl.DataFrame(), {}, False)


def _noise(rng, kind: str, shape, scale: float) -> np.ndarray:
    """Zero-mean relative noise of sd about ``scale``, in (-0.9, 0.9) so a KL stays positive
    (symmetric kinds cut symmetrically, which keeps the mean at 0)."""
    if kind == "normal":
        e = rng.normal(0.0, 1.0, shape)
    elif kind == "t3":
        e = rng.standard_t(3, shape) / math.sqrt(3.0)
    else:  # skewed: a long right tail, bounded below
        e = rng.exponential(1.0, shape) - 1.0
    e = e * scale
    return np.clip(e, -0.9, 0.9) if kind != "skewed" else e


def _trial(rng, jobs: int, windows: int, questions: int, model: str, noise: str,
           shift: bool) -> tuple[set[tuple[str, str]], bool]:
    """The (job, metric) pairs flagged, and whether any verdict was given."""
    level = rng.lognormal(-4.0, 0.8, (jobs, 1))  # each job's KL level
    kl = level * rng.lognormal(0.0, 0.5, (jobs, windows))  # windows differ
    ln_ppl = 2.0 + rng.normal(0.0, 0.3, (1, windows)) + kl
    top1 = np.clip(0.95 - kl + rng.normal(0, 0.01, (jobs, windows)), 0, 1)
    accuracy = rng.uniform(0.4, 0.9, (jobs, 1))
    items = rng.random((jobs, questions)) < accuracy
    # near ties: 4% of the questions, each run's answer to them a coin toss (GPU jitter decides)
    ties = rng.random(items.shape) < 0.04
    items = np.where(ties, rng.random(items.shape) < 0.5, items)
    tossed = np.where(ties, rng.random(items.shape) < 0.5, items)
    if model == "jitter":  # GPU kernels' numerical noise
        kl_b = kl * (1 + rng.normal(0, 1e-4, kl.shape))
        ln_b = ln_ppl * (1 + rng.normal(0, 1e-4, kl.shape))
        top1_b = top1.copy()
        items_b = tossed
    else:  # as large as the spread between windows (0.5), or 5% where a shift is planted
        scale = 0.05 if shift else 0.5
        kl_b = kl * (1 + _noise(rng, noise, kl.shape, scale))
        ln_b = ln_ppl + kl * _noise(rng, noise, kl.shape, scale)
        top1_b = top1 + 0.01 * _noise(rng, noise, kl.shape, 1.0)
        items_b = tossed if shift else rng.random((jobs, questions)) < accuracy
        if model == "noise":  # each run with noise of its own: the two are exchangeable
            kl = kl * (1 + _noise(rng, noise, kl.shape, scale))
            ln_ppl = ln_ppl + kl * _noise(rng, noise, kl.shape, scale)
            top1 = top1 + 0.01 * _noise(rng, noise, kl.shape, 1.0)
    if shift:
        kl_b[0] = kl_b[0] * 1.10
        lost = items[1] & (rng.random(questions) < 0.05 / accuracy[1, 0])  # 5 points lost
        items_b[1] = items_b[1] & ~lost
    results = _results(jobs)
    a = _run("a", results, kl, ln_ppl, top1, items)
    b = _run("b", results, kl_b, ln_b, top1_b, items_b)
    done = done_in_both(matched_jobs(a, b))
    rows = quality_tests(a, b, done) + task_tests(a, b, done)[0]
    tests = _with_verdicts(pl.DataFrame(rows, schema=TEST_SCHEMA),
                           DEFAULT_TOLERANCES if model == "jitter" else ZERO)
    flagged = tests.filter(pl.col("verdict") != NO_DIFFERENCE)
    return {(r["config_label"], r["metric"]) for r in flagged.iter_rows(named=True)}, \
        not flagged.is_empty()


def _interval(k: int, n: int) -> str:
    from scipy.stats import beta

    low = beta.ppf(0.025, k, n - k + 1) if k else 0.0
    high = beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    return f"{k / n:.4f} [{low:.4f}, {high:.4f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=7)
    parser.add_argument("--questions", type=int, default=500)
    args = parser.parse_args()
    rng = np.random.default_rng(57)
    print(f"{args.trials} trials, {args.jobs} jobs x {args.windows} windows, "
          f"{args.questions} questions; family-wise false-alarm rate [95% interval]")
    for model, noise in (("jitter", "normal"), ("noise", "normal"), ("noise", "t3"),
                         ("noise", "skewed"), ("tail", "skewed")):
        alarms = sum(_trial(rng, args.jobs, args.windows, args.questions, model, noise,
                            False)[1] for _ in range(args.trials))
        print(f"null {model:6s} {noise:7s}: {_interval(alarms, args.trials)}")
    found_kl = found_acc = other = 0
    for _ in range(args.trials):
        flagged, _ = _trial(rng, args.jobs, args.windows, args.questions, "shift", "normal",
                            True)
        found_kl += ("c0", "kl_divergence") in flagged
        found_acc += ("c1", "acc") in flagged
        other += bool(flagged - {("c0", "kl_divergence"), ("c1", "acc"), ("c0", "perplexity"),
                                 ("c0", "top1_agreement")})
    print(f"shift: KL +10% found {_interval(found_kl, args.trials)}; accuracy -5 points found "
          f"{_interval(found_acc, args.trials)}; another job or metric flagged "
          f"{_interval(other, args.trials)}")


if __name__ == "__main__":
    main()
