"""Tests of jaxcomm.runtime."""
