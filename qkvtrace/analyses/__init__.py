"""Analyses: what runs traces or reads records to answer a question -- advise, ablate, check, probes,
the walkthrough, gradients' routes, reports, their diffs and history. Below the views and the command line."""
