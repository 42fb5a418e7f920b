"""Tests of jaxcomm.compressors."""
