"""Serving benchmark (issue #6, docs/method.md §10, Figs. 7 and 8): load against the OpenAI API, and its report.

    serve_prompts.py   the prompt mix: math / code / chat sets of ../shared/data/eval, interleaved
    serve_stats.py     one request's record (TTFT, per-user decode speed, speculative statistics)
                       and one load point's summary (throughput, percentiles, verification budget)
    serve_csv.py       docs/results/serving.csv: the row format, merge with de-duplication
    serve_metrics.py   the server's /metrics (Prometheus text), read for the verifier batch size
    serve_load.py      the asyncio load generator: closed-loop concurrency and open-loop Poisson
    serve_process.py   `dspark serve` as a subprocess on a free port, per policy
    serve_plots.py     Fig. 7 frontier, Fig. 8 budget, the markdown summary
    cli.py             `dspark bench serve | plot`

Nothing here imports torch: the load generator is a plain HTTP client and may run anywhere.
"""
