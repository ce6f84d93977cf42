"""Perplexity, KL divergence and top-1 agreement checked against a computation of our own.

The reference numbers here come from plain transformers and the README's formulas, not from
quantdask: the unquantized model from ``AutoModelForCausalLM.from_pretrained``, the quantized one
through transformers' own ``BitsAndBytesConfig``, the eval windows re-derived from the tokenizer
(the text's tokens, cut into consecutive non-overlapping windows of ``seq_len``), and then

- perplexity = exp(mean over predicted tokens of -log p_q(next token)),
- KL = mean over positions of sum_v p_fp(v) (log p_fp(v) - log p_q(v)), i.e. KL(fp || quant)
  (the README's "KL(unquantized || quantized)"),
- top-1 agreement = share of positions where both models' argmax agree,

all in float64. quantdask's numbers for the same job (``run_job`` in this process) must match.
"""

from __future__ import annotations

import math

import pytest

from quantdask.backends import get_backend
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.job.job import run_job
from quantdask.plan.retry import with_more_room
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.settings import DEFAULT_KL_TAIL_SAMPLES, DEFAULT_KL_TOP_K, EvalSettings
from quantdask.sweepfile.sweep import BackendBlock, Sweep, expand_grid

pytestmark = pytest.mark.timeout(180)

SEQ_LEN, SAMPLES = 64, 8
# fp4 errs more than nf4 on the demo model, which puts KL(fp || q) and KL(q || fp) further
# apart (about 5% against about 1% for nf4): a reversed KL cannot hide in the tolerance.
OPTIONS = {"bits": 4, "quant_type": "fp4"}
REL = 1e-4  # float32 logits (quantdask) against float64 sums (here), and summation order


def jobs(batch_size: int = 8, kl_top_k: int | str = "all",
         kl_tail_samples: int = DEFAULT_KL_TAIL_SAMPLES) -> dict:
    sweep = Sweep(name="q", models=[ModelSpec(path=DEMO_MODEL_DIR)],
                  backends=[BackendBlock("bitsandbytes", configs=[OPTIONS])],
                  eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=SEQ_LEN, samples=SAMPLES,
                                    batch_size=batch_size, kl_top_k=kl_top_k,
                                    kl_tail_samples=kl_tail_samples))
    return {job.config_label: job for job in expand_grid(sweep)}


@pytest.fixture(scope="module")
def independent():
    """Windows, and float64 log-probs of the fp and the fp4 model, from transformers alone."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    with open(DEMO_EVAL_TEXT, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= SEQ_LEN * SAMPLES
    # Consecutive, non-overlapping windows from the first token on.
    windows = torch.tensor([ids[i * SEQ_LEN:(i + 1) * SEQ_LEN] for i in range(SAMPLES)])
    assert text.startswith(tokenizer.decode(windows[0]).strip()[:20])

    log_p, log_q = fp_and_fp4_log_probs(DEMO_MODEL_DIR, windows)
    return {"windows": windows, "log_p": log_p, "log_q": log_q}


def fp_and_fp4_log_probs(model_dir: str, windows):
    """float64 next-token log-probs on ``windows`` (every position but the last) of the model
    and of its fp4 quantization through transformers' own ``BitsAndBytesConfig``."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    fp = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantized = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, device_map="cpu",
        # quantdask's bitsandbytes backend for {bits: 4, quant_type: fp4}: no double
        # quantization, float32 compute, the output head left unquantized (transformers' default).
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype=torch.float32)).eval()
    with torch.inference_mode():
        log_p = torch.log_softmax(fp(input_ids=windows).logits[:, :-1].double(), dim=-1)
        log_q = torch.log_softmax(quantized(input_ids=windows).logits[:, :-1].double(), dim=-1)
    return log_p, log_q


def top_k_kl(log_model, log_ref, k: int) -> float:
    """The README's top-k KL: over the reference's k most likely tokens, plus one bucket for
    the rest of the vocabulary (its mass under each model)."""
    top, ids = log_ref.topk(k, dim=-1)
    top_q = log_model.gather(-1, ids)
    rest_p, rest_q = 1 - top.exp().sum(-1), 1 - top_q.exp().sum(-1)
    kl = (top.exp() * (top - top_q)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())
    return kl.mean().item()


def scores(log_model, log_ref, windows) -> dict[str, float]:
    """The README's formulas: perplexity of ``log_model``; KL(ref || model); top-1 agreement."""
    targets = windows[:, 1:].unsqueeze(-1)
    nll = -log_model.gather(-1, targets).squeeze(-1)
    kl = (log_ref.exp() * (log_ref - log_model)).sum(-1)
    agree = (log_ref.argmax(-1) == log_model.argmax(-1)).double()
    return {"perplexity": math.exp(nll.mean().item()), "kl_divergence": kl.mean().item(),
            "top1_agreement": agree.mean().item(), "eval_tokens": targets.numel()}


@pytest.fixture(scope="module")
def records():
    from quantdask.measure.reference import compute_reference

    by_label = jobs()
    baseline = by_label["baseline"]
    with open(baseline.eval.text_path, encoding="utf-8") as f:
        reference = compute_reference(baseline.model, baseline.eval, f.read())
    out = {label: run_job(job, get_backend(job.backend), reference=reference).record
           for label, job in by_label.items()}
    assert {label: r["status"] for label, r in out.items()} == {"baseline": "done", "fp4": "done"}
    return out, reference


def test_quantdask_evaluates_the_windows_we_cut_from_the_text(independent, records):
    import torch

    _, reference = records
    assert torch.equal(reference.windows, independent["windows"])


def test_quality_matches_an_independent_computation(independent, records):
    by_label, _ = records
    log_p, log_q, windows = independent["log_p"], independent["log_q"], independent["windows"]
    expected = scores(log_q, log_p, windows)
    reversed_kl = scores(log_p, log_q, windows)["kl_divergence"]  # KL(quant || fp)
    # The test can tell the directions apart: they differ by far more than the tolerance.
    assert abs(reversed_kl - expected["kl_divergence"]) > 20 * REL * expected["kl_divergence"]
    fp4 = by_label["fp4"]
    assert fp4["eval_tokens"] == expected["eval_tokens"] == SAMPLES * (SEQ_LEN - 1)
    for metric in ("perplexity", "kl_divergence"):
        assert fp4[metric] == pytest.approx(expected[metric], rel=REL), metric
    assert fp4["kl_divergence"] != pytest.approx(reversed_kl, rel=REL)
    # A count of agreeing positions: exact (one position more or less would be 1/504).
    assert fp4["top1_agreement"] * fp4["eval_tokens"] == pytest.approx(
        expected["top1_agreement"] * expected["eval_tokens"], abs=1e-6)
    assert 0.5 < expected["top1_agreement"] < 1.0  # fp4 changes some predictions, not most


def test_the_baselines_perplexity_is_the_unquantized_models(independent, records):
    by_label, _ = records
    baseline = by_label["baseline"]
    expected = scores(independent["log_p"], independent["log_p"], independent["windows"])
    assert baseline["perplexity"] == pytest.approx(expected["perplexity"], rel=REL)
    assert baseline["kl_divergence"] == pytest.approx(0.0, abs=1e-9)
    assert baseline["top1_agreement"] == 1.0
    assert baseline["perplexity"] < by_label["fp4"]["perplexity"]


def test_metrics_do_not_depend_on_the_eval_batch_size(records):
    # An out-of-memory retry halves the eval batch (8 -> 4 -> 2 -> 1) against the same
    # reference; a reference made at another batch size (3: the last batch is short) must
    # give the same numbers too.
    from quantdask.measure.reference import compute_reference

    by_label, reference = records
    first = by_label["fp4"]
    job = jobs()["fp4"]
    backend = get_backend(job.backend)
    for _ in range(3):
        job = with_more_room(job)
        record = run_job(job, backend, reference=reference).record
        assert record["status"] == "done"
        for metric in ("perplexity", "kl_divergence", "top1_agreement", "eval_tokens"):
            assert record[metric] == pytest.approx(first[metric], rel=1e-5), (
                metric, job.eval.batch_size)
    assert job.eval.batch_size == 1
    odd = jobs(batch_size=3)["fp4"]
    with open(odd.eval.text_path, encoding="utf-8") as f:
        odd_reference = compute_reference(odd.model, odd.eval, f.read())
    record = run_job(odd, backend, reference=odd_reference).record
    for metric in ("perplexity", "kl_divergence", "top1_agreement", "eval_tokens"):
        assert record[metric] == pytest.approx(first[metric], rel=1e-5), (metric, 3)


@pytest.mark.parametrize("k", [DEFAULT_KL_TOP_K, 8])
def test_without_tail_samples_the_kl_is_the_top_k_bucket_formula_a_lower_bound(
        independent, records, k):
    """With eval.kl_tail_samples: 0, KL is the top-k + one bucket formula: at most the exact
    KL, and the record says it is a lower bound; perplexity and top-1 stay exact."""
    from quantdask.measure.reference import compute_reference

    exact, _ = records
    job = jobs(kl_top_k=k, kl_tail_samples=0)["fp4"]
    with open(job.eval.text_path, encoding="utf-8") as f:
        reference = compute_reference(job.model, job.eval, f.read())
    assert reference.ids.shape == (SAMPLES, SEQ_LEN - 1, k) and reference.tail_ids is None
    record = run_job(job, get_backend(job.backend), reference=reference).record
    log_p, log_q = independent["log_p"], independent["log_q"]
    expected = top_k_kl(log_q, log_p, k)
    exact_kl = scores(log_q, log_p, independent["windows"])["kl_divergence"]
    assert record["kl_divergence"] == pytest.approx(expected, rel=10 * REL)
    assert record["kl_divergence"] <= exact["fp4"]["kl_divergence"] * (1 + REL)
    assert expected <= exact_kl and record["kl_kind"] == "lower_bound"
    # Each KL says how much of the reference's mass its top k left out (0 when exact).
    tail = (1 - log_p.topk(k, dim=-1).values.exp().sum(-1)).mean().item()
    assert record["kl_tail_mass"] == pytest.approx(tail, rel=1e-4, abs=1e-9)
    assert exact["fp4"]["kl_tail_mass"] == 0 and exact["fp4"]["kl_kind"] == "exact"
    for metric in ("perplexity", "top1_agreement", "eval_tokens"):
        assert record[metric] == pytest.approx(exact["fp4"][metric], rel=1e-6), metric


@pytest.mark.parametrize("k", [DEFAULT_KL_TOP_K, 8])
def test_at_the_default_tail_samples_the_kl_is_within_1pct_of_exact(independent, records, k):
    """The tail sampled (the default): an unbiased estimate, within 1% of the exact float64 KL
    even where the top k leave much of the mass out (k = 8)."""
    exact_kl = scores(independent["log_q"], independent["log_p"],
                      independent["windows"])["kl_divergence"]
    record = run_job(jobs(kl_top_k=k)["fp4"], get_backend("bitsandbytes")).record
    assert record["kl_kind"] == "estimate" and record["kl_tail_mass"] > 0
    assert record["kl_divergence"] == pytest.approx(exact_kl, rel=0.01)
    assert 0 < record["kl_se"] < exact_kl  # over 8 windows: see the standard-error test


@pytest.mark.parametrize("top_k", [4, None])
def test_scores_are_the_same_bits_however_slices_arrive_or_merge(top_k):
    # A reference computed in parts merges their meters: the figures must not depend on how
    # many parts there were (the cluster's size at the time), nor on the order they came back.
    import torch

    from quantdask.measure.metrics import QualityMeter, reference_slice

    torch.manual_seed(0)
    windows = torch.randint(0, 50, (6, 9))
    log_p = torch.log_softmax(3 * torch.randn(6, 8, 50), -1)
    log_q = torch.log_softmax(log_p + 0.3 * torch.randn(6, 8, 50), -1)
    reference = reference_slice(log_p, top_k)
    pieces = [(slice(r, r + 2), slice(p, p + 3 if p < 6 else 8))
              for r in range(0, 6, 2) for p in (0, 3, 6)]

    def measured(order: list[int], parts: int) -> dict:
        # ``parts`` meters over consecutive windows (the reference's shards), each given the
        # pieces of its own windows in ``order``, then joined.
        rows_per_part = 6 // parts
        meters = [QualityMeter(windows[p * rows_per_part:(p + 1) * rows_per_part],
                               {n: t[p * rows_per_part:(p + 1) * rows_per_part]
                                for n, t in reference.items()}) for p in range(parts)]
        for i in order:
            rows, positions = pieces[i]
            part, start = divmod(rows.start, rows_per_part)
            local = slice(start, start + rows.stop - rows.start)
            meters[part].add(local, positions, log_q[rows, positions])
        return QualityMeter.joined(windows, meters, reference).scores()

    one = measured(list(range(len(pieces))), parts=1)
    split = measured(list(reversed(range(len(pieces)))), parts=3)
    assert one == split
    assert one.eval_tokens == 6 * 8 and one.kl_divergence > 0


@pytest.mark.parametrize("top_k", [64, None])
def test_scores_are_the_same_bits_at_any_torch_thread_count(top_k):
    # CPU slots lend each other idle cores mid-eval, and torch splits a large sum over its
    # threads: a job rerun under another load must still give the same figures. (Whether a
    # split sum rounds differently depends on the values: a plain torch sum failed this for
    # 2 of these 12 cases.)
    import torch

    from quantdask.measure.metrics import QualityMeter, reference_slice

    before = torch.get_num_threads()
    try:
        for seed in range(6):
            torch.manual_seed(seed)
            windows = torch.randint(0, 320, (8, 128))  # a demo batch: 8 x 127 x 64 KL terms
            log_p = torch.log_softmax(3 * torch.randn(8, 127, 320), -1)
            log_q = torch.log_softmax(log_p + 0.3 * torch.randn(8, 127, 320), -1)
            reference = reference_slice(log_p, top_k)
            scores = []
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                meter = QualityMeter(windows, reference)
                meter.add(slice(0, 8), slice(0, 127), log_q)
                scores.append(meter.scores())
            assert scores[0] == scores[1] == scores[2], seed
    finally:
        torch.set_num_threads(before)


def test_per_layer_errors_are_the_same_bits_at_any_torch_thread_count():
    # A loaded run saw a rerun's weight_rel_error of one layer differ in its 8th digit.
    import torch

    from quantdask.measure.layers import _sum_of_squares

    before = torch.get_num_threads()
    try:
        for seed in range(6):
            torch.manual_seed(seed)
            weight = torch.randn(128, 384)  # a demo down_proj: 49k terms
            sums = []
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                sums.append(_sum_of_squares(weight))
            assert sums[0] == sums[1] == sums[2], seed
            assert sums[0] == pytest.approx(float(weight.double().pow(2).sum()), rel=1e-6)
    finally:
        torch.set_num_threads(before)


def test_every_error_bar_and_percentile_is_numpys_on_the_per_position_values(independent,
                                                                             records):
    """The spread figures of the exact run against numpy on per-position values computed here
    from transformers alone: standard errors over windows (the spread of the window means over
    the square root of their number), top-1's binomial error over tokens, percentiles over
    positions, and the paired ln PPL ratio against the unquantized model."""
    import numpy as np

    exact, _ = records
    record = exact["fp4"]
    log_p, log_q = independent["log_p"].numpy(), independent["log_q"].numpy()
    targets = independent["windows"][:, 1:].numpy()[..., None]
    nll_q = -np.take_along_axis(log_q, targets, -1)[..., 0]
    nll_p = -np.take_along_axis(log_p, targets, -1)[..., 0]
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    delta_p = np.exp(-nll_q) - np.exp(-nll_p)

    def window_se(values):
        return values.mean(axis=1).std(ddof=1) / math.sqrt(values.shape[0])

    top1 = (log_p.argmax(-1) == log_q.argmax(-1)).mean()
    expected = {
        "ln_ppl_se": window_se(nll_q), "kl_se": window_se(kl),
        "kl_median": np.percentile(kl, 50), "kl_p90": np.percentile(kl, 90),
        "kl_p99": np.percentile(kl, 99), "kl_p999": np.percentile(kl, 99.9), "kl_max": kl.max(),
        "top1_agreement_se": math.sqrt(top1 * (1 - top1) / kl.size),
        "delta_p_mean": delta_p.mean(), "delta_p_se": window_se(delta_p),
        "delta_p_rms": math.sqrt((delta_p ** 2).mean()),
        **{name: np.percentile(delta_p, q) for name, q in (
            ("delta_p_p01", 1), ("delta_p_p05", 5), ("delta_p_median", 50),
            ("delta_p_p95", 95), ("delta_p_p99", 99))},
        "ln_ppl_ratio": (nll_q - nll_p).mean(), "ln_ppl_ratio_se": window_se(nll_q - nll_p),
    }
    for name, value in expected.items():
        # quantdask's log-probs are float32, these float64: a per-position KL of 6e-5 differs
        # by 2e-7 between the two, so the tolerance is relative to the figure's own scale.
        scale = {"kl": kl.mean(), "de": math.sqrt((delta_p ** 2).mean())}.get(name[:2], 0.0)
        assert record[name] == pytest.approx(value, rel=2e-3, abs=1e-3 * scale), name
    assert record["ln_ppl_ratio"] == pytest.approx(
        math.log(record["perplexity"] / exact["baseline"]["perplexity"]), rel=1e-6)
    # The baseline against itself: no change, no spread of it.
    baseline = exact["baseline"]
    for name in ("kl_divergence", "kl_se", "kl_max", "delta_p_mean", "delta_p_rms",
                 "ln_ppl_ratio", "ln_ppl_ratio_se", "top1_agreement_se"):
        assert baseline[name] == 0, name
    assert baseline["ln_ppl_se"] == pytest.approx(window_se(nll_p), rel=2e-3)


def test_the_windows_frame_holds_each_windows_means(independent):
    """The per-window rows a paired comparison needs: each window's mean KL, NLL, top-1 and
    change in the correct token's probability, against numpy on transformers' own values."""
    import numpy as np

    outcome = run_job(jobs()["fp4"], get_backend("bitsandbytes"))
    log_p, log_q = independent["log_p"].numpy(), independent["log_q"].numpy()
    targets = independent["windows"][:, 1:].numpy()[..., None]
    nll_q = -np.take_along_axis(log_q, targets, -1)[..., 0]
    nll_p = -np.take_along_axis(log_p, targets, -1)[..., 0]
    expected = {"kl": (np.exp(log_p) * (log_p - log_q)).sum(-1).mean(1),
                "ln_ppl": nll_q.mean(1),
                "top1_agreement": (log_p.argmax(-1) == log_q.argmax(-1)).mean(1),
                "delta_p": (np.exp(-nll_q) - np.exp(-nll_p)).mean(1)}
    assert [row["window"] for row in outcome.rows["windows"]] == list(range(SAMPLES))
    assert {row["tokens"] for row in outcome.rows["windows"]} == {SEQ_LEN - 1}
    for name, values in expected.items():
        scale = np.abs(values).mean()
        for row, value in zip(outcome.rows["windows"], values):
            assert row[name] == pytest.approx(value, rel=2e-3, abs=1e-3 * scale), name
