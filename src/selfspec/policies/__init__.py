"""Policies: which layers to skip (static, ASD, SWIFT)."""
