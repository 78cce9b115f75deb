"""Typed exceptions. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class EdgeMoeError(Exception):
    """Base class of all edgemoe errors; the CLI prints these as one line."""


class ModelLoadError(EdgeMoeError):
    """The model file is missing, not a GGUF, truncated or corrupt, or llama.cpp refused it."""


class UnsupportedArchitectureError(ModelLoadError):
    """The GGUF declares an architecture llama.cpp (and so edgemoe) does not know."""


class InvalidHyperparameterError(ModelLoadError):
    """The GGUF's header parses but a hyper-parameter in it is impossible (llama.cpp would abort on it)."""


class NativeLibraryError(EdgeMoeError):
    """The patched llama.cpp library is missing, stock, or too old for this edgemoe."""


class PatchApplyError(EdgeMoeError):
    """A patch of the series does not apply to the vendored llama.cpp."""


class NonFiniteLogitsError(EdgeMoeError):
    """llama.cpp computed NaN or infinite logits: the model's weights (or a hook's edits) are not finite."""


class ContextOverflowError(EdgeMoeError):
    """The prompt (plus requested tokens) does not fit into the context window."""


class InvalidConfigError(EdgeMoeError, ValueError):
    """A load setting (threads, batch, expert_used_count override) is outside what llama.cpp accepts."""


class InvalidSizeError(EdgeMoeError, ValueError):
    """A size such as --vram 6GiB could not be parsed."""


class EngineBusyError(EdgeMoeError):
    """The Engine is decoding for another thread (or a hook tried to close it mid-decode)."""


class EngineClosedError(EdgeMoeError):
    """The Engine was closed: its model and context are gone."""


class AssignmentError(EdgeMoeError, ValueError):
    """A CPU/GPU expert assignment got an impossible input (a negative workload, a bad cost table)."""


class AssignmentTooLargeError(AssignmentError):
    """An exact assignment solver was asked for more active experts than it can enumerate."""
