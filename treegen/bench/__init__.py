"""Side-by-side benchmark harness."""
