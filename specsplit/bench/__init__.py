"""The benchmark harness behind ``specsplit bench`` (optional: ``import specsplit`` never loads it)."""
