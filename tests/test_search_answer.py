"""A search's answer (``search.answer``) from records made by hand: which mix it ships, the
uniform format beside it, the two at equal bytes, whether the measurement ranks them, and the
report's Markdown. The answer on a real search run: tests/test_search.py."""

from __future__ import annotations

import json

import polars as pl
import pytest

from quantdask.search.answer import answer_lines, search_answers
from quantdask.words import Status

pytestmark = pytest.mark.timeout(30)

# (job, role, candidate, budget bits, budget bytes, format, config label, bits, KL, its se)
JOBS = [
    ("m1", "mixed", 1, 6.9, 690, "b3", "mix 6.9b #1", 6.9, 0.0100, 0.0008),
    ("m2", "mixed", 2, 6.9, 690, "b3", "mix 6.9b #2", 6.9, 0.0090, 0.0008),
    ("u2", "uniform", 1, 6.5, 650, "b2", "mix uniform b2", 6.5, 0.0500, 0.002),
    ("u3", "uniform", 1, 6.89, 689, "b3", "mix uniform b3", 6.89, 0.0226, 0.0019),
    ("u4", "uniform", 1, 7.6, 760, "b4", "mix uniform b4", 7.6, 0.0047, 0.0004),
    ("e3", "equal-bytes", 1, 6.89, 689, "b3", "mix mixed at b3 bytes", 6.89, 0.0096, 0.0007),
    ("u4", "equal-bytes", 1, 7.6, 760, "b4", "mix uniform b4", 7.6, 0.0047, 0.0004),
]


def frames(jobs=JOBS, status=Status.DONE) -> tuple[pl.DataFrame, pl.DataFrame]:
    allocation = pl.DataFrame([{
        "search": "mix", "model": "m", "job_id": job, "role": role, "candidate": rank,
        "budget_bits_per_weight": bits, "budget_bytes": size, "unit": "layers.0.q_proj",
        "format": fmt, "predicted_kl": kl, "predicted_bytes": size, "backend": "hqq",
        "config": json.dumps({"bits": int(fmt[1]), "group_size": 64})}
        for job, role, rank, bits, size, fmt, _, _, kl, _ in jobs])
    results = pl.DataFrame([{
        "job_id": job, "status": status, "config_label": label, "bits_per_weight": measured,
        "kl_divergence": kl, "kl_se": se, "search": "mix", "predicted_kl": kl, "backend": "hqq"}
        for job, _, _, _, _, _, label, measured, kl, se in dict.fromkeys(jobs)]
    ).unique("job_id", maintain_order=True)
    return results, allocation


def test_the_mix_that_measured_least_ships_beside_the_largest_uniform_within_its_budget():
    results, allocation = frames()
    [row] = search_answers(results, allocation, "runs/x").to_dicts()
    # candidate 2 measured less than candidate 1: the measurement decides what ships
    assert (row["ship_job_id"], row["ship_candidate"], row["ship_kl"]) == ("m2", 2, 0.0090)
    # b3 (689 bytes) is the largest uniform within 690; b4 is over it
    assert (row["uniform_job_id"], row["uniform_format"], row["uniform_config"]) == (
        "u3", "b3", "hqq 3b g64")
    assert (row["equal_job_id"], row["equal_kl"]) == ("e3", 0.0096)
    assert row["file"].startswith("not saved as a file: ")
    lines = answer_lines(search_answers(results, allocation, "runs/x"))
    assert lines[:3] == [
        "answer: at 6.9 bits/weight (whole model; search mix, m), ship mix 6.9b #2: KL 0.00900 "
        "± 0.00080, 6.900 bits/weight",
        "  uniform b3 (hqq 3b g64), the largest within the budget: KL 0.0226 ± 0.0019, "
        "6.890 bits/weight",
        "  at equal bytes (6.890 bits/weight): mixed 0.00960 ± 0.00070 against uniform "
        "0.0226 ± 0.0019 (2.4x less)"]
    assert lines[3].startswith("  its file: not saved as a file: ") and len(lines) == 4


def test_within_the_noise_the_answer_does_not_rank_and_without_a_uniform_it_says_so():
    noisy = [(*job[:8], 0.0220 if job[0] == "e3" else job[8], job[9]) for job in JOBS]
    results, allocation = frames(noisy)
    lines = answer_lines(search_answers(results, allocation))
    assert lines[2].endswith("against uniform 0.0226 ± 0.0019 (within 2 standard errors: "
                             "not ranked)")
    only_b4 = [job for job in JOBS if job[5] != "b2" and job[0] not in ("u3", "e3")]
    results, allocation = frames(only_b4)
    lines = answer_lines(search_answers(results, allocation))
    assert lines[1] == "  no uniform format fits within the budget" and len(lines) == 3


def test_no_answer_without_a_finished_search_job():
    from quantdask.report.search import answer_markdown

    results, allocation = frames(status=Status.FAILED)
    assert search_answers(results, allocation).is_empty()
    assert search_answers(results, allocation.clear()).is_empty()
    assert answer_lines(pl.DataFrame()) == [] and answer_markdown(pl.DataFrame()) is None
    markdown = answer_markdown(search_answers(*frames()))
    assert markdown.startswith("**answer: at 6.9 bits/weight (whole model; search mix, m), ship "
                               "mix 6.9b #2")
    assert "\n- uniform b3 (hqq 3b g64), the largest within the budget" in markdown

