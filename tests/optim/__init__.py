"""Tests of jaxcomm.optim."""
