"""Offline evaluation (issue #4, docs/method.md §10): accepted length per round on the paper's benchmarks.

    prompts.py       the benchmark prompts (../shared/data/eval)
    runner.py        one benchmark's conversations through the engine, every round recorded
    acceptance.py    statistics over recorded rounds: τ, position-wise acceptance, threshold sweep, reliability
    offline_eval.py  drafters x temperatures x γ x benchmarks, the work-dir cache, the results JSON
    report.py        Table 1 and the other markdown tables
    plots.py         the PNG figures (Figs. 2, 4, 5, 6)
    cli.py           `dspark eval`
"""
