"""The model wrapper: loading, and the forward pass with a skip set over an explicit cache."""
