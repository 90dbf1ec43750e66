"""sparktrain.pickling: the user's code travels by value and keeps its file name, so a rank's
or decode worker's traceback shows the user's line (Spark-free)."""
import pickle
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
