"""Prefect tasks: thin wrappers that run one DVC stage each and publish its report."""
