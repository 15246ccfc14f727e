"""The wheel holds every module: each folder of Python code is a package pyproject names.

``pyproject.toml`` lists the packages by hand (the folders map onto one namespace, which
setuptools cannot discover); a folder missing from the list is missing from the images,
which then fail at import while the checkout's editable install works.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_folder_of_modules_is_a_listed_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, folder in config["package-dir"].items():
        for module in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in module.parts:
                continue
            inner = module.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *inner)))
    missing = sorted(found - listed)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"
    assert not sorted(listed - found), "pyproject.toml lists packages that have no modules"
