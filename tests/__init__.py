"""Tests of the library, one folder per subpackage of jaxcomm/ (see tests/test_package.py)."""
