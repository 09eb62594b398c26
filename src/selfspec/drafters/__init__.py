"""Drafters: layer-skip self-drafting (chains and trees), S3D mask-token drafting."""
