"""Tests of jaxcomm.elastic."""
