"""Wheels packed back from a venv's installed files, and which of them an image needs."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ringwright.devcluster.wheelhouse import (
    Installed,
    WheelhouseError,
    closure,
    ensure_set,
    installed,
    repack,
    set_digest,
    site_packages,
)


def _record_row(site: Path, rel: str) -> str:
    data = (site / rel).read_bytes()
    b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={b64},{len(data)}"


def _fake_venv(root: Path) -> Path:
    """A venv holding `demo-pkg` 1.0 as pip leaves it: a module, a bytecode cache, an
    entry-point script, a data script pointed at the venv's python, and a manual page."""
    site = root / "lib" / "python3.11" / "site-packages"
    info = site / "demo_pkg-1.0.dist-info"
    (site / "demo_pkg" / "__pycache__").mkdir(parents=True)
    info.mkdir()
    (root / "bin").mkdir()
    (root / "share" / "man" / "man1").mkdir(parents=True)
    files = {
        "demo_pkg/__init__.py": "VALUE = 42\n",
        "demo_pkg/__pycache__/__init__.cpython-311.pyc": "compiled",
        "demo_pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: demo-pkg\n"
                                           "Version: 1.0\nRequires-Dist: other>=2\n",
        "demo_pkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                        "Tag: py2-none-any\nTag: py3-none-any\n",
        "demo_pkg-1.0.dist-info/entry_points.txt": "[console_scripts]\n"
                                                   "demo-tool = demo_pkg:main\n",
        "demo_pkg-1.0.dist-info/INSTALLER": "pip\n",
        "../../../bin/demo-tool": "#!/venv/bin/python\nimport demo_pkg\n",
        "../../../bin/demo-script": f"#!{root}/bin/python\nprint('hi')\n",
        "../../../share/man/man1/demo.1": ".TH DEMO 1\n",
    }
    for rel, text in files.items():
        (site / rel).write_text(text)
    rows = [_record_row(site, rel) for rel in files]
    (info / "RECORD").write_text("\n".join([*rows, "demo_pkg-1.0.dist-info/RECORD,,"]) + "\n")
    return root


def test_a_repacked_wheel_holds_what_the_wheel_held(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path / "venv")
    dist = installed(site_packages(venv))["demo-pkg"]
    out = tmp_path / "out"
    out.mkdir()
    wheel = repack(dist, out)
    assert wheel.name == "demo_pkg-1.0-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == {
            "demo_pkg/__init__.py", "demo_pkg-1.0.dist-info/METADATA",
            "demo_pkg-1.0.dist-info/WHEEL", "demo_pkg-1.0.dist-info/entry_points.txt",
            "demo_pkg-1.0.data/scripts/demo-script", "demo_pkg-1.0.data/data/share/man/man1/demo.1",
            "demo_pkg-1.0.dist-info/RECORD"}
        assert z.read("demo_pkg-1.0.data/scripts/demo-script").startswith(b"#!python\n")
        record = list(csv.reader(io.StringIO(z.read("demo_pkg-1.0.dist-info/RECORD").decode())))
    for name, digest, size in record:
        if name.endswith("RECORD"):
            continue
        with zipfile.ZipFile(wheel) as z:
            data = z.read(name)
        b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={b64}", len(data))


def test_what_the_installer_made_leaves_the_digest_alone(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path / "venv")
    site = site_packages(venv)
    before = installed(site)["demo-pkg"].digest
    record = site / "demo_pkg-1.0.dist-info" / "RECORD"
    # Another venv: other bytecode, an entry-point script naming another interpreter.
    for rel, text in (("demo_pkg/__pycache__/__init__.cpython-311.pyc", "other"),
                      ("../../../bin/demo-tool", "#!/other/bin/python\nimport demo_pkg\n")):
        old = _record_row(site, rel)
        (site / rel).write_text(text)
        record.write_text(record.read_text().replace(old, _record_row(site, rel)))
    assert installed(site)["demo-pkg"].digest == before


def test_pip_installs_the_repacked_wheel(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path / "venv")
    out = tmp_path / "out"
    out.mkdir()
    wheel = repack(installed(site_packages(venv))["demo-pkg"], out)
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                    "--no-deps", "--no-compile", "--prefix", str(prefix), str(wheel)],
                   check=True, cwd=tmp_path)
    site = site_packages(prefix)
    assert (site / "demo_pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (prefix / "share" / "man" / "man1" / "demo.1").read_text() == ".TH DEMO 1\n"
    assert (prefix / "bin" / "demo-script").read_text().endswith("print('hi')\n")
    assert (prefix / "bin" / "demo-tool").is_file()  # written by pip from the entry point


def _dist(name: str, version: str, *requires: str) -> Installed:
    return Installed(name, version, Path(f"/nowhere/{name}-{version}.dist-info"), requires,
                     f"digest-of-{name}-{version}")


DISTS = {d.name: d for d in (
    _dist("app", "1.0", "lib>=2", "tool; extra == 'cli'", "winonly; sys_platform == 'win32'"),
    _dist("lib", "2.5", "base"),
    _dist("tool", "0.3", "base>=1"),
    _dist("base", "1.1"),
    _dist("horovod", "0.28.1", "tool"),
)}


def test_the_closure_follows_dependencies_extras_and_markers() -> None:
    names = [d.name for d in closure(["app"], DISTS, Path("/venv"))]
    assert names == ["app", "base", "lib"]
    names = [d.name for d in closure(["app[cli]"], DISTS, Path("/venv"))]
    assert names == ["app", "base", "lib", "tool"]
    # Roots carry markers too (a wheel's Requires-Dist lists its test extras).
    names = [d.name for d in closure(["lib", "missing; extra == 'test'"], DISTS, Path("/v"))]
    assert names == ["base", "lib"]


def test_a_left_out_distribution_is_not_followed() -> None:
    names = [d.name for d in closure(["horovod", "lib"], DISTS, Path("/venv"),
                                     leave_out=["horovod"])]
    assert names == ["base", "lib"]


def test_the_closure_refuses_a_venv_that_does_not_satisfy_the_image() -> None:
    with pytest.raises(WheelhouseError, match=r"needs lib>=3 but /venv has lib 2.5"):
        closure(["lib>=3"], DISTS, Path("/venv"))
    with pytest.raises(WheelhouseError, match="does not have missing"):
        closure(["missing"], DISTS, Path("/venv"))


def test_a_set_is_named_by_its_members(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path / "venv")
    dist = installed(site_packages(venv))["demo-pkg"]
    folder = ensure_set(tmp_path / "wheelhouse", [dist])
    assert folder.name == set_digest([dist])[:16]
    assert [p.name for p in folder.iterdir()] == ["demo_pkg-1.0-py2.py3-none-any.whl"]
    assert ensure_set(tmp_path / "wheelhouse", [dist]) == folder
    # Another installed file (its RECORD changes) is another set.
    site = site_packages(venv)
    old = _record_row(site, "demo_pkg/__init__.py")
    (site / "demo_pkg" / "__init__.py").write_text("VALUE = 43\n")
    record = dist.dist_info / "RECORD"
    record.write_text(record.read_text().replace(old, _record_row(site, "demo_pkg/__init__.py")))
    changed = installed(site_packages(venv))["demo-pkg"]
    assert set_digest([changed]) != set_digest([dist])
