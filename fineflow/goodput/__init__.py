"""Where a run's time and money went: the goodput ledger (``ledger``), its cost (``cost``), the charts
(``chart``) and the bottleneck doctor (``doctor``). MFU/HFU are the train stage's (fineflow.train.flops)."""
