"""A test's warning rebuilt in pytest's process (``replay.decode_warning``): its category
is the class itself where pytest has its module already, else a class named as it is, of
its nearest builtin base; nothing is imported and no code of the named module runs."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

from pytest_gpuiso.parent import replay, standins
from pytest_gpuiso.wire import frames, payloads


class Outer:
    class NestedWarning(DeprecationWarning):
        pass


class TwoArgsWarning(UserWarning):
    def __init__(self, first, second):
        super().__init__(first, second)


def _frame(module: str, name: str, base: str = "UserWarning", message: str = "m") -> dict:
    payload = {
        "message": message,
        "category_module": module,
        "category_name": name,
        "category_base": base,
        "filename": "test_x.py",
        "lineno": 3,
        "nodeid": "test_x.py::test_x",
    }
    return frames.check((frames.WARNING, payload))[1]


def test_a_module_pytest_has_not_imported_is_not_imported(tmp_path, monkeypatch):
    name = "gpuiso_unit_never_imported"
    (tmp_path / f"{name}.py").write_text(
        "open(__file__ + '.ran', 'w').close()\nclass TracerWarning(Warning): pass\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    frame = _frame(name, "TracerWarning", "DeprecationWarning", "traced")
    message, category = replay.decode_warning(frame)
    assert name not in sys.modules
    assert not (tmp_path / f"{name}.py.ran").exists()
    assert (category.category_module, category.__qualname__, category.__name__) == (
        name,
        "TracerWarning",
        "TracerWarning",
    )
    assert issubclass(category, DeprecationWarning)
    assert type(message) is category and str(message) == "traced"
    # what pytest's warnings summary shows of it
    shown = warnings.formatwarning(str(message), category, "test_x.py", 3)
    assert shown.startswith("test_x.py:3: TracerWarning: traced")
    # the same category again is the same class; another module's is another
    assert replay.decode_warning(frame)[1] is category
    assert replay.decode_warning(_frame("other", "TracerWarning"))[1] is not category


def test_a_nested_category_keeps_its_qualified_name():
    _, category = replay.decode_warning(
        _frame("gpuiso_unit_absent.jit", "Tracer.InnerWarning", "FutureWarning")
    )
    assert (category.category_module, category.__qualname__, category.__name__) == (
        "gpuiso_unit_absent.jit",
        "Tracer.InnerWarning",
        "InnerWarning",
    )
    assert category.__mro__[1] is FutureWarning


@pytest.mark.parametrize(
    ("module", "name", "expected"),
    [
        ("builtins", "UserWarning", UserWarning),
        ("builtins", "ResourceWarning", ResourceWarning),
        (pytest.PytestWarning.__module__, "PytestWarning", pytest.PytestWarning),
        (__name__, "Outer.NestedWarning", Outer.NestedWarning),
    ],
)
def test_a_category_whose_module_is_imported_is_itself(module, name, expected):
    message, category = replay.decode_warning(_frame(module, name, message="hello"))
    assert category is expected
    assert type(message) is expected and str(message) == "hello"


def test_a_category_that_refuses_the_message_still_is_itself():
    message, category = replay.decode_warning(_frame(__name__, "TwoArgsWarning"))
    assert category is TwoArgsWarning
    assert type(message) is UserWarning and str(message) == "m"


@pytest.mark.parametrize(
    ("module", "name"),
    [("os", "path"), ("subprocess", "Popen"), ("builtins", "ValueError"), (__name__, "Outer")],
)
def test_a_name_that_is_no_warning_category_here_is_a_stand_in(module, name):
    message, category = replay.decode_warning(_frame(module, name))
    assert category.__mro__[1:3] == (UserWarning, Warning)
    assert (category.category_module, category.__qualname__) == (module, name)
    assert type(message) is category


def test_no_code_of_an_imported_module_runs(monkeypatch):
    """Not a module's ``__getattr__`` (a lazy module's imports) nor its or a class's
    ``__getattribute__``: the namespaces are read directly."""
    calls = []

    class Sneaky(types.ModuleType):
        def __getattribute__(self, name):
            calls.append(name)
            return super().__getattribute__(name)

    class Meta(type):
        def __getattribute__(cls, name):
            calls.append(name)
            return super().__getattribute__(name)

    class Holder(metaclass=Meta):
        class RealWarning(UserWarning):
            pass

    module = Sneaky("gpuiso_unit_sneaky")
    module.Holder = Holder
    module.__getattr__ = lambda name: calls.append(name)
    monkeypatch.setitem(sys.modules, "gpuiso_unit_sneaky", module)
    real = Holder.RealWarning
    calls.clear()
    _, found = replay.decode_warning(_frame("gpuiso_unit_sneaky", "Holder.RealWarning"))
    assert found is real
    _, absent = replay.decode_warning(_frame("gpuiso_unit_sneaky", "LazyWarning"))
    assert absent.__qualname__ == "LazyWarning"
    assert calls == []


@pytest.mark.parametrize("base", ["GpuIsoLeakWarning", "ValueError", "os.system", ""])
def test_a_base_that_is_no_builtin_warning_is_user_warning(base):
    _, category = replay.decode_warning(_frame("gpuiso_unit_absent", f"Base{base}", base))
    assert category.__mro__[1] is UserWarning


@pytest.mark.parametrize(
    "name", ["Bad\x00Warning", "Bad\udcffWarning", "Bad-Warning", "__Dunder__"]
)
def test_a_name_no_class_can_have_is_its_base(name):
    message, category = replay.decode_warning(_frame("gpuiso_unit_absent", name, "BytesWarning"))
    assert category is BytesWarning and type(message) is BytesWarning


def test_what_the_test_process_sends_rebuilds_to_the_same_name_and_base():
    class Middle(ResourceWarning):
        pass

    class LocalWarning(Middle):  # defined in a function: no module has it by this name
        pass

    record = warnings.WarningMessage(LocalWarning("closed"), LocalWarning, "test_x.py", 3)
    payload = payloads.encode_warning(record, "test_x.py::test_x")
    assert payload["category_base"] == "ResourceWarning"
    message, category = replay.decode_warning(frames.check((frames.WARNING, payload))[1])
    assert category is not LocalWarning
    assert (category.category_module, category.__qualname__) == (
        __name__,
        LocalWarning.__qualname__,
    )
    assert category.__mro__[1] is ResourceWarning
    assert str(message) == "closed"


def test_xdist_controller_rebuilds_a_stand_in_by_importing_only_ours():
    """xdist's controller rebuilds a worker's warning from the category's module and
    class name (``importlib.import_module`` then ``getattr``): for a stand-in that is
    ``standins``, which answers the name with a class of that name."""
    import importlib

    _, category = replay.decode_warning(_frame("gpuiso_unit_absent", "Outer.TracerWarning"))
    assert category.__module__ == standins.__name__ == "pytest_gpuiso.parent.standins"
    rebuilt = getattr(importlib.import_module(category.__module__), category.__name__)
    assert rebuilt.__name__ == "TracerWarning" and issubclass(rebuilt, UserWarning)
    assert standins.TracerWarning is rebuilt  # one class per name
    assert str(rebuilt("traced")) == "traced"


@pytest.mark.parametrize("name", ["__path__", "__wrapped__", "not-a-name", ""])
def test_stand_in_module_answers_no_dunder_or_non_name(name):
    with pytest.raises(AttributeError):
        getattr(standins, name)
