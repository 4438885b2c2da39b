"""Where a run's time and money went. Entry: ``fineflow.stages.goodput``. MFU/HFU are the train stage's
(``fineflow.train.flops``).

ledger.py   the goodput ledger: the run's wall time from the journal, split into buckets
cost.py     what the run cost: wall time x devices x a price per device-hour (params.yaml ``cost:``)
chart.py    the buckets as a stacked bar (PNG, offline) and the runs' history as DVC plot data
doctor.py   the bottleneck doctor: what starved the devices, with the evidence and the param to change
"""
