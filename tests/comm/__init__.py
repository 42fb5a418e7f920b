"""Tests of jaxcomm.comm."""
