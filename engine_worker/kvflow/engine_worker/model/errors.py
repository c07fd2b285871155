"""The one exception a model load raises for anything the user can fix."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder or file that kvflow cannot load.

    The message names the file, the field or the tensor at fault and says what would work
    instead. Raised for bad input only; a broken invariant in our own code stays an assert.
    """
