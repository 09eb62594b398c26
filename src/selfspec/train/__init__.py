"""Training and fitting: S3D speed model."""
