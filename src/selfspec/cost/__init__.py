"""Measured costs of forwards on this machine, and the economy that prices drafts with them."""
