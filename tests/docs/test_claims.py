"""Every measured number a user reads has a source next to it.

A *claim* is a number with a unit or a ratio (``5.7x``, ``+19.0%``, ``8.4 MB``, ``0.67 s``,
``10 minutes``) or "hundreds of times". In README.md, docs/**/*.md, the comments and
docstrings of examples/*.py and the docstrings of the library (``jaxcomm/``, rendered as the
API reference; not the command line's), each claim must sit in a paragraph (or list item, or
table) that names its source: a results file under ``benchmarks/results/`` that exists, or
inside a block rendered from one (``<!-- BEGIN generated: ... -->``, see
``benchmarks/render_tables.py``) or quoted from one (``<!-- BEGIN sourced:
benchmarks/results/FILE -->`` ... ``<!-- END sourced -->``, whose every claimed number must
appear in that file). Inline code, indented code blocks and the code of fenced blocks are
settings or formulas, not claims (the comments of fenced blocks are read); in docstrings, so
are the ``>>>`` examples with their output, and the indented blocks in a Google-style text
section (``Examples:``, ``Note:``). A few numbers are definitions, not measurements, and are
allowed anywhere: ``ALLOWED``.
"""

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
LIBRARY = sorted(
    p for p in (ROOT / "jaxcomm").rglob("*.py") if "cli" not in p.relative_to(ROOT).parts[:2]
)

NUMBER = r"\d+(?:[.,]\d+)*"
RANGE = rf"[+-]?{NUMBER}(?:\s*(?:-|to)\s*{NUMBER})?"
UNIT = (
    r"x\b|%|(?:[KMGT]i?B|[KMGT]bit/s|[KMGT]B/s)\b|bytes?\b|bits?\b|ms\b|s\b|seconds?\b"
    r"|minutes?\b|min\b|hours?\b|times\b"
)
CLAIM = re.compile(rf"(?<![\w.^/-]){RANGE}\s*(?:{UNIT})")
VAGUE = re.compile(r"\b(?:tens|hundreds|thousands) of times\b", re.I)

# Definitions: what a format or a setting is, not what was measured.
ALLOWED = [
    r"\b(?:2|4|8|32)x fewer bytes than fp32",  # 16, 8, 4 or 1 bit instead of 32 per element
    r"\b\d+% (?:of the steps )?by default\b",  # a setting's default
    r"\b\d+ ?ms of added latency\b",  # a link's set-up
    r"\b\d+(?:\.\d+)? (?:Gbit|Mbit)/s\b",  # a link's rate: the set-up of a measurement
    r"\b\d+ ?(?:bits?|-bit)\b",  # a format's width (int8, 4 bits)
    r"\b\d+(?:\.\d+)? ?[KMG]iB\b",  # a buffer or bucket size (a setting)
    r"\b\d+(?:\.\d+)? bytes? (?:an?|per) (?:element|value|scale)\b",  # a format's width
    r"\b512-byte\b",
    r"\b\d+x\d+(?:x\d+)?\b",  # a shape or a topology (2x2, 64x64)
    r"\b\d+ x \d+ (?:tiles?|blocks?)\b",  # a tile's shape (64 x 64 tile)
]

GENERATED = re.compile(r"<!-- BEGIN generated: ([\w-]+) .*?<!-- END generated: \1 -->", re.S)
SOURCED = re.compile(r"<!-- BEGIN sourced: (\S+) -->(.*?)<!-- END sourced -->", re.S)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE_CODE = re.compile(r"``[^`]+?``|`[^`\n]*`")  # ``code`` may wrap a line
SOURCE = re.compile(r"benchmarks/results/([\w./-]+\.(?:json|md))")


def _strip_blocks(text: str) -> str:
    """Blank out what is rendered or quoted from a results file (checking that the file
    exists), and the code of fenced blocks (keeping their comments), keeping line numbers."""

    def blank(m: re.Match) -> str:
        return "\n" * m.group(0).count("\n")

    def sourced(m: re.Match) -> str:
        path = ROOT / m.group(1)
        assert path.is_file(), f"a sourced block names {m.group(1)}, which does not exist"
        source = path.read_text()
        quoted = INLINE_CODE.sub(" ", m.group(2))
        for claim in CLAIM.finditer(quoted):
            for number in re.findall(NUMBER, claim.group(0)):
                assert number in source, f"{number} ({claim.group(0)}) is not in {m.group(1)}"
        return blank(m)

    def comments_only(m: re.Match) -> str:
        lines = m.group(1).split("\n")
        kept = [line[line.index("#") :] if "#" in line else "" for line in lines]
        return "\n" + "\n".join(kept) + "\n"

    text = GENERATED.sub(blank, text)
    text = SOURCED.sub(sourced, text)
    return FENCE.sub(comments_only, text)


def paragraphs(text: str):
    """(first line number, text) of each paragraph, list item or table."""
    start, lines = None, []
    for number, line in enumerate(text.split("\n"), 1):
        new_item = re.match(r"\s*(?:[-*] |\d+\. |\|)", line) and not line.startswith("|")
        if not line.strip() or (new_item and lines):
            if lines:
                yield start, "\n".join(lines)
            start, lines = None, []
        if line.strip():
            if start is None:
                start = number
            lines.append(line)
    if lines:
        yield start, "\n".join(lines)


def unsourced_claims(text: str) -> list[tuple[int, str]]:
    """The claims of ``text`` (markdown) whose paragraph names no existing results file."""
    found = []
    for line, para in paragraphs(_strip_blocks(text)):
        if all(row.startswith(("    ", "\t")) for row in para.split("\n")):
            continue  # an indented code block (a formula)
        sources = SOURCE.findall(para)
        if sources and all((ROOT / "benchmarks" / "results" / s).exists() for s in sources):
            continue
        prose = re.sub(r"\s+", " ", INLINE_CODE.sub(" ", para))  # a wrapped line is one space
        for allowed in ALLOWED:
            prose = re.sub(allowed, " ", prose)
        claims = [m.group(0) for m in CLAIM.finditer(prose)] + VAGUE.findall(prose)
        found += [(line, c) for c in claims]
    return found


def example_prose(path: Path) -> str:
    """The comments and docstrings of an example, as paragraphs."""
    text = path.read_text()
    docstrings = re.findall(r'"""(.*?)"""', text, re.S)
    comments = [m.group(1) for m in re.finditer(r"#\s?(.*)$", text, re.M)]
    return "\n\n".join(docstrings + comments)


# Google-style sections: mkdocstrings renders the body of a text section as markdown, dedented,
# and the entries of a list section (one name each) as prose.
TEXT_SECTION = re.compile(r"(?:Examples?|Notes?|References|See Also|Warnings?):\s*")
LIST_SECTION = re.compile(
    r"(?:Args|Arguments|Attributes|Keyword Args|Methods|Other Parameters|Parameters|Raises|"
    r"Returns|Yields):\s*"
)


def docstring_text(raw: str) -> str:
    """A docstring as the markdown a reader sees, one line per source line: dedented like
    ``inspect.cleandoc`` (keeping leading blank lines), each Google-style section's body
    dedented (a text section's by one level, so that an indented block in it reads as code; a
    list section's entries entirely), and the ``>>>`` examples with their output (up to a
    blank line) blanked."""
    first, *rest = raw.expandtabs().split("\n")
    lines = [first.strip(), *textwrap.dedent("\n".join(rest)).split("\n")]
    # body: None (no section), "list", "next" (a text section's header) or its body's indent
    out, body, example = [], None, False
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if LIST_SECTION.fullmatch(line):
            body = "list"
        elif TEXT_SECTION.fullmatch(line):
            body = "next"
        elif line.strip() and indent == 0:
            body = None
        elif line.strip() and body == "next":
            body = indent
        if body == "list":
            line = line.lstrip()
        elif isinstance(body, int) and not line[:body].strip():
            line = line[body:]
        if not line.strip():
            example = False
        elif line.lstrip().startswith(">>>"):
            example = True
        out.append("" if example else line)
    return "\n".join(out)


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line of the opening quotes, text as :func:`docstring_text`) of the module's, classes',
    functions' and methods' docstrings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if isinstance(first.value.value, str):
                found.append((first.lineno, docstring_text(first.value.value)))
    return found


def unsourced_docstring_claims(path: Path) -> list[str]:
    """``path:line: claim`` for each unsourced claim of the docstrings of ``path`` (``line``:
    the first of the claim's paragraph)."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [
        f"{where}:{start + line - 1}: {claim}"
        for start, text in docstrings(path)
        for line, claim in unsourced_claims(text)
    ]


@pytest.mark.parametrize("page", PAGES + EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_has_a_source(page):
    text = example_prose(page) if page.suffix == ".py" else page.read_text()
    found = unsourced_claims(text)
    assert not found, (
        f"{page.relative_to(ROOT)}: numbers with no results file in their paragraph "
        f"(link benchmarks/results/..., or remove them): {found}"
    )


@pytest.mark.parametrize("module", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_in_a_docstring_has_a_source(module):
    found = unsourced_docstring_claims(module)
    assert not found, (
        "numbers in docstrings with no results file in their paragraph (name the "
        "benchmarks/results/... file that holds them there, or remove them):\n"
        + "\n".join(found)
    )


def test_unsourced_numbers_in_docstrings_are_caught(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text(
        '"""A module.\n\nCompressed, it is 5.7x faster.\n"""\n\n\n'
        "def f(x):\n"
        '    """Sum.\n\n    Args:\n      x: an array (sums 3 GB/s).\n\n'
        "          Its second paragraph: 8.4 MB.\n\n"
        "    Examples:\n      >>> f(1)\n      2.5x\n\n"
        '      It takes 10 minutes.\n    """\n'
        "\n\nclass C:\n"
        '    def g(self):\n        """``8.4 MB`` of code; 0.67 s measured."""\n'
    )
    assert unsourced_docstring_claims(module) == [
        f"{module}:3: 5.7x",
        f"{module}:10: 3 GB",
        f"{module}:13: 8.4 MB",
        f"{module}:19: 10 minutes",
        f"{module}:25: 0.67 s",
    ]


def test_sourced_and_defined_numbers_in_docstrings_pass(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text(
        'def f(x):\n    """Sum.\n\n'
        "    DeMo sent 55.4x fewer bytes\n"
        "    (``benchmarks/results/time_to_loss_small_100mbit.json``).\n\n"
        "    Bytes: ``2 (n-1)/n * 2 N``, 2x fewer bytes than fp32; over the 8\n"
        "    bits of a row; a 64 x 64 tile.\n\n"
        "    Examples:\n      >>> 2 * 3\n      6 s\n\n"
        "      A formula::\n\n          t = 5 ms x 3\n"
        '    """\n'
    )
    assert unsourced_docstring_claims(module) == []


@pytest.mark.parametrize(
    "text",
    [
        "Compressed, it sends 5-20x less traffic than Adam.",
        "- DiLoCo: 200-400x with int8 or int4.",
        "The demo takes about 10 minutes.",
        "CPU timings move by 5-10% between runs.",
        "One all-reduce per H steps gives hundreds of times less traffic.",
        "It ends 3.3% better.",
        "A sync of 8.4 MB takes 0.67 s.",
        "Rounds vary.\n<!-- BEGIN sourced: benchmarks/results/no_such_file.json -->\n"
        "<!-- END sourced -->\n2x faster.",
    ],
)
def test_unsourced_numbers_are_caught(text):
    try:
        assert unsourced_claims(text)
    except AssertionError as e:  # a sourced block naming a missing file fails loudly too
        assert "does not exist" in str(e) or not str(e)


@pytest.mark.parametrize(
    "text",
    [
        "1-bit: about 32x fewer bytes than fp32.",
        "Two processes on a link shaped to 1 Gbit/s, buckets of 256 KiB, a v5e 2x2.",
        "DeMo: 55.4x fewer bytes (`benchmarks/results/time_to_loss_small_100mbit.json`).",
        "<!-- BEGIN generated: choose (x) -->\n| 5.7x less |\n<!-- END generated: choose -->",
        "```python\nx = 5e-2 * 10  # a setting\n```",
        "Each device sends\n\n    2 (n - 1) / n  x  N  x  b / 8  bytes,\n\nper step.",
    ],
)
def test_definitions_and_sourced_numbers_pass(text):
    assert unsourced_claims(text) == []


def test_a_sourced_block_quotes_its_file():
    good = "<!-- BEGIN sourced: benchmarks/results/gpu_h200_one_device.md -->\n2.46 ms\n"
    assert unsourced_claims(good + "<!-- END sourced -->") == []
    with pytest.raises(AssertionError, match="is not in"):
        unsourced_claims(good.replace("2.46", "1.23") + "<!-- END sourced -->")


def test_the_changelog_says_the_net_change_without_lab_notes():
    """Unreleased is what a user sees change (history stays in git): short, and without issue
    numbers, commit hashes or scratch paths."""
    text = (ROOT / "CHANGELOG.md").read_text()
    unreleased = text[text.index("## [Unreleased]") : text.index("\n## [", text.index("## [U") + 1)]
    assert unreleased.count("\n") < 120, "CHANGELOG's Unreleased: at most 120 lines"
    assert not re.findall(r"\(#\d+|\bissue \d+|#\d+\)", unreleased, re.I)
    assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", unreleased)
    assert "/tmp/" not in unreleased


def test_results_files_record_commands_a_user_can_run():
    """The provenance of every results file names no scratch or checkout path."""
    import json

    for path in sorted((ROOT / "benchmarks" / "results").rglob("*.json")):
        doc = json.loads(path.read_text())
        runs = doc.get("runs") if isinstance(doc.get("runs"), list) else []
        commands = [doc.get("command") or ""]
        commands += [r.get("command", "") for r in runs if isinstance(r, dict)]
        for text in [*commands, doc.get("note") or ""]:
            assert not re.search(r"/tmp/|/work/|/home/", text), (path.name, text)
