"""NumPy reference models, written from the papers and upstream code."""
