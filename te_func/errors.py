"""The misuses te_func detects, one class each, with the offending thing as attributes
(`entry`, `layer`, `expected`, `got`, `recipe`, where the error has them).

Every class subclasses the builtin exception it replaces, so code that catches `KeyError` or
`ValueError` keeps working; `te_func.Error` catches all of them. The table of classes and when
each is raised is in docs/architecture.md."""
from __future__ import annotations

__all__ = ["Error", "WorkspaceError", "MissingEntryError", "UnknownEntryError", "EntryMismatchError",
           "RecipeMismatchError", "UnknownParameterError", "TransformError", "DerivativeError", "UnrecordedAmaxError",
           "FrozenModelError", "HighPrecisionWarning"]


class Error(Exception):
    """Base of te_func's errors: `Error(message, **attributes)`."""

    def __init__(self, message: str, **attributes):
        super().__init__(message)
        self.__dict__.update(attributes)

    def __str__(self) -> str:
        # The message as written (KeyError's own str would quote it).
        return str(self.args[0]) if self.args else ""


class WorkspaceError(Error):
    """The workspaces given do not fit the model and recipe they are run with."""


class MissingEntryError(WorkspaceError, KeyError):
    """A workspace entry the model needs is missing. Attributes: entry."""


class UnknownEntryError(WorkspaceError, KeyError):
    """Workspace entries that belong to no te_func layer of the model. Attributes: entries."""


class EntryMismatchError(WorkspaceError, ValueError):
    """A workspace entry of the wrong shape, dtype, device or layout. Attributes: entry, expected, got."""


class RecipeMismatchError(WorkspaceError, ValueError):
    """Workspaces or a frozen checkpoint made for another recipe or format (`recipe`: the one run with)."""


class UnknownParameterError(Error, KeyError):
    """Keys of the params given to tef.functional_call that name no parameter or buffer of the model.
    Attributes: keys, nearest (the closest real name, or None)."""


class TransformError(Error, RuntimeError):
    """A transform, autograd mode or call pattern te_func refuses rather than compute wrongly (`layer`)."""


class DerivativeError(TransformError, NotImplementedError):
    """A derivative te_func's ops do not give in this setting."""


class UnrecordedAmaxError(TransformError):
    """A DelayedScaling backward whose output gradient's amax nothing can record (a compiled
    backward outside tef.grad and tef.Stateful). Attributes: op."""


class FrozenModelError(Error, RuntimeError, ValueError):
    """A frozen model trained (RuntimeError) or handed to tef.Stateful (ValueError)."""


class HighPrecisionWarning(UserWarning):
    """te_func layers ran outside every frame, so in high precision."""
