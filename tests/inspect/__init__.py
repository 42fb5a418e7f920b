"""Tests of jaxcomm.inspect."""
