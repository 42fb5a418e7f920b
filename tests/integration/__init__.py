"""Multi-process runs, hangs, faults, soaks and long runs, and the accelerator compile."""
