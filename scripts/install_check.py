"""Exit 0 when everything scripts/install.sh would install is already there: nvllm's
dependencies and dev extras (pyproject.toml), the pinned CPU torch, the SmolLM2 wheel and
the build backend. Then install.sh re-links nvllm alone (no resolver, no isolated build
env), which saves most of a minute of pip talking to the index on every CI run. Any doubt
(a missing or too old package, no tomllib / packaging) exits 1: the full install runs.

Usage: python scripts/install_check.py TORCH_PIN EXTRA_REQUIREMENT...
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def requirements(extra_args: list[str]) -> list[str]:
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    # The build backend for the in-place re-link; setuptools >= 70.1 builds the editable
    # wheel without the separate `wheel` package.
    backend = [r for r in meta["build-system"]["requires"] if not r.startswith("wheel")]
    return (list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
            + backend + ["setuptools>=70.1"] + extra_args)


def missing(reqs: list[str]) -> list[str]:
    """The requirements the installed distributions do not satisfy."""
    from packaging.requirements import Requirement

    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            out.append(f"{text} (not installed)")
            continue
        # A local version label (2.13.0+cpu) satisfies ==2.13.0, as pip has it.
        if not req.specifier.contains(version.split("+")[0], prereleases=True):
            out.append(f"{text} (found {version})")
    return out


def main(argv: list[str]) -> int:
    try:
        gaps = missing(requirements(argv))
    except Exception as e:  # no tomllib (Python 3.10), no packaging, a malformed pin
        print(f"install_check: cannot tell ({e!r}), installing", file=sys.stderr)
        return 1
    for g in gaps:
        print(f"install_check: needs {g}", file=sys.stderr)
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
