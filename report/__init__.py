"""What reads results rather than training, one file a role; no recipe imports it.

    results_table.py  the results table: each optimized run beside its baseline (`make report`)
    charts.py         the PNGs beside report.md, from the same pairings
    traces.py         where each traced step's time went (`make traces`)
    costmodel.py      the step-time model: a record's work priced at a calibration, or a
                      planned step at a GPU's rates
    calibrate.py      this host's rates for it (`make calibrate`)
    plan_input.py     the planner's flags as the numbers the scripts' PLANNED formulas take
    planner.py        the planner's candidates (`make plan`): each strategy's memory and bytes
                      a GPU, its step, and the pick
    plan_print.py     the plan as tables and the pick in a sentence
    plan_cases.py     the worked cases (`make plan --cases`), each beside its dry run
    gpus.py           the GPUs the planner prices a step on: datasheets, sources, achieved shares
    dryrun.py         the dry runs' table (`make dryrun`)
    runs.py           runs seen from the Makefile: a failed run's line and record, `make smoke`
    cli.py            the command line, `python -m report [report|traces|plan|calibrate|...]`
"""
