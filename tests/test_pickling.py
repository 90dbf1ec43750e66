"""sparktrain.pickling: the user's code travels by value and keeps its file name, so a rank's
or decode worker's traceback shows the user's line (Spark-free)."""
import pickle
import sys
import traceback

from sparktrain.pickling import dumps, dumps_code


def failing(batch):
    raise ValueError("cannot decode this image")


def _traceback_of(fn) -> str:
    try:
        fn({})
    except ValueError:
        return traceback.format_exc()
    raise AssertionError("did not raise")


def test_code_pickled_by_value_keeps_its_file_and_line():
    # this test module is not installed: dumps() pickles it by value, as for a user's script
    for blob in (dumps(failing), dumps_code(lambda b: failing(b))):
        restored = pickle.loads(blob)
        text = _traceback_of(restored)
        assert __file__ in text and "<dynamic-code>" not in text
        assert 'raise ValueError("cannot decode this image")' in text


def test_pickled_twice_still_names_the_file():
    # a rank re-pickles the function it received for its decode workers
    again = pickle.loads(dumps_code(pickle.loads(dumps(failing))))
    assert __file__ in _traceback_of(again)


def test_libraries_in_any_site_packages_travel_by_reference(tmp_path, monkeypatch):
    """A library outside the interpreter's own site-packages (a user site, Debian's
    dist-packages, Databricks' notebook-scoped libraries) is installed, not the user's code;
    a module in another folder on sys.path is the user's."""
    import importlib

    for folder, name in (("envs/nb/lib/python3/site-packages", "nb_scoped_lib"),
                         ("usr/lib/python3/dist-packages", "debian_lib"),
                         ("my_project", "my_helpers")):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / f"{name}.py").write_text("def f():\n    return 1\n")
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    blobs = {name: dumps(importlib.import_module(name).f)
             for name in ("nb_scoped_lib", "debian_lib", "my_helpers")}
    assert b"nb_scoped_lib" in blobs["nb_scoped_lib"] and len(blobs["nb_scoped_lib"]) < 100
    assert len(blobs["debian_lib"]) < 100  # by reference: module and name only
    assert len(blobs["my_helpers"]) > 200  # by value: the function's code travels
    for name in blobs:
        sys.modules.pop(name, None)
