"""The build context as .dockerignore selects it: what the image cache is keyed on."""

from __future__ import annotations

from pathlib import Path

from ringwright.devcluster.build_context import (
    context_files,
    digest_files,
    excluded,
    parse_rules,
)
from ringwright.devcluster.images import ROOT

RULES = parse_rules("""
# an allowlist, as the project's
*
!src/
!scripts/keep.sh
**/__pycache__
**/*.py[cod]
src/generated
!src/generated/kept.py
""")


def test_a_folder_rule_covers_everything_below_it() -> None:
    assert not excluded("src/pkg/mod.py", RULES)
    assert excluded("tests/test_x.py", RULES)
    assert excluded("src/generated/deep/file.py", RULES)


def test_the_last_matching_line_wins() -> None:
    assert not excluded("scripts/keep.sh", RULES)
    assert excluded("scripts/other.sh", RULES)
    assert not excluded("src/generated/kept.py", RULES)


def test_double_star_spans_any_depth_including_none() -> None:
    assert excluded("src/__pycache__/mod.cpython-311.pyc", RULES)
    assert excluded("src/a/b/mod.pyc", RULES)
    assert not excluded("src/a/b/mod.py", RULES)
    assert excluded("__pycache__", parse_rules("**/__pycache__"))


def test_the_walk_applies_the_rules_and_reaches_taken_back_files(tmp_path: Path) -> None:
    (tmp_path / ".dockerignore").write_text("*\n!src/\nsrc/gen\n!src/gen/kept.py\n")
    for rel in ("src/a.py", "src/gen/x.py", "src/gen/kept.py", "tests/t.py", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "src" / "link").symlink_to("a.py")
    assert context_files(tmp_path) == ["src/a.py", "src/gen/kept.py", "src/link"]


def test_the_digest_follows_contents_names_and_the_executable_bit(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("echo 1\n")
    first = digest_files(tmp_path, ["run.sh"])
    script.chmod(0o755)
    executable = digest_files(tmp_path, ["run.sh"])
    script.write_text("echo 2\n")
    changed = digest_files(tmp_path, ["run.sh"])
    assert len({first, executable, changed}) == 3
    assert digest_files(tmp_path, ["run.sh"]) == changed


def test_the_project_context_carries_the_examples_and_no_tests() -> None:
    files = context_files(ROOT)
    assert "examples/train_elastic.py" in files
    assert "runtime/elastic.py" in files and "scripts/build_horovod.sh" in files
    assert [f for f in files if f.startswith("scripts/horovod-patches/")]
    assert not [f for f in files if f.startswith(("tests/", "charts/", "devcluster/go/",
                                                  "build/"))]
    assert not [f for f in files if "__pycache__" in f]
