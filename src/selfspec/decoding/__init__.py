"""The decode loop, its candidate trees, acceptance rules and statistics."""
