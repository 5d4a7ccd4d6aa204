"""Loads for the engine: Poisson arrivals with length distributions, traces, scenarios."""
