"""Readers of finished runs: the sweep report and the inspector. This file imports nothing."""
