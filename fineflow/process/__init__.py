"""Process supervision, not training: how every layer of a run (the flow, `dvc repro`, a stage, its launcher, the
ranks) stops on a signal promptly and resumably, and leaves no orphan.

preempt.py     stop signals through every layer: the step saved, the ranks stopped, the budgets, no orphans
"""
