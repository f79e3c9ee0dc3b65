"""What reads results rather than training, one file a role; no recipe imports it.

    results_table.py  the results table: each optimized run beside its baseline (`make report`)
    charts.py    the PNGs beside report.md, from the same pairings
    traces.py    where each traced step's time went (`make traces`)
    planner.py   which strategy fits a model on a cluster, its bytes and its step time
                 (`make plan`)
    gpus.py      the GPUs the planner prices a step on: datasheets, sources, achieved shares
    calibrate.py this host's rates for the step-time model (`make calibrate`)
    runs.py      runs seen from the Makefile: a failed run's line and record, `make smoke`
    cli.py       the command line, `python -m report [report|traces|plan|calibrate|list|...]`
"""
