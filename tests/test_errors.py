"""Tests for runtime.errors."""

from __future__ import annotations

import inspect
import pickle

import pytest

import runtime
from runtime import LoraSource, errors
from runtime.errors import StatusError

# Every class the module defines (exported by the package, where users catch them): its
# status code and the built-in it also is (None: none).
HIERARCHY = {
    runtime.InvalidArgumentError: ("INVALID_ARGUMENT", ValueError),
    runtime.NotFoundError: ("NOT_FOUND", LookupError),
    runtime.AlreadyExistsError: ("ALREADY_EXISTS", None),
    runtime.FailedPreconditionError: ("FAILED_PRECONDITION", RuntimeError),
    runtime.ResourceExhaustedError: ("RESOURCE_EXHAUSTED", None),
    runtime.UnimplementedError: ("UNIMPLEMENTED", NotImplementedError),
    runtime.DataLossError: ("DATA_LOSS", None),
    runtime.InternalError: ("INTERNAL", RuntimeError),
    runtime.PermissionDeniedError: ("PERMISSION_DENIED", PermissionError),
    runtime.UnavailableError: ("UNAVAILABLE", ConnectionError),
}
# Built-ins a caller might catch; a class must be exactly the one mapped to it above.
BUILTINS = (ValueError, LookupError, RuntimeError, NotImplementedError, PermissionError, ConnectionError,
            OSError)


def test_the_table_covers_every_error_class_the_module_defines():
    defined = {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, StatusError) and obj is not StatusError and obj.__module__ == errors.__name__
    }
    assert defined == set(HIERARCHY)


def test_status_error_is_a_plain_exception_with_an_unknown_code():
    assert issubclass(StatusError, Exception)
    assert StatusError.code == "UNKNOWN"
    assert str(StatusError("boom")) == "UNKNOWN: boom"
    for builtin in BUILTINS:
        assert not issubclass(StatusError, builtin)


@pytest.mark.parametrize("cls", list(HIERARCHY), ids=lambda cls: cls.__name__)
def test_each_class_has_its_code_and_builtin(cls):
    code, builtin = HIERARCHY[cls]
    assert issubclass(cls, StatusError)
    assert cls.code == code
    assert cls("x").code == code
    if builtin is not None:
        assert issubclass(cls, builtin)
    # No accidental extra built-in: ``except ValueError`` must not catch a runtime.NotFoundError.
    for other in BUILTINS:
        if builtin is None or not issubclass(builtin, other):
            assert not issubclass(cls, other), f"{cls.__name__} is unexpectedly a {other.__name__}"


def test_codes_are_distinct():
    codes = [code for code, _ in HIERARCHY.values()]
    assert len(set(codes)) == len(codes)
    assert "UNKNOWN" not in codes


@pytest.mark.parametrize("cls", list(HIERARCHY), ids=lambda cls: cls.__name__)
def test_str_prefixes_the_code_and_keeps_the_message(cls):
    error = cls("model.tflite: no such signature")
    assert str(error) == f"{HIERARCHY[cls][0]}: model.tflite: no such signature"
    assert error.args == ("model.tflite: no such signature",)


def test_str_with_several_arguments_and_with_none():
    assert str(runtime.InvalidArgumentError("a", 1)) == "INVALID_ARGUMENT: ('a', 1)"
    assert str(runtime.NotFoundError()) == "NOT_FOUND"  # no dangling separator without a message


def test_permission_denied_keeps_oserror_fields_and_formatting():
    error = runtime.PermissionDeniedError(13, "Permission denied", "/secret/adapter.tflite")
    assert error.errno == 13
    assert error.filename == "/secret/adapter.tflite"
    assert str(error) == "PERMISSION_DENIED: [Errno 13] Permission denied: '/secret/adapter.tflite'"


def test_builtin_except_clauses_catch_the_matching_class():
    with pytest.raises(ValueError, match="^INVALID_ARGUMENT: bad shape$"):
        raise runtime.InvalidArgumentError("bad shape")
    with pytest.raises(LookupError):
        raise runtime.NotFoundError("adapter 7")
    with pytest.raises(RuntimeError):
        raise runtime.FailedPreconditionError("closed")
    with pytest.raises(NotImplementedError):
        raise runtime.UnimplementedError("DoRA")
    with pytest.raises(PermissionError):
        raise runtime.PermissionDeniedError("no read access")
    # ...and a status class without a built-in is caught by StatusError only.
    with pytest.raises(StatusError) as info:
        raise runtime.ResourceExhaustedError("KV cache full")
    assert not isinstance(info.value, (ValueError, RuntimeError, LookupError))


@pytest.mark.parametrize("cls", list(HIERARCHY), ids=lambda cls: cls.__name__)
def test_errors_survive_pickling(cls):
    copy = pickle.loads(pickle.dumps(cls("across processes")))
    assert type(copy) is cls
    assert str(copy) == f"{HIERARCHY[cls][0]}: across processes"


def test_errors_raised_by_the_runtime_carry_their_code():
    with pytest.raises(runtime.InvalidArgumentError) as info:
        LoraSource()
    assert str(info.value).startswith("INVALID_ARGUMENT: LoraSource takes exactly one of path= or buffer=")
