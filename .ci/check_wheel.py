"""Check a built wheel's contents and metadata against pyproject.toml (run by make wheel)."""

import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement


def _parsed(requirements):
    return sorted((r.name, str(r.specifier)) for r in map(Requirement, requirements))


def main(wheel: str) -> int:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode())
    problems = [f"unexpected file in the wheel: {n}" for n in names
                if not n.startswith(("jaxcomm/", "jaxcomm-"))]  # fmt: skip
    for key, want in (("Name", project["name"]), ("Version", project["version"]),
                      ("Requires-Python", project["requires-python"])):  # fmt: skip
        if meta[key] != want:
            problems.append(f"{key}: {meta[key]!r}, pyproject says {want!r}")
    requires = meta.get_all("Requires-Dist") or []
    runtime = sorted(r for r in requires if "extra ==" not in r)
    if _parsed(runtime) != _parsed(project["dependencies"]):
        problems.append(f"runtime requirements {runtime} differ from pyproject's")
    extras = set(meta.get_all("Provides-Extra") or [])
    if extras != set(project["optional-dependencies"]):
        problems.append(f"extras {sorted(extras)} differ from pyproject's")
    if not meta.get_payload().strip():
        problems.append("no long description (the README)")
    for p in problems:
        print(f"check_wheel: {p}", file=sys.stderr)
    print(f"check_wheel: {Path(wheel).name}: {len(names)} files, requires {runtime}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
