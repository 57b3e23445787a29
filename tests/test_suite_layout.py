"""The test tree itself: `pytest tests` imports every test module by its base name
(the directories have no __init__.py), so two modules of one name in different
directories stop the whole collection (conftest.py files are imported by path)."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_name_of_its_own():
    seen = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" in path.parts or path.name == "conftest.py":
            continue
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a name: {clashes}"


def test_no_test_module_imports_from_conftest():
    # A sub-suite's conftest.py collected first becomes the module named
    # conftest; plain helpers live in modules of their own (random_data.py).
    offenders = [
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if "__pycache__" not in path.parts
        and ("from conftest import" in path.read_text() or "import conftest" in path.read_text())
        and path.name != "test_suite_layout.py"
    ]
    assert not offenders, f"modules importing from conftest: {offenders}"
