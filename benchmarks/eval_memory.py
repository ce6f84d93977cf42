"""Peak worker memory, reference size and wall time as the eval and the vocabulary grow.

    .venv/bin/python -m benchmarks.eval_memory [--vocab 128256] [--windows 8,64] [--seq-len 2048]

For each eval size, a sweep of one model (a tiny Llama body under a wide output layer:
``--vocab`` tokens, the vocabulary of Llama 3 by default; random weights) with the baseline and
one nf4 config, on a local cluster of 2 CPU slots, in a fresh run directory. The eval text is
generated here (the demo's generator) long enough for the largest eval. Prints a Markdown table:
windows x seq_len, eval tokens, tokens x vocab, the reference's bytes (its tensors' sizes),
each job's peak worker memory (peak RSS of the worker process while the job ran;
the reference's is the baseline's), and the sweep's wall time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def build_model(out: Path, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantdask.demo_model import DEMO_MODEL_DIR

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # 320 tokens: all < vocab
        (out / name).write_bytes((Path(DEMO_MODEL_DIR) / name).read_bytes())
    return out


def eval_text(path: Path, tokens: int, model: Path) -> Path:
    from transformers import AutoTokenizer

    from quantdask.demo_model import generate_text

    tokenizer = AutoTokenizer.from_pretrained(model)
    sentences = 2_000
    while True:
        text = generate_text(sentences, seed=7)
        if len(tokenizer(text)["input_ids"]) >= tokens:
            path.write_text(text, encoding="utf-8")
            return path
        sentences *= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--windows", default="8,64")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--kl-top-k", default=None, help="eval.kl_top_k (default: quantdask's)")
    parser.add_argument("--kl-tail-samples", type=int, default=None,
                        help="eval.kl_tail_samples (default: quantdask's; 0: the lower bound)")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "quantdask-evalmem"))
    args = parser.parse_args()
    import quantdask as qd

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    windows = [int(w) for w in args.windows.split(",")]
    model = build_model(work / f"llama-{args.vocab}", args.vocab)
    text = eval_text(work / "eval.txt", max(windows) * args.seq_len, model)
    print("| windows x seq_len | eval tokens | tokens x vocab | reference bytes | peak worker "
          "memory: baseline (reference) | nf4 | sweep wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in windows:
        evaluation = {"text": str(text), "seq_len": args.seq_len, "samples": n,
                      "batch_size": args.batch_size}
        if args.kl_top_k:
            evaluation["kl_top_k"] = (args.kl_top_k if args.kl_top_k == "all"
                                      else int(args.kl_top_k))
        if args.kl_tail_samples is not None:
            evaluation["kl_tail_samples"] = args.kl_tail_samples
        sweep = qd.sweep_from_dict({
            "name": f"evalmem-{n}", "models": [{"name": "wide", "path": str(model)}],
            "backends": [{"backend": "bitsandbytes", "configs": [{"bits": 4}]}],
            "eval": evaluation, "timeout_s": 3600})
        run_dir = work / f"run-{n}-{time.time_ns()}"
        started = time.perf_counter()
        with qd.start_cluster(workers=2, dashboard_address=None) as cluster:
            results = qd.run_sweep(sweep, run_dir, cluster.client)
        wall = time.perf_counter() - started
        reference_bytes = reference_nbytes(sweep.eval, args.vocab)
        assert (results["status"] == "done").all(), results.select("status", "error_message")
        peak = dict(zip(results["config_label"], results["peak_host_rss_bytes"], strict=True))
        tokens = int(results["eval_tokens"][0])
        print(f"| {n} x {args.seq_len} | {tokens:,} | {tokens * args.vocab:,} | "
              f"{reference_bytes / 2**20:,.1f} MiB | {peak['baseline'] / 2**20:,.0f} MiB | "
              f"{peak['nf4'] / 2**20:,.0f} MiB | {wall:.1f} |", flush=True)
        (run_dir / "benchmark.json").write_text(json.dumps(
            {"windows": n, "reference_bytes": reference_bytes, "wall_s": wall, "peak": peak}))


def reference_nbytes(settings, vocab: int) -> int:
    """The bytes of a model's reference on ``settings``: its windows (int64) and, per predicted
    token, k int32 ids + k float32 log-probs + one float32 rest mass + m tail samples (int32 id
    and float32 log-prob each) (or vocab float32), and the next token's float64 log-prob."""
    positions = settings.samples * (settings.seq_len - 1)
    per_position = 8 + (4 * vocab if settings.top_k is None
                        else 8 * settings.top_k + 4 + 8 * settings.tail_samples)
    return settings.samples * settings.seq_len * 8 + positions * per_position


if __name__ == "__main__":
    main()
