"""The ``Examples:`` blocks of the library's docstrings run, and the public collectives have one."""

import doctest
import importlib
import pkgutil

import pytest

import jaxcomm
import jaxcomm as jc

# The library's modules (the tools are not library: they have their own tests).
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(jaxcomm.__path__, "jaxcomm.")
    if not m.name.startswith("jaxcomm.cli") and m.name != "jaxcomm.__main__"
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=FLAGS, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


@pytest.mark.parametrize(
    "fn",
    [
        jc.compressed_psum,
        jc.compressed_pmean,
        jc.compressed_psum_scatter,
        jc.compressed_pmean_scatter,
        jc.compressed_all_gather,
        jc.hierarchical_psum,
        jc.init_state,
    ],
    ids=lambda f: f.__name__,
)
def test_public_collectives_have_examples(fn):
    examples = doctest.DocTestParser().get_examples(fn.__doc__ or "")
    assert "Examples:" in fn.__doc__ and examples, f"{fn.__name__} has no runnable example"
