"""A run's lifecycle: plan, train, evaluate, record, resume, re-score, load a finished one.
This file imports nothing."""
