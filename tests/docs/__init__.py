"""The README, docs pages, docstring examples and examples/ run and say what their sources say."""
