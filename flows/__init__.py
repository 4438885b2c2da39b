"""Prefect flows: they only sequence the stage tasks."""
