"""Offline search for a skip set (Draft & Verify style Bayesian optimisation)."""
