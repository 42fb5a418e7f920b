"""The calls and defaults the pages quote match the library's signatures.

* Every ``jc.NAME(...)`` call written inline in README.md or docs/**/*.md (the pick table's
  calls, the guides' one-liners) binds to ``NAME``'s signature: its keywords exist and its
  positional arguments fit. ``...`` stands for arguments left out.
* An inline ``name=value`` next to the word "default" quotes a real default: some public
  function or class of ``jaxcomm`` with a parameter ``name`` defaults to ``value`` (and next to
  "not the default", none does).
"""

import ast
import inspect
import re
from pathlib import Path

import pytest

import jaxcomm as jc

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
INLINE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def inline_code(page: Path):
    text = FENCE.sub("", page.read_text())
    for para in re.split(r"\n\s*\n", text):
        for code in INLINE.findall(para):
            yield para, code


def jc_calls(code: str):
    """The ``jc.NAME(...)`` calls in an inline expression (nested ones too)."""
    try:
        tree = ast.parse(code.strip(), mode="eval")
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "jc"
        ):
            yield node


def binds(fn, call: ast.Call) -> str | None:
    """None if ``call``'s arguments fit ``fn``'s signature, else why not."""
    sig = inspect.signature(fn)
    elided = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in call.args)
    keywords = [k.arg for k in call.keywords if k.arg is not None]
    params = sig.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in keywords if k not in params and not takes_kwargs]
    if unknown:
        return f"no parameter {unknown}"
    if elided:
        return None
    args = [object()] * len(call.args)
    try:
        sig.bind_partial(*args, **dict.fromkeys(keywords, object()))
    except TypeError as e:
        return str(e)
    return None


def quoted_calls():
    for page in PAGES:
        for _, code in inline_code(page):
            for call in jc_calls(code):
                yield pytest.param(call, code, id=f"{page.relative_to(ROOT)}:{code[:40]}")


CALLS = list(quoted_calls())


def test_pages_quote_calls():
    assert len(CALLS) >= 10


@pytest.mark.parametrize("call, code", CALLS)
def test_quoted_call_fits_the_signature(call, code):
    fn = getattr(jc, call.func.attr, None)
    assert fn is not None, f"jc.{call.func.attr} does not exist ({code})"
    why = binds(fn, call)
    assert why is None, f"{code}: {why}"


def public_defaults() -> dict[str, list]:
    """Every parameter name of a public ``jc`` callable, with the defaults it has."""
    out: dict[str, list] = {}
    for name in jc.__all__:
        obj = getattr(jc, name)
        if not callable(obj):
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        for p in sig.parameters.values():
            if p.default is not p.empty:
                out.setdefault(p.name, []).append(p.default)
    return out


def documented_defaults():
    pattern = re.compile(r"^(\w+)=(.+)$")
    for page in PAGES:
        for para, code in inline_code(page):
            m = pattern.match(code.strip())
            if not m or "default" not in para.lower():
                continue
            # "name=value" right before "(the default)", "by default" or "defaults to"
            around = para[para.index(code) - 40 : para.index(code) + len(code) + 40].lower()
            if "default" not in around:
                continue
            negated = "not the default" in around or "non-default" in around
            yield pytest.param(
                m.group(1), m.group(2), negated, id=f"{page.relative_to(ROOT)}:{code}"
            )


DOCUMENTED = list(documented_defaults())


@pytest.mark.parametrize("name, value, negated", DOCUMENTED)
def test_a_documented_default_is_a_default(name, value, negated):
    defaults = public_defaults()
    if name not in defaults:
        pytest.skip(f"{name} is not a parameter of a public jc callable")
    try:
        want = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        want = value
    reprs = {repr(d) for d in defaults[name]} | {str(d) for d in defaults[name]}
    is_default = want in defaults[name] or value in reprs
    if negated:  # "(not the default)": it must not be one
        assert not is_default, f"the docs say {name}={value} is not the default; it is"
    else:
        assert is_default, (
            f"the docs call {name}={value} a default; the signatures say {defaults[name]}"
        )


def test_a_wrong_keyword_is_caught():
    (call,) = jc_calls("jc.SparseLoCo(topk=128)")
    assert "no parameter" in binds(jc.SparseLoCo, call)
    outer, _ = jc_calls("jc.diloco(..., compressor=jc.OneBit())")
    assert binds(jc.diloco, outer) is None
