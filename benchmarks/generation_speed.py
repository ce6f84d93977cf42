"""Generation speed of the demo sweep's configs on CPU slots (the speed block).

    .venv/bin/python -m benchmarks.generation_speed [--slots 1] [--batch-sizes 1,8]

The demo sweep (the demo model, 6 bitsandbytes configs and the baseline) with a speed block:
prompts of 128 tokens of the eval text, exactly 64 new tokens each, one warm-up run, 3 timed
runs, at each batch size; task accuracy off (timing only). Prints the speed frame with each
config's speed-up against the baseline. CPU speed says nothing about GPU speed: bitsandbytes'
CPU kernels are not its CUDA ones.
"""

from __future__ import annotations

import argparse
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # One slot: a CPU slot's device is the machine's cores, which other slots' jobs would share.
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,8")
    args = parser.parse_args()

    import dataclasses

    import polars as pl

    import quantdask as qd
    from quantdask.demo_model import load_demo_sweep
    from quantdask.sweepfile.speed import SpeedSettings

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    sweep = dataclasses.replace(
        load_demo_sweep(), tasks=None, gates=[], layer_stats=False, searches=[], calibration=None,
        speed=SpeedSettings(prompt_length=128, new_tokens=64, batch_sizes=sizes, warmup=1,
                            repeats=3))
    with tempfile.TemporaryDirectory() as run_dir, qd.start_cluster(workers=args.slots) as c:
        results = qd.run_sweep(sweep, run_dir, c.client)
        speed = qd.read_speed(run_dir)
    table = speed.join(results.select("job_id", "config_label", "kl_divergence"),
                       on="job_id").sort("batch_size", "decode_tokens_per_s",
                                         descending=[False, True]).select(
        "batch_size", "config_label", "device", "exclusive", "other_slots_busy",
        (pl.col("ttft_s") * 1000).round(1).alias("ttft ms"),
        (pl.col("decode_s_p50") * 1000).round(2).alias("decode ms p50"),
        (pl.col("decode_s_p90") * 1000).round(2).alias("decode ms p90"),
        pl.col("decode_tokens_per_s").round(0).alias("decode tok/s"),
        pl.col("decode_speedup").round(2).alias("decode speed-up"),
        pl.col("prefill_speedup").round(2).alias("prefill speed-up"),
        pl.col("kl_divergence").round(5).alias("KL"))
    with pl.Config(tbl_formatting="MARKDOWN", tbl_hide_column_data_types=True,
                   tbl_hide_dataframe_shape=True, tbl_rows=-1, tbl_cols=-1):
        print(table)


if __name__ == "__main__":
    main()
