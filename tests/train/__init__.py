"""Tests of jaxcomm.train."""
