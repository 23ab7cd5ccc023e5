"""Users' code named as "package.module:function" (their models and datasets), imported like `python -m`
would: an installed module, else one under the working directory."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hetpipe.core.errors import UsageError

__all__ = ["import_object", "import_target"]


def _import_module(name: str) -> ModuleType:
    """importlib.import_module, with the working directory tried last when the module is not found."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        top = name.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top or here in sys.path or "" in sys.path:
            raise
        if not any(os.path.exists(os.path.join(here, top + suffix)) for suffix in ("", ".py")):
            raise
        sys.path.append(here)  # after the installed packages; children started from here inherit it
        return importlib.import_module(name)


def _module_of(target: str, what: str, form: str, example: str) -> tuple[ModuleType, str]:
    """(the imported module, the attribute name) of `target` written as `form` ("package.module:function")."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise UsageError(f'{what}: write it as "{form}", e.g. "{example}"')
    try:
        return _import_module(module_name), attr
    except ImportError as exc:
        raise UsageError(
            f'cannot import "{module_name}" for {what}: {exc}; install the package, run from the '
            "directory that holds it, or add that directory to PYTHONPATH"
        ) from exc


def import_object(target: str, what: str, example: str) -> object:
    """The object named by `target` ("package.module:attr"); `what` names its use in errors, `example` is a
    name of that form to show."""
    module, attr = _module_of(target, what, "package.module:attr", example)
    if not hasattr(module, attr):
        raise UsageError(f'"{module.__name__}" has no "{attr}" for {what}; write it as "package.module:attr"')
    return getattr(module, attr)


def import_target(target: str, what: str) -> Callable[..., Any]:
    """The function named by `target` ("package.module:function"); `what` names its use in errors
    (e.g. 'model "examples.tiny_convnet:build"')."""
    module, attr = _module_of(target, what, "package.module:function", "examples.tiny_convnet:build")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(
            f'"{module.__name__}" has no function "{attr}" for {what}; write it as "package.module:function"'
        )
    return fn
