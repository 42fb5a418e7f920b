"""Tests of jaxcomm.cli."""
